"""fedpar.aggregation"""

"""fedpar.protocol"""

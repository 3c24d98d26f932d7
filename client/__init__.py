"""fedpar.client"""

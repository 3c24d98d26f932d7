"""fedpar.models"""

"""fedpar.cli"""

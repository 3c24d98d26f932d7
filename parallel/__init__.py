"""fedpar.parallel"""

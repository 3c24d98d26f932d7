"""fedpar.server"""

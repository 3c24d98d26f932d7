"""fedpar.simulations"""

"""fedpar.datasets"""

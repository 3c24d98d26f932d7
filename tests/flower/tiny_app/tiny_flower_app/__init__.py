"""A tiny Flower App: linear regression on synthetic data, each partition its own slope."""

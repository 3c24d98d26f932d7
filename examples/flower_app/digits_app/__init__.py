"""digits-app: a Flower App on the bundled 8x8 digits."""

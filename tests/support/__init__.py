"""Test support: helpers the tests (and benchmarks) share, kept out of the installed package."""

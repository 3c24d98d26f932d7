"""Entry point for ``python -m fedpar`` (used by torchrun: ``torchrun ... -m fedpar train``)."""

from fedpar.cli.entry import entry

if __name__ == "__main__":
    entry()

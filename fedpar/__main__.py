"""Entry point for ``python -m fedpar`` (used by torchrun: ``torchrun ... -m fedpar train``)."""

from fedpar.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())

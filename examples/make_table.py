"""Write examples/table.csv, the table the README's own task runs on: scikit-learn's wine data (178 wines, 3
cultivars as the label 0-2, 13 chemical measurements), each feature standardised to mean 0 and standard deviation 1
and written with 3 decimals.

    python examples/make_table.py [OUT.csv]
"""

import sys
from pathlib import Path

import numpy as np
from sklearn.datasets import load_wine


def write_table(path: Path) -> Path:
    """The wine table as CSV at ``path``: a header row, 13 numeric feature columns, a whole-number label column."""
    wine = load_wine()
    x = (wine.data - wine.data.mean(axis=0)) / wine.data.std(axis=0)
    names = [name.replace("/", "_") for name in wine.feature_names]
    lines = [",".join([*names, "label"])]
    lines += [",".join([*(f"{v:.3f}" for v in row), str(int(label))]) for row, label in zip(x, wine.target)]
    path.write_text("\n".join(lines) + "\n")
    return path


if __name__ == "__main__":
    print(f"wrote {write_table(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name('table.csv'))}")

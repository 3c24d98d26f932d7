"""Your own tabular data with writers: ``--dataset npz:PATH`` or ``--dataset csv:PATH``, for ``--partition natural``.

- npz: arrays ``x`` (real numbers, one example per row: 2-D or more), ``y`` (integer labels: class numbers
  0..K-1, two classes or more) and, optionally, ``client`` (1-D: who wrote each example, integers or strings).
- csv: a comma-separated header row; a ``label`` column (whole numbers, of two classes or more; ``1.0`` is class
  1), an optional ``client`` column (no blank cell; its ids are text, as written: ``1``, ``01`` and ``1.0`` are
  three clients), and every other column (one at least) a numeric feature; one cell per column on every row
  (blank lines are skipped).

Clients are numbered in the sorted order of their ids. A fifth of each client's examples (one at least, for
clients of two or more) is held out as the pooled test set, as for the synthetic data; without a client column
the whole file is one owner-less pool (use iid, dirichlet or shards then) and a fifth of it (one at least, of
two or more), drawn at random, is the test set; a table that leaves no test example is refused.
"""

from __future__ import annotations

import csv
import zipfile
from typing import Callable
import zlib
from pathlib import Path

import numpy as np

from fedpar.datasets.arrays import ArrayDataset, DatasetSplits
from fedpar.datasets.catalog import register_dataset

TEST_SHARE = 5  # one example in TEST_SHARE of each client's goes to the test set
MAX_CLASSES = 1 << 16  # labels are class numbers: one past this is an id (the model's output would not fit memory)
SPARSE_FROM = 1 << 10  # past this many class numbers, most of them unused means the labels are ids, not classes
# A feature past this has a square beyond float32's range (about 3.4e38): losses, norms and the first steps overflow.
LARGEST_FEATURE = float(np.sqrt(np.finfo(np.float32).max))


def owned_splits(x: np.ndarray, y: np.ndarray, owners: np.ndarray | None, num_classes: int | None = None,
                 seed: int = 0) -> DatasetSplits:
    """Train and test sets from examples with (or without) owners: each owner's first fifth is held out."""
    y = np.asarray(y, np.int64)
    classes = int(num_classes if num_classes is not None else y.max() + 1)
    if owners is None:
        held_out = np.zeros(len(y), bool)
        held = max(1, len(y) // TEST_SHARE) if len(y) >= 2 else 0  # as for an owner's: one at least, of two or more
        held_out[np.random.default_rng(seed).permutation(len(y))[:held]] = True
    else:
        if np.any(owners[1:] < owners[:-1]):  # group each owner's examples (generated data comes grouped: no copy)
            order = np.argsort(owners, kind="stable")
            x, y, owners = x[order], y[order], owners[order]
        sizes = np.bincount(owners)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        position = np.arange(len(y)) - np.repeat(starts, sizes)  # an example's place within its owner's
        held_out = position < np.repeat(np.where(sizes >= 2, np.maximum(1, sizes // TEST_SHARE), 0), sizes)
    return DatasetSplits(ArrayDataset(x[~held_out], y[~held_out]), ArrayDataset(x[held_out], y[held_out]),
                         classes, tuple(x.shape[1:]),
                         train_owners=None if owners is None else owners[~held_out])


def owner_numbers(ids: np.ndarray) -> np.ndarray:
    """Each example's client as a number 0..K-1, in the sorted order of the ids."""
    _, numbers = np.unique(np.asarray(ids), return_inverse=True)
    return numbers.astype(np.int64)


NPZ_FILE = "an .npz file holding the arrays x, y and optionally client"
CSV_FILE = "a CSV file with a header row, a 'label' column and numeric features"


def _table_file(path: str | Path, what: str) -> Path:
    """``path``, a table's file; FileNotFoundError naming it and what it must be when it is none (said as a task
    that reads it raised, so not in the words of any flag)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} {_not_a_file(path)}; it must be {what}")
    return path


class DatasetFileMissing(FileNotFoundError, ValueError):
    """``--dataset KIND:PATH`` names no file: the user's input to change (exit 2, in one line), as a missing MNIST
    folder is. A ValueError for the commands that say a bad dataset as one (simulate, serve, client, train), and
    still a FileNotFoundError (no errno: said as its message) for code that catches that."""

    exit_code = 2


def _dataset_file(name: str, kind: str, what: str) -> str:
    """PATH of ``--dataset KIND:PATH``; DatasetFileMissing naming the option and what to pass when it is no file."""
    path = name.split(":", 1)[1]
    if not path.strip():  # else Path("") is the working folder, said to be "a folder"
        raise DatasetFileMissing(f"--dataset {kind}: names no file; pass the path of {what} after the colon, e.g. "
                                 f"--dataset {kind}:data/table.{kind}")
    if not Path(path).is_file():
        raise DatasetFileMissing(f"--dataset {kind}:{path}: {path} {_not_a_file(Path(path))}; pass the path of "
                                 f"{what}, e.g. --dataset {kind}:data/table.{kind}")
    return path


def _not_a_file(path: Path) -> str:
    """Why ``path``, which is no file, cannot be read."""
    if path.is_dir():
        return "is a folder"
    return "is not a regular file" if path.exists() else "does not exist"


def load_npz_table(path: str | Path) -> DatasetSplits:
    """A federation from an .npz with x, y and optionally client."""
    path = _table_file(path, NPZ_FILE)
    if not zipfile.is_zipfile(path):  # else np.load takes it for a pickle and says to load it unsafely
        raise ValueError(f"{path} is not a NumPy .npz archive (np.savez); it needs the arrays x, y and optionally "
                         "client")
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = {"x", "y"} - set(f.files)
            if missing:
                raise ValueError(f"{path} lacks the arrays {sorted(missing)}; it needs x, y and optionally client")
            x, y = _npz_array(f, path, "x"), _npz_array(f, path, "y")
            client = _npz_array(f, path, "client") if "client" in f.files else None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:  # damaged: cut short, a member unreadable
        raise ValueError(f"{path} cannot be read as a NumPy .npz archive ({exc}); save it again with "
                         "np.savez(path, x=..., y=...)") from None
    _check_npz_shapes(path, x, y, client)
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == bool):
        raise ValueError(f"{path}: x must be numeric, got dtype {x.dtype}")
    if np.iscomplexobj(x):  # else cast to float32 with only a warning: the imaginary parts silently dropped
        raise ValueError(f"{path}: x must be real numbers, got dtype {x.dtype}; save x.real, or the real and "
                         "imaginary parts as two features")
    return _checked(path, x, y, _npz_owners(path, client))


def _check_npz_shapes(path: Path, x: np.ndarray, y: np.ndarray, client: np.ndarray | None) -> None:
    """ValueError saying the shapes an .npz table's arrays must have when they have others."""
    if x.ndim < 2 or y.ndim != 1:  # a 1-D x is one feature per example to the loader, a batch of scalars to a model
        raise ValueError(f"{path}: x must hold one example per row with its features after (2-D or more; one feature "
                         f"each: x[:, None]) and y must be 1-D, got x {x.shape} and y {y.shape}")
    if client is not None and client.ndim != 1:
        raise ValueError(f"{path}: client must be 1-D, one id per example, got {client.shape}")


def _npz_owners(path: Path, client: np.ndarray | None) -> np.ndarray | None:
    """Each example's client as a number (None without a client array); ValueError when an id is NaN or blank."""
    if client is None:
        return None
    missing = _missing_ids(client)
    if missing.any():  # else every missing id is one client, "nan" or "": likely ids not filled in
        raise ValueError(f"{path}: client is NaN or blank for {int(missing.sum())} examples (the first is example "
                         f"{int(np.argmax(missing))}); give every example its client")
    return owner_numbers(client)


def _missing_ids(client: np.ndarray) -> np.ndarray:
    """Which of the ids ``client`` are missing: NaN (float ids) or blank (text ids)."""
    if np.issubdtype(client.dtype, np.floating):
        return np.isnan(client)
    if client.dtype.kind in "US":
        return np.char.strip(client) == ("" if client.dtype.kind == "U" else b"")
    return np.zeros(len(client), bool)


NPZ_KINDS = {"x": "a numeric", "y": "an integer", "client": "an integer or string"}


def _npz_array(f, path: Path, key: str) -> np.ndarray:
    """Array ``key`` of the open .npz ``f``; ValueError naming it when it holds Python objects (pickle: refused) or
    is no .npy array at all."""
    try:
        array = f[key]
    except ValueError as exc:
        if "allow_pickle" in str(exc):
            raise ValueError(f"{path}: array {key} holds Python objects, which need pickle and are refused; save it "
                             f"as {NPZ_KINDS[key]} array (np.savez(path, {key}=...) of a plain NumPy array)") from None
        raise ValueError(f"{path}: array {key} cannot be read ({exc})") from None
    if not isinstance(array, np.ndarray):  # a member that is no .npy: np.load hands back its raw bytes
        raise ValueError(f"{path}: {key} is not a NumPy array (the archive was not written by np.savez); it needs "
                         "the arrays x, y and optionally client")
    return array


def load_csv_table(path: str | Path) -> DatasetSplits:
    """A federation from a CSV with a label column, optionally a client column, and numeric features."""
    path = _table_file(path, CSV_FILE)
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: a spreadsheet's UTF-8 CSV starts with a BOM
            reader = csv.reader(f)
            header = next(reader, None)
            separator = _other_separator(header or [])
            if separator:  # else "needs a 'label' column" of a header that has one, unsplit
                raise ValueError(f"{path} looks separated by {separator}, not commas (its header row is one column); "
                                 "fedpar reads comma-separated files: save it with commas between the cells")
            if not header or "label" not in header:
                raise ValueError(f"{path} needs a header row with a 'label' column (and optionally 'client')")
            twice = [name for name in ("label", "client") if header.count(name) > 1]
            if twice:  # else the first is read and the others taken for features
                raise ValueError(f"{path}: its header names the column {twice[0]!r} {header.count(twice[0])} times; "
                                 "keep one, renaming the others")
            label, client = header.index("label"), header.index("client") if "client" in header else None
            rows, lines = _csv_rows(reader, len(header), client, path)
    except (UnicodeDecodeError, csv.Error) as exc:  # a binary file, e.g. an .npz or a spreadsheet's own format
        raise ValueError(f"{path} is not a CSV text file ({exc}); it must be {CSV_FILE}, in UTF-8") from None
    features = [i for i in range(len(header)) if i not in (label, client)]
    try:
        x = np.array([[float(r[i]) for i in features] for r in rows]).reshape(len(rows), len(features))
        y = np.array([_class_number(r[label]) for r in rows], np.int64)
    except ValueError:
        raise ValueError(_first_bad_cell(path, rows, lines, header, features, label)) from None
    except OverflowError:  # a label past int64: no class number
        raise ValueError(f"{path}: labels are class numbers 0..K-1 (K at most {MAX_CLASSES}), but one is beyond "
                         "int64; renumber them") from None
    owners = owner_numbers(np.array([r[client] for r in rows])) if client is not None else None
    return _checked(path, x, y, owners, lambda row, col: f"line {lines[row]}, column {header[features[col]]!r}")


def _first_bad_cell(path: Path, rows: list[list[str]], lines: list[int], header: list[str], features: list[int],
                    label: int) -> str:
    """The line naming the first cell of ``rows`` that is no number (a feature) or no whole number (the label), by its
    line and column."""
    for row, line in zip(rows, lines):
        for i in features:
            try:
                float(row[i])
            except ValueError:
                if not row[i].strip():
                    return f"{path}: line {line}, column {header[i]!r} is blank; fill in every feature, or drop the row"
                return (f"{path}: line {line}, column {header[i]!r} is {row[i].strip()!r}, not a number; every "
                        "feature must be numeric (drop the column, or encode it as numbers)")
        try:
            _class_number(row[label])
        except ValueError:
            return (f"{path}: line {line}, the label {row[label].strip()!r} is not a whole number; labels are class "
                    "numbers 0..K-1")
    return f"{path}: every row needs a whole-number label and numeric features"


SEPARATORS = {";": "';'", "\t": "tabs"}  # what a spreadsheet writes instead of commas, as a line says it


def _other_separator(header: list[str]) -> str | None:
    """How a one-column ``header`` looks separated (';' or tabs, said as SEPARATORS says them); None otherwise."""
    found = [sep for sep in SEPARATORS if len(header) == 1 and sep in header[0]]
    return SEPARATORS[max(found, key=header[0].count)] if found else None


def _class_number(cell: str) -> int:
    """A label cell as its class number: a whole number, written as one ('1') or as a float ('1.0', as pandas
    writes a float column); ValueError naming it when it is no whole number ('0.5', 'nan')."""
    try:
        return int(cell)
    except ValueError:
        value = float(cell)
    if not value.is_integer():
        raise ValueError(f"label {cell.strip()!r} is not a whole number")
    return int(value)


def _csv_rows(reader, width: int, client: int | None, path: Path) -> tuple[list[list[str]], list[int]]:
    """The data rows of ``reader``, blank lines skipped (a spreadsheet's trailing ones), and each one's line number;
    ValueError naming the first line whose cells are not one per column, or whose client is blank."""
    rows, lines = [], []
    for row in reader:
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != width:  # short: read as a missing feature; long: its extra cells silently dropped
            raise ValueError(f"{path}: line {reader.line_num} has {len(row)} cells but the header has {width} "
                             "columns; give every row one cell per column")
        if client is not None and not row[client].strip():
            raise ValueError(f"{path}: line {reader.line_num} has no client; fill in who wrote each example, or "
                             "drop the client column")
        rows.append(row)
        lines.append(reader.line_num)
    return rows, lines


def _checked(path, x: np.ndarray, y: np.ndarray, owners: np.ndarray | None,
             place: Callable[[int, int], str] | None = None) -> DatasetSplits:
    """The splits of a table's examples, once its labels and features are checked; ``place(example, feature)`` says
    where a bad feature is in the user's file."""
    y = np.asarray(y)
    if len(x) != len(y) or (owners is not None and len(owners) != len(y)) or not len(y):
        raise ValueError(f"{path}: x, y (and client) must hold the same, non-zero number of examples")
    if not np.prod(x.shape[1:]):  # else the model's refusal, in the words of its in_features
        raise ValueError(f"{path}: the examples have no features; give it at least one numeric feature (a csv: a "
                         "column besides label and client)")
    _check_labels(path, y)
    splits = owned_splits(_float32_features(path, x, place or _npz_place), y, owners)
    if not len(splits.test):  # else simulate reports no accuracy and train stops on an empty evaluation
        raise ValueError(f"{path}: its {len(y)} examples leave none for the test set (a fifth of each client's, "
                         "for clients of two or more); give it more examples")
    return splits


def _check_labels(path, y: np.ndarray) -> None:
    """ValueError saying what is wrong with labels ``y`` unless they are class numbers of two classes or more."""
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0:
        raise ValueError(f"{path}: labels must be whole numbers >= 0")
    if (y == y[0]).all():  # a classifier of one class learns nothing and scores 1.0: a wrong label column, likely
        raise ValueError(f"{path}: every label is {y[0]}; a classifier needs examples of two classes or more (is "
                         "'label' the right column?)")
    if y.max() >= MAX_CLASSES:
        raise ValueError(f"{path}: labels are class numbers 0..K-1 (K at most {MAX_CLASSES}), but one is {y.max()}; "
                         "renumber them, e.g. y = np.unique(y, return_inverse=True)[1]")
    used, numbers = len(np.unique(y)), int(y.max()) + 1
    if numbers > SPARSE_FROM and 2 * used < numbers:  # not renumbered here: a class keeps its number at every site
        raise ValueError(f"{path}: labels are class numbers 0..K-1, but only {used} of the {numbers} numbers "
                         f"0..{numbers - 1} occur (a model of {numbers} outputs, most never trained); renumber them "
                         f"0..{used - 1} the same way at every site, e.g. y = np.unique(y, return_inverse=True)[1]")


def _npz_place(example: int, feature: int) -> str:
    """Where feature ``feature`` (of the example's flattened features) of an .npz's example ``example`` is."""
    return f"example {example} (counting from 0), feature {feature}"


def _float32_features(path, x: np.ndarray, place: Callable[[int, int], str]) -> np.ndarray:
    """Features ``x`` as float32; ValueError naming (``place``) the first one that is NaN or Inf, or so large that
    training overflows on it."""
    rows = np.asarray(x, np.float64).reshape(len(x), -1)  # checked before the cast: 1e39 would become Inf
    bad = ~(np.abs(rows) <= LARGEST_FEATURE)  # NaN compares false: bad too
    if bad.any():
        row = int(np.flatnonzero(bad.any(axis=1))[0])
        col = int(np.flatnonzero(bad[row])[0])
        value = rows[row, col]
        if not np.isfinite(value):
            raise ValueError(f"{path}: {place(row, col)} is {value}: features must be finite numbers; drop or fill "
                             "in such examples")
        raise ValueError(f"{path}: {place(row, col)} is {value:g}, too large to train on (past about "
                         f"{LARGEST_FEATURE:.2g}, its square overflows float32): standardise that feature (e.g. to "
                         "mean 0 and sd 1, with the same statistics at every site), or drop such examples")
    return np.asarray(x, np.float32)


@register_dataset("npz", usage="npz:PATH", help="a table of features and labels")
def npz_dataset(name: str) -> DatasetSplits:
    """``--dataset npz:PATH``."""
    return load_npz_table(_dataset_file(name, "npz", NPZ_FILE))


@register_dataset("csv", usage="csv:PATH", help="a table of features and labels")
def csv_dataset(name: str) -> DatasetSplits:
    """``--dataset csv:PATH``."""
    return load_csv_table(_dataset_file(name, "csv", CSV_FILE))

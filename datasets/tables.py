"""Your own tabular data with writers: ``--dataset npz:PATH`` or ``--dataset csv:PATH``, for ``--partition natural``.

- npz: arrays ``x`` (real numbers, one example per row: 2-D or more), ``y`` (labels: class numbers 0..K-1, two
  classes or more, as integers or whole floats) and, optionally, ``client`` (1-D: who wrote each example, integers
  or strings).
- csv: a comma-separated header row (its names trimmed); a ``label`` column (whole numbers, of two classes or more;
  ``1.0`` is class 1), an optional ``client`` column (no blank cell; its ids are text, as written: ``1``, ``01`` and
  ``1.0`` are three clients), and every other column (one at least) a numeric feature; one cell per column on every row
  (blank lines are skipped).

Clients are numbered in the sorted order of their ids. A fifth of each client's examples (one at least, for
clients of two or more), drawn at random, is held out as the pooled test set, as for the synthetic data; without a
client column the whole file is one owner-less pool (use iid, dirichlet or shards then) and a fifth of it (one at
least, of two or more), drawn at random, is the test set; a table that leaves no test example is refused.
"""

from __future__ import annotations

import csv
import zipfile
from array import array
from typing import Callable
import zlib
from pathlib import Path

import numpy as np

from fedpar.datasets.arrays import ArrayDataset, DatasetSplits
from fedpar.datasets.catalog import register_dataset
from fedpar.datasets.memory import check_fits

TEST_SHARE = 5  # one example in TEST_SHARE of each client's goes to the test set
MAX_CLASSES = 1 << 16  # labels are class numbers: one past this is an id (the model's output would not fit memory)
SPARSE_FROM = 1 << 10  # past this many class numbers, most of them unused means the labels are ids, not classes
# A feature past this has a square beyond float32's range (about 3.4e38): losses, norms and the first steps overflow.
LARGEST_FEATURE = float(np.sqrt(np.finfo(np.float32).max))
# What one number of a table costs a process while it loads: read as float64 (8), checked (|x| 8, 1), kept as float32
# and split into train and test (4 + 4); an npz's array as saved comes on top.
NUMBER_BYTES = 25
CSV_SAMPLE = 1 << 20  # the first bytes of a CSV that say how many numbers a byte of it holds


def owned_splits(x: np.ndarray, y: np.ndarray, owners: np.ndarray | None, num_classes: int | None = None,
                 seed: int = 0) -> DatasetSplits:
    """Train and test sets from examples with (or without) owners: a fifth of each owner's, drawn at random (by
    ``seed``), is held out."""
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
        # An example's place in a random order of its owner's: not the file's order (the first fifth of a table
        # sorted by label would be a test set of its first classes, and those classes would not be trained on).
        shuffled = np.lexsort((np.random.default_rng(seed).random(len(y)), owners))
        position = np.empty(len(y), np.int64)
        position[shuffled] = np.arange(len(y)) - np.repeat(starts, sizes)
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
    check_table_fits(path, "npz")  # else numpy's MemoryError, a traceback
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
    y = _npz_labels(path, y)
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
    if len(x) != len(y):
        raise ValueError(f"{path}: x holds {len(x)} examples and y {len(y)}; give one label per example")
    if client is not None and len(client) != len(y):
        raise ValueError(f"{path}: x and y hold {len(y)} examples and client holds {len(client)}; give one client "
                         "per example")
    if not len(y):
        raise ValueError(f"{path}: x and y hold no examples; give it one row of x per example")


def _npz_labels(path: Path, y: np.ndarray) -> np.ndarray:
    """An .npz's labels ``y`` as integers: whole floats (as pandas keeps a column) are their class numbers;
    ValueError naming the first that is no class number, or the dtype of labels that are not numbers."""
    if np.issubdtype(y.dtype, np.integer):
        return y
    if not np.issubdtype(y.dtype, np.floating):
        raise ValueError(f"{path}: y holds {y.dtype}, not class numbers; labels are class numbers 0..K-1: number "
                         "them the same way at every site, e.g. y = np.unique(y, return_inverse=True)[1]")
    whole = np.isfinite(y) & (np.round(y) == y) & (np.abs(y) <= 2.0 ** 53)  # past 2^53 a float is no exact number
    if not whole.all():
        first = int(np.argmin(whole))
        raise ValueError(f"{path}: {_npz_label_place(first)} is {y[first]:g}, not a class number; labels are "
                         "class numbers 0..K-1")
    return y.astype(np.int64)


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
    check_table_fits(path, "csv")
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: a spreadsheet's UTF-8 CSV starts with a BOM
            reader = csv.reader(f)
            header = _csv_header(path, next(reader, None))
            label, client = header.index("label"), header.index("client") if "client" in header else None
            features = [i for i in range(len(header)) if i not in (label, client)]
            x, y, owners, lines = _csv_columns(reader, path, header, features, label, client)
    except (UnicodeDecodeError, csv.Error) as exc:  # a binary file, e.g. an .npz or a spreadsheet's own format
        raise ValueError(f"{path} is not a CSV text file ({exc}); it must be {CSV_FILE}, in UTF-8") from None
    if not len(y):
        raise ValueError(f"{path} has no examples: only its header row; give it one row per example")
    return _checked(path, x, y, owners, lambda row, col: f"line {lines[row]}, column {header[features[col]]!r}",
                    lambda row: f"line {lines[row]}, the label")


def _csv_header(path: Path, header: list[str] | None) -> list[str]:
    """The column names of a CSV's first row ``header``, trimmed (as typed: 'a, b, label'); ValueError saying what
    is wrong with it unless it names a 'label' column, and every column once at most."""
    header = [name.strip() for name in header or []]
    separator = _other_separator(header)
    if separator:  # else "needs a 'label' column" of a header that has one, unsplit
        raise ValueError(f"{path} looks separated by {separator}, not commas (its header row is one column); "
                         "fedpar reads comma-separated files: save it with commas between the cells")
    other = next((name for name in header if name.lower() in ("label", "client") and name.lower() != name), None)
    if other is not None:  # else 'Label' is no label column, and 'Client' silently a feature
        raise ValueError(f"{path}: its column {other!r} must be named {other.lower()!r}, in lower case")
    if "label" not in header:
        raise ValueError(f"{path} needs a header row with a 'label' column (and optionally 'client')")
    twice = [name for name in ("label", "client") if header.count(name) > 1]
    if twice:  # else the first is read and the others taken for features
        raise ValueError(f"{path}: its header names the column {twice[0]!r} {header.count(twice[0])} times; keep "
                         "one, renaming the others")
    if "" in header:  # else each row is told its cell there is blank, of a column the user never wrote
        unnamed = header.index("")
        trailing = unnamed == len(header) - 1
        raise ValueError(f"{path}: its header's column {unnamed + 1} has no name"
                         + (" (a trailing comma at the end of its lines?)" if trailing else "")
                         + ("; remove the trailing commas, or name every column" if trailing
                            else "; name every column"))
    return header


def _csv_columns(reader, path: Path, header: list[str], features: list[int], label: int, client: int | None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """The features, labels and owners (None without a client column) of the data rows of ``reader``, and each
    row's line number, read row by row into arrays (a few bytes a cell, not a string each); blank lines are skipped
    (a spreadsheet's trailing ones). ValueError naming the first line whose cells are not one per column, whose
    client is blank, or whose feature is no number or label no whole number."""
    values, labels, lines, codes, ids = array("d"), array("q"), array("q"), array("q"), {}
    width = len(header)
    for row in reader:
        if not any(cell.strip() for cell in row):
            continue
        line = reader.line_num
        if len(row) != width:  # short: read as a missing feature; long: its extra cells silently dropped
            raise ValueError(f"{path}: line {line} has {len(row)} cells but the header has {width} columns; give "
                             "every row one cell per column")
        if client is not None:
            if not row[client].strip():
                raise ValueError(f"{path}: line {line} has no client; fill in who wrote each example, or drop the "
                                 "client column")
            codes.append(ids.setdefault(row[client], len(ids)))
        try:
            values.extend([float(row[i]) for i in features])
        except ValueError:
            raise ValueError(_bad_feature(path, line, row, header, features)) from None
        try:
            labels.append(_class_number(row[label]))
        except ValueError:
            raise ValueError(f"{path}: line {line}, the label {row[label].strip()!r} is not a whole number; labels "
                             "are class numbers 0..K-1") from None
        except OverflowError:  # a label past int64: no class number
            raise ValueError(f"{path}: labels are class numbers 0..K-1 (K at most {MAX_CLASSES}), but one is "
                             "beyond int64; renumber them") from None
        lines.append(line)
    x = (np.frombuffer(values, np.float64).reshape(len(labels), len(features)) if values
         else np.zeros((len(labels), len(features))))
    owners = owner_numbers(np.array(list(ids)))[np.frombuffer(codes, np.int64)] if client is not None and ids else None
    return x, np.frombuffer(labels, np.int64) if labels else np.zeros(0, np.int64), owners, np.asarray(lines)


def _bad_feature(path: Path, line: int, row: list[str], header: list[str], features: list[int]) -> str:
    """The line naming the first feature cell of ``row`` (on line ``line``) that is no number."""
    for i in features:
        try:
            float(row[i])
        except ValueError:
            if not row[i].strip():
                return f"{path}: line {line}, column {header[i]!r} is blank; fill in every feature, or drop the row"
            return (f"{path}: line {line}, column {header[i]!r} is {row[i].strip()!r}, not a number; every feature "
                    "must be numeric (drop the column, or encode it as numbers)")
    return f"{path}: line {line}: every feature must be a number"


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


def _checked(path, x: np.ndarray, y: np.ndarray, owners: np.ndarray | None,
             place: Callable[[int, int], str] | None = None,
             label_place: Callable[[int], str] | None = None) -> DatasetSplits:
    """The splits of a table's examples (as many in x, y and owners, one at least), once its labels and features are
    checked; ``place(example, feature)`` and ``label_place(example)`` say where a bad feature or label is in the
    user's file."""
    if not np.prod(x.shape[1:]):  # else the model's refusal, in the words of its in_features
        raise ValueError(f"{path}: the examples have no features; give it at least one numeric feature (a csv: a "
                         "column besides label and client)")
    _check_labels(path, y, label_place or _npz_label_place)
    splits = owned_splits(_float32_features(path, x, place or _npz_place), y, owners)
    if not len(splits.test):  # else simulate reports no accuracy and train stops on an empty evaluation
        raise ValueError(f"{path}: its {len(y)} examples leave none for the test set (a fifth of each client's, "
                         "for clients of two or more); give it more examples")
    return splits


def _check_labels(path, y: np.ndarray, place: Callable[[int], str]) -> None:
    """ValueError saying what is wrong with labels ``y`` (integers) unless they are class numbers of two classes or
    more; ``place(example)`` says where a label is in the user's file."""
    if y.min() < 0:
        first = int(np.argmax(y < 0))
        raise ValueError(f"{path}: {place(first)} is {y[first]}; labels are class numbers 0..K-1, none below 0: "
                         "renumber them the same way at every site, e.g. y = np.unique(y, return_inverse=True)[1]")
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


def _npz_label_place(example: int) -> str:
    """Where the label of an .npz's example ``example`` is."""
    return f"y of example {example} (counting from 0)"


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


def check_table_fits(path: str | Path, kind: str, processes: int = 1) -> None:
    """ValueError, one line saying how much memory ``processes`` processes each reading table ``path`` (``kind``
    'csv' or 'npz') need, when this machine has less available; nothing when the file does not say (the loader
    names what is wrong with it)."""
    if not Path(path).is_file():  # else a named pipe is opened here, and waited on
        return
    numbers, needed = (_csv_numbers if kind == "csv" else _npz_numbers)(Path(path))
    if numbers:
        where = f" in {processes} processes, each reading it whole" if processes > 1 else ""
        check_fits(processes * needed, f"{path} (about {numbers:,} numbers{where})",
                   "give a smaller table (fewer examples or features)"
                   + (", or fewer --workers" if processes > 1 else ""))


def _csv_numbers(path: Path) -> tuple[int, int]:
    """About how many numbers the CSV ``path`` holds (its first lines' cells per byte times its size; 0 when it
    does not say) and the bytes a process needs to load them."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            sample = f.read(CSV_SAMPLE)
    except OSError:
        return 0, 0
    lines = sample.split(b"\n")[1:-1]  # the header's and a last line cut short left out
    if size <= len(sample) or not lines:
        return 0, 0
    cells = sum(line.count(b",") + 1 for line in lines)
    numbers = int(cells * size / sum(len(line) + 1 for line in lines))
    return numbers, numbers * NUMBER_BYTES


def _npz_numbers(path: Path) -> tuple[int, int]:
    """How many numbers the array x of the .npz ``path`` holds, as its header says (0 when it does not), and the
    bytes a process needs to load them."""
    try:
        with zipfile.ZipFile(path) as archive, archive.open("x.npy") as f:
            version = np.lib.format.read_magic(f)
            read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            shape, _, dtype = read[version](f)
    except (OSError, EOFError, KeyError, ValueError, zipfile.BadZipFile, zlib.error):
        return 0, 0
    numbers = int(np.prod(shape, dtype=object))
    return numbers, numbers * (dtype.itemsize + NUMBER_BYTES)


def table_fits(name: str, processes: int, partition: str) -> None:
    """``--dataset csv:PATH`` or ``npz:PATH`` read by ``processes`` processes: :func:`check_table_fits`."""
    kind, _, path = name.partition(":")
    if path.strip():
        check_table_fits(path, kind.lower(), processes)


@register_dataset("npz", usage="npz:PATH", help="a table of features and labels", fits=table_fits)
def npz_dataset(name: str) -> DatasetSplits:
    """``--dataset npz:PATH``."""
    return load_npz_table(_dataset_file(name, "npz", NPZ_FILE))


@register_dataset("csv", usage="csv:PATH", help="a table of features and labels", fits=table_fits)
def csv_dataset(name: str) -> DatasetSplits:
    """``--dataset csv:PATH``."""
    return load_csv_table(_dataset_file(name, "csv", CSV_FILE))

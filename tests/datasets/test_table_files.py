"""``--dataset npz:PATH`` and ``csv:PATH`` given a file that is no such table, or no file at all: one line naming the
file and what it must be (exit 2, as for a missing MNIST folder), never numpy's advice to load it with pickle."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest

from fedpar.datasets import load_dataset
from fedpar.datasets.tables import NPZ_FILE

from support.in_process import run_main


def _table(tmp_path):
    rng = np.random.default_rng(0)
    return rng.standard_normal((20, 3)).astype(np.float32), rng.integers(0, 2, 20)


def _refused(name: str, *says: str) -> str:
    with pytest.raises(ValueError) as caught:
        load_dataset(name)
    line = str(caught.value)
    assert "\n" not in line and "pickle.load" not in line and "allow_pickle" not in line, line
    for words in says:
        assert words in line, line
    return line


def test_a_file_that_is_no_npz_archive_is_named_for_what_it_is(tmp_path):
    """A text file (or /etc/hostname) was said to 'contain pickled (object) data', to be loaded unsafely."""
    (tmp_path / "notnpz.npz").write_text("hello\n")
    x, y = _table(tmp_path)
    np.save(tmp_path / "array.npy", x)  # one array, not an archive
    np.savez(tmp_path / "whole.npz", x=x, y=y)
    (tmp_path / "cut.npz").write_bytes((tmp_path / "whole.npz").read_bytes()[:-40])
    for name in ("notnpz.npz", "array.npy", "cut.npz"):
        assert _refused(f"npz:{tmp_path / name}") == (
            f"{tmp_path / name} is not a NumPy .npz archive (np.savez); it needs the arrays x, y and optionally client")
    with zipfile.ZipFile(tmp_path / "zip.npz", "w") as z:  # a zip, but not of .npy arrays
        z.writestr("x", "1,2,3")
        z.writestr("y", "0")
    _refused(f"npz:{tmp_path / 'zip.npz'}", "x is not a NumPy array", "np.savez")


@pytest.mark.parametrize("key", ["x", "y", "client"])
def test_an_npz_holding_object_arrays_is_refused_naming_the_array(tmp_path, key):
    x, y = _table(tmp_path)
    arrays = {"x": x, "y": y, "client": np.arange(20) % 4}
    arrays[key] = np.array(list(arrays[key]) + [None], dtype=object)[:-1]  # Python objects: pickled by np.savez
    np.savez(tmp_path / "objects.npz", **arrays)
    _refused(f"npz:{tmp_path / 'objects.npz'}", f"objects.npz: array {key} holds Python objects, which need pickle "
                                                "and are refused")


def test_an_npz_with_text_features_says_so(tmp_path):
    _, y = _table(tmp_path)
    np.savez(tmp_path / "words.npz", x=np.array([["a"]] * 20), y=y)
    _refused(f"npz:{tmp_path / 'words.npz'}", "x must be numeric, got dtype <U1")


def test_a_binary_file_given_as_csv_is_named_for_what_it_is(tmp_path):
    x, y = _table(tmp_path)
    np.savez(tmp_path / "table.npz", x=x, y=y)
    (tmp_path / "table.csv").write_bytes((tmp_path / "table.npz").read_bytes())
    _refused(f"csv:{tmp_path / 'table.csv'}", f"{tmp_path / 'table.csv'} is not a CSV text file",
             "it must be a CSV file with a header row")
    (tmp_path / "nul.csv").write_bytes(b"label,a\n\x00\x00\n")
    _refused(f"csv:{tmp_path / 'nul.csv'}", "nul.csv")


def test_a_spreadsheet_s_utf8_csv_with_its_byte_order_mark_loads(tmp_path):
    (tmp_path / "bom.csv").write_text("label,a\n" + "".join(f"{i % 2},{i}\n" for i in range(10)),
                                      encoding="utf-8-sig")
    splits = load_dataset(f"csv:{tmp_path / 'bom.csv'}")
    assert len(splits.train) + len(splits.test) == 10


def test_a_dataset_file_that_is_not_there_is_a_bad_input(tmp_path):
    """Raised as FileNotFoundError, it ended simulate with exit 1 and '(--debug shows the traceback)'."""
    from fedpar.datasets.tables import DatasetFileMissing

    with pytest.raises(DatasetFileMissing) as caught:
        load_dataset(f"npz:{tmp_path / 'nope.npz'}")
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, FileNotFoundError)
    assert caught.value.exit_code == 2
    assert str(caught.value) == (f"--dataset npz:{tmp_path / 'nope.npz'}: {tmp_path / 'nope.npz'} does not exist; "
                                 f"pass the path of {NPZ_FILE}, e.g. --dataset npz:data/table.npz")
    _refused("npz:/dev/null", "/dev/null is not a regular file")


def _one_line(argv: list[str], capfd) -> str:
    done = run_main(argv, capfd)
    lines = done.stderr.strip().splitlines()
    assert (done.returncode, len(lines)) == (2, 1), done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "--debug shows the traceback" not in lines[0], lines
    return lines[0]


@pytest.mark.parametrize("command", [["simulate", "--clients", "4", "--rounds", "1"],
                                     ["train", "--model", "mlp", "--device", "cpu"]])
def test_simulate_and_train_say_a_bad_table_file_in_one_line_and_exit_2(tmp_path, capfd, command):
    (tmp_path / "notnpz.npz").write_text("hello\n")
    (tmp_path / "binary.csv").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    out = ["--out", str(tmp_path / "out")]
    for name, line in (
            ("npz:{tmp}/notnpz.npz", "{tmp}/notnpz.npz is not a NumPy .npz archive (np.savez); it needs the arrays "
                                     "x, y and optionally client"),
            ("csv:{tmp}/binary.csv", "{tmp}/binary.csv is not a CSV text file ("),
            ("csv:{tmp}/nope.csv", "--dataset csv:{tmp}/nope.csv: {tmp}/nope.csv does not exist; pass the path of a "
                                   "CSV file with a header row"),
            ("npz:{tmp}/nope.npz", "--dataset npz:{tmp}/nope.npz: {tmp}/nope.npz does not exist; pass the path of an "
                                   ".npz file")):
        said = _one_line([*command, "--dataset", name.replace("{tmp}", str(tmp_path)), *out], capfd)
        assert said.startswith(f"fedpar {command[0]}: {line.replace('{tmp}', str(tmp_path))}"), said

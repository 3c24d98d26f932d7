"""A user's own data, damaged or odd (``--dataset mnist --data-dir DIR``, ``npz:PATH``, ``csv:PATH``): one line
saying what is wrong with which file and what to do, never a traceback from the loader's libraries."""

from __future__ import annotations

import gzip
import io
import zipfile

import numpy as np
import pytest

from fedpar.datasets import load_dataset
from fedpar.datasets.clientdata import local_train_size
from fedpar.datasets.text import load_text

from support.in_process import run_main

IDX_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def _idx(array: np.ndarray) -> bytes:
    """``array`` (uint8) as an IDX file's bytes."""
    dims = b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return bytes([0, 0, 0x08, array.ndim]) + dims + array.tobytes()


def _mnist_idx_folder(folder, train: int = 40, test: int = 10):
    """A small MNIST folder of the four gzip-compressed IDX files."""
    rng = np.random.default_rng(0)
    folder.mkdir()
    for name, n in zip(IDX_NAMES, (train, train, test, test)):
        array = rng.integers(0, 256, (n, 28, 28)) if "images" in name else rng.integers(0, 10, n)
        (folder / f"{name}.gz").write_bytes(gzip.compress(_idx(array.astype(np.uint8))))
    return folder


def _refused(name: str, *says: str, **options) -> str:
    with pytest.raises(ValueError) as caught:
        load_dataset(name, **options)
    line = str(caught.value)
    assert "\n" not in line, line
    for words in says:
        assert words in line, line
    return line


def test_a_gzip_idx_file_with_a_damaged_stream_is_named(tmp_path):
    """zlib.error (not an OSError) escaped the loader: a traceback from simulate and train."""
    folder = _mnist_idx_folder(tmp_path / "mnist")
    path = folder / "train-images-idx3-ubyte.gz"
    data = path.read_bytes()
    path.write_bytes(data[:20] + bytes(200) + data[220:])
    _refused("mnist", f"{path}: not a valid gzip file", "download it again", data_dir=folder)


def test_a_compressed_npz_table_with_a_damaged_member_is_named(tmp_path):
    rng = np.random.default_rng(0)
    np.savez_compressed(tmp_path / "table.npz", x=rng.standard_normal((80, 3)), y=np.arange(80) % 3)
    data = bytearray((tmp_path / "table.npz").read_bytes())
    data[100:140] = bytes(40)
    (tmp_path / "table.npz").write_bytes(bytes(data))
    _refused(f"npz:{tmp_path / 'table.npz'}", "table.npz cannot be read as a NumPy .npz archive", "np.savez")


def _mnist_npz_folder(folder, train: int = 40, test: int = 10):
    """A small MNIST folder of train.npz and test.npz."""
    rng = np.random.default_rng(0)
    folder.mkdir()
    for name, n in (("train", train), ("test", test)):
        np.savez(folder / f"{name}.npz", x=rng.integers(0, 256, (n, 28, 28), dtype=np.uint8),
                 y=rng.integers(0, 10, n, dtype=np.uint8))
    return folder


def test_an_mnist_split_with_no_examples_is_refused(tmp_path):
    """An empty test.npz trained with no accuracy (simulate) or ended train in a traceback."""
    folder = _mnist_npz_folder(tmp_path / "mnist", test=0)
    _refused("mnist", f"{folder / 'test.npz'} holds no examples", data_dir=folder)


def test_a_table_too_small_for_a_test_set_is_refused_and_two_rows_are_enough(tmp_path):
    (tmp_path / "singles.csv").write_text("f1,label,client\n1.0,0,a\n2.0,1,b\n3.0,1,c\n")
    (tmp_path / "two.csv").write_text("f1,label\n1.0,0\n2.0,1\n")
    _refused(f"csv:{tmp_path / 'singles.csv'}", "its 3 examples leave none for the test set")
    splits = load_dataset(f"csv:{tmp_path / 'two.csv'}")
    assert (len(splits.train), len(splits.test)) == (1, 1)


def _one_line(argv: list[str], capfd) -> str:
    done = run_main(argv, capfd)
    lines = done.stderr.strip().splitlines()
    assert (done.returncode, len(lines)) == (2, 1), done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return lines[0]


def test_train_says_an_empty_mnist_test_set_in_one_line(tmp_path, capfd):
    folder = _mnist_npz_folder(tmp_path / "mnist", test=0)
    said = _one_line(["train", "--dataset", "mnist", "--data-path", str(folder), "--max-steps", "2",
                      "--device", "cpu", "--out", str(tmp_path / "out")], capfd)
    assert said.startswith(f"fedpar train: {folder / 'test.npz'} holds no examples"), said


def test_a_label_that_is_an_id_not_a_class_number_is_refused(tmp_path, capfd):
    """A label of 2**40 sized the model's output by it: an out-of-memory traceback from simulate and train."""
    np.savez(tmp_path / "ids.npz", x=np.ones((20, 3), np.float32), y=np.where(np.arange(20) % 2, 2**40, 0))
    _refused(f"npz:{tmp_path / 'ids.npz'}", "labels are class numbers 0..K-1", f"one is {2**40}", "renumber them")
    said = _one_line(["train", "--dataset", f"npz:{tmp_path / 'ids.npz'}", "--max-steps", "2", "--batch-size", "2",
                      "--device", "cpu", "--out", str(tmp_path / "out")], capfd)
    assert "labels are class numbers 0..K-1" in said, said


def test_npz_table_arrays_of_the_wrong_shape_or_kind_are_named(tmp_path, capfd):
    """A 1-D x ended train in a torch IndexError traceback (simulate blamed the task); complex x trained on its real
    part alone; a 2-D client said only numpy's 'object too deep for desired array'."""
    rng = np.random.default_rng(0)
    x, y, client = rng.standard_normal((20, 3)).astype(np.float32), np.arange(20) % 2, np.arange(20) % 4
    for name, arrays, says in (
            ("flat", dict(x=x[:, 0], y=y), "x must hold one example per row with its features after"),
            ("complex", dict(x=x + 1j, y=y), "x must be real numbers, got dtype complex"),
            ("client2d", dict(x=x, y=y, client=client[:, None]), "client must be 1-D, one id per example")):
        np.savez(tmp_path / f"{name}.npz", **arrays)
        _refused(f"npz:{tmp_path / name}.npz", says)
    said = _one_line(["train", "--dataset", f"npz:{tmp_path / 'flat.npz'}", "--max-steps", "2", "--batch-size", "2",
                      "--device", "cpu", "--out", str(tmp_path / "out")], capfd)
    assert "x must hold one example per row" in said, said


def test_csv_rows_that_do_not_fit_the_header_are_named_by_line_and_blank_lines_are_skipped(tmp_path):
    """Blank trailing lines and short rows said only 'list index out of range'; a long row's extra cells were
    dropped without a word; a blank client was a client of its own."""
    rows = "f1,f2,label,client\n" + "".join(f"{i},{i % 3},{i % 2},c{i % 4}\n" for i in range(20))
    (tmp_path / "blank.csv").write_text(rows + "\n\n")
    splits = load_dataset(f"csv:{tmp_path / 'blank.csv'}")
    assert len(splits.train) + len(splits.test) == 20
    for name, text, says in (
            ("short", rows + "1,2,0\n", "short.csv: line 22 has 3 cells but the header has 4 columns"),
            ("long", rows + "1,2,0,c1,9\n", "long.csv: line 22 has 5 cells but the header has 4 columns"),
            ("noclient", rows + "1,2,0,\n", "noclient.csv: line 22 has no client")):
        (tmp_path / f"{name}.csv").write_text(text)
        _refused(f"csv:{tmp_path / name}.csv", says)


def test_a_synthetic_spread_so_large_its_features_overflow_is_refused(tmp_path, capfd):
    """synthetic:1e308:1 drew Inf/NaN features and simulate trained on them (accuracy 1.0: every label argmax(NaN))."""
    _refused("synthetic:1e308:1:4", "ALPHA and BETA in 0..1000")
    _refused("synthetic:1:1e39:4", "ALPHA and BETA in 0..1000")
    x, _ = load_dataset("synthetic:1000:1000:4:20").train.to_tensors()
    assert bool(x.isfinite().all())
    said = _one_line(["simulate", "--dataset", "synthetic:1e308:1", "--clients", "4", "--rounds", "1",
                      "--out", str(tmp_path / "out")], capfd)
    assert said.startswith("fedpar simulate: synthetic dataset 'synthetic:1e308:1' needs"), said


def test_a_table_of_one_class_is_refused(tmp_path, capfd):
    """Every label alike trained a model that always says it, reported as test accuracy 1.0."""
    (tmp_path / "one.csv").write_text("f1,label,client\n" + "".join(f"{i},3,c{i % 4}\n" for i in range(20)))
    _refused(f"csv:{tmp_path / 'one.csv'}", "one.csv: every label is 3; a classifier needs examples of two classes")
    said = _one_line(["simulate", "--dataset", f"csv:{tmp_path / 'one.csv'}", "--clients", "4", "--rounds", "1",
                      "--out", str(tmp_path / "out")], capfd)
    assert "every label is 3" in said, said


def test_a_table_with_no_features_is_refused_in_the_data_s_words(tmp_path):
    """It was refused by the model: 'model 'mlp' cannot be built with in_features=0'."""
    (tmp_path / "bare.csv").write_text("label,client\n" + "".join(f"{i % 2},c{i % 4}\n" for i in range(20)))
    np.savez(tmp_path / "bare.npz", x=np.zeros((20, 0), np.float32), y=np.arange(20) % 2)
    for name in ("csv:{}/bare.csv", "npz:{}/bare.npz"):
        _refused(name.format(tmp_path), "the examples have no features; give it at least one numeric feature")


def test_a_csv_header_naming_label_or_client_twice_is_refused(tmp_path):
    """The first was read and the second trained on as a feature: the answer among the inputs."""
    (tmp_path / "twice.csv").write_text("f1,label,label\n" + "".join(f"{i},{i % 2},{i % 2}\n" for i in range(20)))
    _refused(f"csv:{tmp_path / 'twice.csv'}", "twice.csv: its header names the column 'label' 2 times")


def test_features_beyond_float32_are_named_with_their_example(tmp_path, capfd):
    """1e39 became Inf in the cast, with a RuntimeWarning on stderr above a line that blamed NaN or Inf."""
    rows = "f1,f2,label\n" + "".join(f"{i},{i % 3},{i % 2}\n" for i in range(20))
    (tmp_path / "huge.csv").write_text(rows + "1e39,1,0\n")
    (tmp_path / "nan.csv").write_text(rows + "nan,1,0\n")
    np.savez(tmp_path / "huge.npz", x=np.full((20, 2), 1e39), y=np.arange(20) % 2)
    _refused(f"csv:{tmp_path / 'huge.csv'}", "line 22, column 'f1' is 1e+39, too large to train on")
    _refused(f"csv:{tmp_path / 'nan.csv'}", "line 22, column 'f1' is nan: features must be finite numbers")
    _refused(f"npz:{tmp_path / 'huge.npz'}", "example 0 (counting from 0), feature 0 is 1e+39, too large")
    said = _one_line(["train", "--dataset", f"csv:{tmp_path / 'huge.csv'}", "--max-steps", "2", "--batch-size", "2",
                      "--device", "cpu", "--out", str(tmp_path / "out")], capfd)
    assert "column 'f1' is 1e+39, too large to train on" in said and "or drop such examples" in said, said


def test_an_npz_client_id_that_is_nan_is_refused(tmp_path):
    """Every NaN id was one client, 'nan', as a blank csv client was one of its own."""
    client = np.where(np.arange(20) % 4 == 1, np.nan, np.arange(20) % 4)
    np.savez(tmp_path / "nan.npz", x=np.ones((20, 2)), y=np.arange(20) % 2, client=client)
    _refused(f"npz:{tmp_path / 'nan.npz'}", "client is NaN or blank for 5 examples (the first is example 1)")


def test_an_npz_client_id_that_is_blank_is_refused(tmp_path):
    """Every blank id was one client, '', as a blank csv client was one of its own."""
    client = np.array(["ann", " ", "bob", "cy"] * 5)
    np.savez(tmp_path / "blank.npz", x=np.ones((20, 2)), y=np.arange(20) % 2, client=client)
    _refused(f"npz:{tmp_path / 'blank.npz'}", "client is NaN or blank for 5 examples (the first is example 1)")
    np.savez(tmp_path / "bytes.npz", x=np.ones((20, 2)), y=np.arange(20) % 2, client=client.astype("S"))
    _refused(f"npz:{tmp_path / 'bytes.npz'}", "client is NaN or blank for 5 examples")


def test_an_mnist_training_set_of_one_digit_is_refused(tmp_path):
    """It trained a model that always says that digit (a test set of it scored 1.0)."""
    folder = _mnist_npz_folder(tmp_path / "mnist")
    with np.load(folder / "train.npz") as train:
        np.savez(folder / "train.npz", x=train["x"], y=np.full(len(train["y"]), 7, np.uint8))
    _refused("mnist", f"{folder / 'train.npz'}: every training label is 7", data_dir=folder)
    with np.load(folder / "test.npz") as test:
        np.savez(folder / "test.npz", x=test["x"], y=np.full(len(test["y"]), 7, np.uint8))
    np.savez(folder / "train.npz", x=np.zeros((4, 28, 28), np.uint8), y=np.array([0, 1, 2, 3], np.uint8))
    assert len(load_dataset("mnist", data_dir=folder).test) == 10  # a test set of one digit is no mistake


def test_mnist_images_of_no_pixels_are_refused_in_the_data_s_words(tmp_path):
    """It was the model's refusal: 'mlp cannot be built with in_features=0'."""
    folder = _mnist_npz_folder(tmp_path / "mnist")
    for name in ("train", "test"):
        np.savez(folder / f"{name}.npz", x=np.zeros((10, 0, 28), np.uint8), y=np.arange(10, dtype=np.uint8))
    _refused("mnist", "train.npz: images of 0x28 pixels hold nothing", data_dir=folder)


def test_a_text_too_short_for_its_held_out_part_is_named_by_the_file_s_length(tmp_path, capfd):
    """'the text has 161 tokens' of a 1,601-character file: the held-out tenth's length, said as the text's."""
    (tmp_path / "corpus.txt").write_text("abcdefgh" * 200 + "\n")
    said = _one_line(["train", "--model", "gpt", "--dataset", "text", "--data-path", str(tmp_path / "corpus.txt"),
                      "--block-size", "200", "--batch-size", "2", "--max-steps", "2", "--device", "cpu",
                      "--out", str(tmp_path / "out")], capfd)
    assert said == (f"fedpar train: {tmp_path / 'corpus.txt'} has 1601 characters: its first 1440 train and the "
                    "other 161 validate, and each part needs block_size+1=201; use a text of at least 2001 characters "
                    "or --block-size 160 or less"), said
    (tmp_path / "corpus.txt").write_text("a" * 2001)
    assert len(load_text(tmp_path / "corpus.txt", 200).val) == 201


def test_a_csv_label_beyond_int64_is_refused(tmp_path, capfd):
    """It ended train and simulate in an OverflowError traceback."""
    (tmp_path / "big.csv").write_text("f1,label\n1,0\n2,99999999999999999999\n3,1\n")
    said = _one_line(["train", "--dataset", f"csv:{tmp_path / 'big.csv'}", "--max-steps", "2", "--batch-size", "1",
                      "--device", "cpu", "--out", str(tmp_path / "out")], capfd)
    assert said.endswith("big.csv: labels are class numbers 0..K-1 (K at most 65536), but one is beyond int64; "
                         "renumber them"), said


def test_an_mnist_npz_whose_members_are_no_arrays_is_named(tmp_path, capfd):
    """A zip of raw files named train.npz ended train in "AttributeError: 'bytes' object has no attribute"."""
    folder = _mnist_npz_folder(tmp_path / "mnist")
    with zipfile.ZipFile(folder / "train.npz", "w") as z:
        z.writestr("x", "abc")
        z.writestr("y", "0")
    _refused("mnist", "train.npz: y is not a NumPy array (the archive was not written by np.savez)", data_dir=folder)
    said = _one_line(["train", "--dataset", "mnist", "--data-path", str(folder), "--max-steps", "2",
                      "--device", "cpu", "--out", str(tmp_path / "out")], capfd)
    assert "is not a NumPy array" in said, said


def test_a_large_val_fraction_leaves_each_small_client_one_example_to_train(tmp_path, capfd):
    """--val-fraction 0.99 rounded a 15-example client's validation share to all 15: every round failed with
    "client_data gave no training examples: fix the app (None)", for fedpar's own task."""
    rows = "f1,f2,label,client\n" + "".join(f"{i},{i % 5},{i % 3},c{i % 4}\n" for i in range(80))
    (tmp_path / "t.csv").write_text(rows)
    done = run_main(["simulate", "--dataset", f"csv:{tmp_path / 't.csv'}", "--clients", "4", "--rounds", "1",
                     "--val-fraction", "0.99", "--out", str(tmp_path / "out")], capfd)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (tmp_path / "out" / "global.safetensors").is_file()
    assert [local_train_size(n, 0.99) for n in (1, 2, 15)] == [1, 1, 1]
    assert local_train_size(np.array([1, 2, 15]), 0.99).tolist() == [1, 1, 1]


@pytest.mark.parametrize("command", ["simulate", "client", "simulate-workers"])
def test_the_help_of_val_fraction_states_that_each_client_keeps_one_example_to_train(command, capfd):
    """It said only 'share of each client's data kept for federated evaluation': not the rule above."""
    done = run_main([command, "--help"], capfd)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("--val-fraction VAL_FRACTION share of each client's data kept for federated evaluation, rounded to whole "
            "examples; every client keeps one example at least to train on (default: 0.1)") in " ".join(
                done.stdout.split()), done.stdout


@pytest.mark.parametrize("kind", ["csv", "npz"])
def test_a_table_dataset_with_no_path_after_the_colon_says_so(tmp_path, capfd, kind):
    """'--dataset csv::  is a folder': the empty path was read as the working folder."""
    said = _one_line(["train", "--dataset", f"{kind}:", "--max-steps", "2", "--out", str(tmp_path / "out")], capfd)
    assert said.startswith(f"fedpar train: --dataset {kind}: names no file; pass the path of "), said


def test_a_federation_of_one_client_of_its_own_is_said_in_the_singular(tmp_path, capfd):
    """'the data has 1 clients of its own'."""
    said = _one_line(["simulate", "--dataset", "synthetic:1:1:1:5", "--clients", "4", "--rounds", "1",
                      "--out", str(tmp_path / "out")], capfd)
    assert said == "fedpar simulate: the data has 1 client of its own; run it with --clients 1", said


def test_too_few_examples_for_the_clients_are_counted_in_the_singular(tmp_path, capfd):
    """'cannot give 4 clients at least one example each from 1 examples'."""
    (tmp_path / "t.csv").write_text("f1,label\n1,0\n2,1\n")
    said = _one_line(["simulate", "--dataset", f"csv:{tmp_path / 't.csv'}", "--clients", "4", "--rounds", "1",
                      "--partition", "iid", "--out", str(tmp_path / "out")], capfd)
    assert said == ("fedpar simulate: cannot give 4 clients at least one example each from 1 example; use fewer "
                    "clients"), said


def _npy(array: np.ndarray) -> bytes:
    """``array`` as the bytes of an .npy file."""
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def test_an_mnist_npz_with_an_array_cut_short_inside_is_named(tmp_path, capfd):
    """A whole zip whose x.npy is cut short said only numpy's 'EOF: reading array data, ...', naming no file."""
    folder = _mnist_npz_folder(tmp_path / "mnist")
    with zipfile.ZipFile(folder / "train.npz", "w") as z:
        z.writestr("x.npy", _npy(np.zeros((40, 28, 28), np.uint8))[:5000])
        z.writestr("y.npy", _npy(np.arange(40) % 10))
    _refused("mnist", f"{folder / 'train.npz'}: array x cannot be read (", "replace it with a whole copy",
             data_dir=folder)
    said = _one_line(["train", "--dataset", "mnist", "--data-path", str(folder), "--max-steps", "2",
                      "--device", "cpu", "--out", str(tmp_path / "out")], capfd)
    assert f"{folder / 'train.npz'}: array x cannot be read" in said, said


def test_csv_labels_written_as_whole_floats_are_their_classes(tmp_path, capfd):
    """'0.0', '1.0' (as pandas writes a float column) were refused: 'every row needs a whole-number label'."""
    rows = "".join(f"{i},{i % 3}.0\n" for i in range(20))
    (tmp_path / "floats.csv").write_text("f1,label\n" + rows)
    (tmp_path / "ints.csv").write_text("f1,label\n" + rows.replace(".0\n", "\n"))
    floats, ints = load_dataset(f"csv:{tmp_path / 'floats.csv'}"), load_dataset(f"csv:{tmp_path / 'ints.csv'}")
    assert floats.num_classes == ints.num_classes == 3
    assert floats.train.y.tolist() == ints.train.y.tolist() and floats.test.y.tolist() == ints.test.y.tolist()
    done = run_main(["train", "--dataset", f"csv:{tmp_path / 'floats.csv'}", "--max-steps", "2", "--batch-size", "2",
                     "--device", "cpu", "--no-plot", "--out", str(tmp_path / "out")], capfd)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("label", ["0.5", "nan", "inf"])
def test_a_csv_label_that_is_no_whole_number_is_refused(label, tmp_path, capfd):
    (tmp_path / "half.csv").write_text("f1,label\n" + "".join(f"{i},{i % 2}\n" for i in range(20)) + f"3,{label}\n")
    said = _one_line(["train", "--dataset", f"csv:{tmp_path / 'half.csv'}", "--max-steps", "2", "--device", "cpu",
                      "--out", str(tmp_path / "out")], capfd)
    assert said == (f"fedpar train: {tmp_path / 'half.csv'}: line 22, the label '{label}' is not a whole number; "
                    "labels are class numbers 0..K-1"), said


@pytest.mark.parametrize("cell, says", [("abc", "is 'abc', not a number; every feature must be numeric (drop the "
                                                 "column, or encode it as numbers)"),
                                        (" ", "is blank; fill in every feature, or drop the row")])
def test_a_csv_feature_that_is_no_number_is_named_by_its_line_and_column(cell, says, tmp_path, capfd):
    """It was 'every row needs a whole-number label and numeric features (could not convert string to float: ...)',
    naming neither the line nor the column."""
    (tmp_path / "text.csv").write_text("f1,f2,label\n" + "".join(f"{i},{i},{i % 2}\n" for i in range(20)) +
                                       f"3,{cell},1\n")
    said = _one_line(["train", "--dataset", f"csv:{tmp_path / 'text.csv'}", "--max-steps", "2", "--device", "cpu",
                      "--out", str(tmp_path / "out")], capfd)
    assert said == f"fedpar train: {tmp_path / 'text.csv'}: line 22, column 'f2' {says}", said


@pytest.mark.parametrize("separator, said", [(";", "';'"), ("\t", "tabs")])
def test_a_csv_separated_by_semicolons_or_tabs_is_said_so(separator, said, tmp_path, capfd):
    """A spreadsheet's ';'-separated export was told only that it 'needs a header row with a 'label' column'."""
    rows = "".join(f"{i}{separator}{i % 2}\n" for i in range(20))
    (tmp_path / "semi.csv").write_text(f"f1{separator}label\n" + rows)
    line = _one_line(["train", "--dataset", f"csv:{tmp_path / 'semi.csv'}", "--max-steps", "2", "--device", "cpu",
                      "--out", str(tmp_path / "out")], capfd)
    assert line == (f"fedpar train: {tmp_path / 'semi.csv'} looks separated by {said}, not commas (its header row "
                    "is one column); fedpar reads comma-separated files: save it with commas between the cells"), line


def test_csv_client_ids_are_text_as_written(tmp_path):
    """As the loader's docs say: '1', '01' and '1.0' are three clients (ids such as '007' keep their zeros)."""
    rows = "".join(f"{i},{i % 2},{('1', '01', '1.0')[i % 3]}\n" for i in range(30))
    (tmp_path / "ids.csv").write_text("f1,label,client\n" + rows)
    splits = load_dataset(f"csv:{tmp_path / 'ids.csv'}")
    assert sorted(set(splits.train_owners.tolist())) == [0, 1, 2]

"""fedpar.datasets: digits, MNIST from npz or IDX (plain/.gz, corrupted), text corpora, the name registry."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from fedpar.datasets import (
    ArrayDataset,
    IdxFormatError,
    load_dataset,
    load_digits,
    load_mnist,
    load_text,
    parse_idx,
)
from fedpar.datasets.arrays import CLASSIFICATION, LANGUAGE_MODEL
from fedpar.datasets.registry import DATASETS, load_train_data
from fedpar.models import build_model
from fedpar.models.for_data import classifier_kwargs, model_kwargs_for

SHARED_MNIST = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"


def _idx_bytes(array: np.ndarray) -> bytes:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def _tiny_mnist(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), rng.integers(0, 10, n).astype(np.uint8)


def _write_idx_folder(folder: Path, compress: set[str] = frozenset()) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    (xtr, ytr), (xte, yte) = _tiny_mnist(rng, 12), _tiny_mnist(rng, 5)
    arrays = {"train-images-idx3-ubyte": xtr, "train-labels-idx1-ubyte": ytr,
              "t10k-images-idx3-ubyte": xte, "t10k-labels-idx1-ubyte": yte}
    folder.mkdir(parents=True, exist_ok=True)
    for name, arr in arrays.items():
        data = _idx_bytes(arr)
        if name in compress:
            (folder / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (folder / name).write_bytes(data)
    return arrays


def test_array_dataset_subset_and_tensors():
    ds = ArrayDataset(np.arange(12, dtype=np.float64).reshape(6, 2), np.array([0, 1, 2, 0, 1, 2]))
    assert ds.x.dtype == np.float32 and ds.y.dtype == np.int64 and len(ds) == 6
    sub = ds.subset([4, 1])
    np.testing.assert_array_equal(sub.x, [[8, 9], [2, 3]])
    np.testing.assert_array_equal(sub.y, [1, 1])
    sub.x[0, 0] = -1  # a copy
    assert ds.x[4, 0] == 8
    x, y = ds.to_tensors()
    assert tuple(x.shape) == (6, 2) and str(y.dtype) == "torch.int64" and int(y.sum()) == 6
    with pytest.raises(ValueError, match="6 examples but y has 5"):
        ArrayDataset(np.zeros((6, 2)), np.zeros(5))
    with pytest.raises(ValueError, match=r"in \[0, 6\)"):
        ds.subset([6])


def test_digits_are_scaled_shaped_and_stratified():
    d = load_digits(test_fraction=0.2, seed=0)
    assert (len(d.train), len(d.test)) == (1437, 360)
    assert d.train.x.shape == (1437, 1, 8, 8) and d.train.x.dtype == np.float32
    assert d.train.x.min() == 0.0 and d.train.x.max() == 1.0
    assert d.num_classes == 10 and d.input_shape == (1, 8, 8)
    # stratified: every class has 35 or 36 of the 360 test images (sklearn digits has 174..183 per class)
    assert set(np.bincount(d.test.y, minlength=10)) <= {35, 36, 37}
    again, other = load_digits(seed=0), load_digits(seed=1)
    np.testing.assert_array_equal(d.test.y, again.test.y)
    assert not np.array_equal(d.test.x, other.test.x)


def test_mnist_from_npz(tmp_path):
    rng = np.random.default_rng(0)
    (xtr, ytr), (xte, yte) = _tiny_mnist(rng, 7), _tiny_mnist(rng, 3)
    np.savez(tmp_path / "train.npz", x=xtr, y=ytr)
    np.savez(tmp_path / "test.npz", x=xte, y=yte)
    d = load_mnist(tmp_path)
    assert d.train.x.shape == (7, 1, 28, 28) and d.test.x.shape == (3, 1, 28, 28)
    assert d.input_shape == (1, 28, 28) and d.num_classes == 10
    np.testing.assert_allclose(d.train.x[:, 0], (xtr / 255.0 - 0.1307) / 0.3081, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(d.test.y, yte)
    assert d.test.y.dtype == np.int64


def test_mnist_npz_must_not_hold_pickles(tmp_path):
    np.savez(tmp_path / "train.npz", x=np.array([{"a": 1}], dtype=object), y=np.zeros(1, np.uint8))
    np.savez(tmp_path / "test.npz", x=np.zeros((1, 28, 28), np.uint8), y=np.zeros(1, np.uint8))
    with pytest.raises(ValueError, match="object arrays, which need pickle and are refused"):
        load_mnist(tmp_path)


def test_mnist_from_plain_and_gzipped_idx(tmp_path):
    plain = _write_idx_folder(tmp_path / "plain")
    mixed = _write_idx_folder(tmp_path / "gz", compress={"train-images-idx3-ubyte", "t10k-labels-idx1-ubyte"})
    for folder, arrays in ((tmp_path / "plain", plain), (tmp_path / "gz", mixed)):
        d = load_mnist(folder)
        assert d.train.x.shape == (12, 1, 28, 28) and len(d.test) == 5
        np.testing.assert_array_equal(d.train.y, arrays["train-labels-idx1-ubyte"])
        expected = (arrays["t10k-images-idx3-ubyte"] / 255.0 - 0.1307) / 0.3081
        np.testing.assert_allclose(d.test.x[:, 0], expected, rtol=1e-5, atol=1e-6)


def test_corrupted_idx_files_give_clear_errors(tmp_path):
    good = _idx_bytes(np.zeros((2, 3, 3), np.uint8))
    np.testing.assert_array_equal(parse_idx(good), np.zeros((2, 3, 3)))
    with pytest.raises(IdxFormatError, match="bad magic number"):
        parse_idx(b"\x1f\x8b" + good[2:])
    with pytest.raises(IdxFormatError, match="payload is 17 bytes but dims \\(2, 3, 3\\)"):
        parse_idx(good[:-1])
    with pytest.raises(IdxFormatError, match="truncated header"):
        parse_idx(good[:8])
    with pytest.raises(IdxFormatError, match="unknown IDX element type 0x07"):
        parse_idx(b"\x00\x00\x07\x01" + good[4:])

    folder = tmp_path / "broken"
    _write_idx_folder(folder, compress={"train-labels-idx1-ubyte"})
    gz = folder / "train-labels-idx1-ubyte.gz"
    gz.write_bytes(gz.read_bytes()[:-6])  # cut the gzip trailer
    with pytest.raises(IdxFormatError, match="not a valid gzip file"):
        load_mnist(folder)

    folder = tmp_path / "short"
    _write_idx_folder(folder)
    path = folder / "t10k-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-28])
    with pytest.raises(IdxFormatError, match="t10k-images-idx3-ubyte: payload is"):
        load_mnist(folder)


def test_mnist_wrong_folder_says_what_is_expected_and_where_to_get_it(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "train.npz").write_bytes(b"")  # half of the npz pair is not MNIST
    where = "download the four IDX .gz files from https://ossci-datasets.s3.amazonaws.com/mnist/"
    with pytest.raises(ValueError, match=f"no MNIST files in {tmp_path} \\(it holds notes.txt, train.npz\\); "
                                         f"expected train.npz and test.npz .* t10k-labels-idx1-ubyte .*: {where}"):
        load_mnist(tmp_path)
    with pytest.raises(ValueError, match=f"MNIST folder {tmp_path / 'missing'} does not exist; .*, or {where}"):
        load_mnist(tmp_path / "missing")


def test_text_corpus(tmp_path):
    text = "hello world, héllo again!\n" * 20
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    corpus = load_text(path, block_size=8, val_fraction=0.1)
    assert corpus.chars == sorted(set(text)) and corpus.vocab_size == len(set(text))
    assert len(corpus.train) == int(len(text) * 0.9) and len(corpus.train) + len(corpus.val) == len(text)
    assert corpus.train.dtype == np.int64
    assert corpus.decode(np.concatenate([corpus.train, corpus.val])) == text
    np.testing.assert_array_equal(corpus.encode("hé"), [corpus.chars.index("h"), corpus.chars.index("é")])
    with pytest.raises(ValueError, match="not in the corpus vocabulary"):
        corpus.encode("Z")


def test_text_errors(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="not valid UTF-8"):
        load_text(bad, block_size=2)
    with pytest.raises(FileNotFoundError, match="pass the path of a UTF-8 text file"):
        load_text(tmp_path / "nope.txt", block_size=2)


def test_load_dataset_by_name(tmp_path):
    assert len(load_dataset("digits", test_fraction=0.5).test) == 899
    with pytest.raises(ValueError, match="mnist needs --data-dir DIR holding train.npz"):
        load_dataset("mnist")
    _write_idx_folder(tmp_path)
    assert len(load_dataset("mnist", data_dir=tmp_path).train) == 12
    with pytest.raises(ValueError, match="unknown dataset 'cifar10'; valid names are: ") as unknown:
        load_dataset("cifar10")
    assert all(name in str(unknown.value) for name in DATASETS)  # in any order: a new one goes anywhere
    with pytest.raises(ValueError, match="text is a character corpus for language models.*--dataset text"):
        load_dataset("text")


def test_the_one_registry_gives_the_trainer_its_tensors_and_model_sizes(tmp_path):
    data, implied = load_train_data("digits", "", block_size=64, seed=3)
    x, y = load_dataset("digits", seed=3).train.to_tensors()
    assert data.task == CLASSIFICATION and data.train_inputs.equal(x) and data.train_targets.equal(y)
    assert implied == {"input_shape": (1, 8, 8), "num_classes": 10}
    for model in ("mlp", "cnn"):
        kwargs = model_kwargs_for(model, implied, {"num_classes": 10})
        assert kwargs == classifier_kwargs(model, (1, 8, 8), 10)
        assert build_model(model, **kwargs)(data.eval_inputs[:2]).shape == (2, 10)
    with pytest.raises(ValueError, match="the gpt model trains on --dataset text"):
        model_kwargs_for("gpt", implied, {})
    _write_idx_folder(tmp_path / "mnist")
    assert len(load_train_data("mnist", str(tmp_path / "mnist"), 64, 0)[0].train_targets) == 12
    with pytest.raises(ValueError, match="--dataset mnist needs --data-path DIR holding train.npz"):
        load_train_data("mnist", "", 64, 0)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("abcdefghij" * 5, encoding="utf-8")
    data, implied = load_train_data("text", str(corpus), block_size=4, seed=0)
    assert data.task == LANGUAGE_MODEL and implied == {"vocab_size": 10, "block_size": 4}
    assert data.train_inputs.shape == (11, 4) and data.train_inputs[0].tolist() == [0, 1, 2, 3]
    assert data.train_targets[0].tolist() == [1, 2, 3, 4]  # one character ahead
    assert model_kwargs_for("gpt", implied, {"n_layer": 1}) == {"vocab_size": 10, "block_size": 4, "n_layer": 1}
    with pytest.raises(ValueError, match="use --model gpt, not mlp"):
        model_kwargs_for("mlp", implied, {})
    with pytest.raises(ValueError, match="--dataset text needs --data-path FILE"):
        load_train_data("text", "", 4, 0)


@pytest.mark.skipif(not (SHARED_MNIST / "train.npz").is_file(), reason="shared MNIST copy not present")
def test_real_mnist_matches_its_readme():
    d = load_mnist(SHARED_MNIST)
    assert d.train.x.shape == (60000, 1, 28, 28) and d.test.x.shape == (10000, 1, 28, 28)
    assert np.bincount(d.train.y).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert np.bincount(d.test.y).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert d.train.y[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    assert d.test.y[:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]
    assert abs(float(d.train.x.mean())) < 1e-3 and abs(float(d.train.x.std()) - 1.0) < 1e-3


def test_tables_with_writers_load_and_split_naturally(tmp_path):
    from fedpar.datasets.clientdata import partition_indices
    rng = np.random.default_rng(0)
    writers = np.array(["ann", "bob", "cy", "dee"])[rng.integers(0, 4, 60)]
    x, y = rng.standard_normal((60, 5)).astype(np.float32), rng.integers(0, 3, 60)
    np.savez(tmp_path / "w.npz", x=x, y=y, client=writers)
    with open(tmp_path / "w.csv", "w") as f:
        f.write("f0,client,f1,f2,f3,f4,label\n")
        for row, w, label in zip(x, writers, y):
            f.write(",".join([repr(float(row[0])), w, *(repr(float(v)) for v in row[1:]), str(label)]) + "\n")
    for name in (f"npz:{tmp_path / 'w.npz'}", f"csv:{tmp_path / 'w.csv'}"):
        splits = load_dataset(name)
        assert splits.input_shape == (5,) and splits.num_classes == 3
        assert len(splits.train) + len(splits.test) == 60
        parts = partition_indices(splits, "natural", 4, seed=0)
        for k, who in enumerate(["ann", "bob", "cy", "dee"]):  # clients in the sorted order of their ids
            mine = np.flatnonzero(writers == who)
            assert len(parts[k]) == len(mine) - max(1, len(mine) // 5)
            assert {tuple(r) for r in splits.train.x[parts[k]]} <= {tuple(r) for r in x[mine]}
    np.savez(tmp_path / "bad.npz", x=x)
    with pytest.raises(ValueError, match="lacks the arrays"):
        load_dataset(f"npz:{tmp_path / 'bad.npz'}")
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="'label' column"):
        load_dataset(f"csv:{tmp_path / 'bad.csv'}")


def test_synthetic_clients_differ_as_alpha_and_beta_say():
    from fedpar.datasets.synthetic import SyntheticSpec, client_sizes
    spec = SyntheticSpec.parse("synthetic:1:1", clients=300)
    assert spec.name == "synthetic:1:1:300:10" and load_dataset(spec.name).input_shape == (60,)
    sizes = client_sizes(spec)
    assert sizes.min() >= 2 and np.median(sizes) > 8 and sizes.max() > 5 * np.median(sizes)  # long-tailed
    again = load_dataset("synthetic:1:1:300:10")
    np.testing.assert_array_equal(again.train.x, load_dataset(spec.name).train.x)  # every process builds the same
    means = [load_dataset(f"synthetic:0:{beta}:300:10").train.x.mean(axis=1).std() for beta in (0.0, 4.0)]
    assert means[1] > 1.5 * means[0]  # beta spreads the clients' inputs apart
    with pytest.raises(ValueError, match="CLIENTS"):
        load_dataset("synthetic:1:1")
    for lone in ("synthetic:x", "synthetic:0.5"):  # ALPHA without BETA was read as the defaults, 0.5:0.5
        with pytest.raises(ValueError, match="bad synthetic dataset name"):
            load_dataset(lone, clients=10)


def test_the_registry_finds_every_dataset_module_by_its_declaration(tmp_path):
    """Each dataset module declares its entries (@register_dataset): the registry lists them in module order, finds
    each by the names its usage allows, and gives a loader only the options it takes."""
    from fedpar.datasets.catalog import dataset_entries
    from fedpar.datasets.registry import dataset_entry, full_dataset_name

    entries = dataset_entries()
    names = [e.name for e in entries]
    assert [n for n in names if n in ("digits", "mnist", "synthetic", "npz", "csv", "text")] == [
        "digits", "mnist", "synthetic", "npz", "csv", "text"]  # a new one goes anywhere among them
    assert list(DATASETS) == [e.usage for e in entries]
    assert dataset_entry("Digits").name == "digits" and dataset_entry("synthetic:iid:3").name == "synthetic"
    assert dataset_entry("npz:/x/T.npz").name == "npz"
    for wrong in ("digits:x", "npz", "synthetic0.5", "texts"):
        with pytest.raises(ValueError, match="unknown dataset"):
            dataset_entry(wrong)
    assert full_dataset_name("synthetic", 7) == "synthetic:0.5:0.5:7:10" and full_dataset_name("digits", 7) == "digits"
    assert full_dataset_name("cifar", 7) == "cifar"  # refused where it is loaded, with the valid names
    _write_idx_folder(tmp_path)
    with pytest.raises(ValueError, match="^dataset mnist takes no option seed$"):
        load_dataset("mnist", tmp_path, seed=1)
    assert len(load_dataset("digits", data_dir=tmp_path).train) == 1437  # a bundled set ignores the folder
    # train hands --seed to every loader that takes one (digits' split), none to the rest
    assert dataset_entry("digits").takes("seed") and not dataset_entry("mnist").takes("seed")
    a, _ = load_train_data("digits", "", 8, seed=1)
    b, _ = load_train_data("digits", "", 8, seed=2)
    assert not a.train_targets.equal(b.train_targets)


def test_a_dataset_named_by_something_else_than_text_lists_the_names():
    # before: AttributeError: 'int' object has no attribute 'lower' (datasets/registry.py)
    with pytest.raises(TypeError, match=r"^a dataset is named by text, one of: digits, mnist, .*; got 3$"):
        load_dataset(3)

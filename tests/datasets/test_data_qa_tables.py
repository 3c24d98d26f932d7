"""A user's own CSV or npz table as people write them: by hand (spaces after the commas), exported with a trailing
comma, a header with no rows, float labels in an npz, a file of a million cells. Each loads as the user meant or is
refused in one line saying what to fix in the file."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from fedpar.datasets import load_dataset
from fedpar.datasets.clientdata import partition_indices

from support.in_process import run_main


def _rows(n: int = 30, width: int = 2, end: str = "") -> str:
    """``n`` data rows of ``width`` features and a label of two classes, each ending with ``end``."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, width)).round(4)
    return "".join(",".join(map(str, r)) + f",{int(r[0] > 0)}{end}\n" for r in x.tolist())


def _refused(dataset: str, says: str) -> str:
    """The error ``load_dataset(dataset)`` raised; it holds ``says``."""
    with pytest.raises(ValueError) as refused:
        load_dataset(dataset)
    assert says in str(refused.value), str(refused.value)
    return str(refused.value)


def test_a_header_written_with_a_space_after_each_comma_loads(tmp_path):
    """'a, b, label' (as people type a CSV) was refused as having no 'label' column, naming the one it has."""
    (tmp_path / "t.csv").write_text("a, b, label\n" + _rows().replace(",", ", "))
    splits = load_dataset(f"csv:{tmp_path / 't.csv'}")
    assert len(splits.train) + len(splits.test) == 30 and splits.input_shape == (2,) and splits.num_classes == 2


def test_a_label_or_client_column_named_in_capitals_is_named_in_the_refusal(tmp_path):
    """'Label' was told only that a 'label' column is needed; 'Client' (numbered ids) was silently a feature, its
    table split iid."""
    (tmp_path / "t.csv").write_text("a,b,Label\n" + _rows())
    _refused(f"csv:{tmp_path / 't.csv'}", "its column 'Label' must be named 'label', in lower case")
    (tmp_path / "c.csv").write_text("a,b,label,Client\n" + _rows(end=",1"))
    _refused(f"csv:{tmp_path / 'c.csv'}", "its column 'Client' must be named 'client', in lower case")


def test_a_trailing_comma_on_every_line_is_said_as_a_column_with_no_name(tmp_path):
    """Said 'line 2, column '' is blank; fill in every feature, or drop the row', of a column the user never wrote."""
    (tmp_path / "t.csv").write_text("a,b,label,\n" + _rows(end=","))
    said = _refused(f"csv:{tmp_path / 't.csv'}", "t.csv: its header's column 4 has no name")
    assert "trailing comma" in said, said


def test_a_csv_of_a_header_only_says_it_has_no_rows(tmp_path):
    """Said 'x, y (and client) must hold the same, non-zero number of examples', arrays a CSV's writer never saw."""
    (tmp_path / "t.csv").write_text("a,b,label\n\n")
    said = _refused(f"csv:{tmp_path / 't.csv'}", "t.csv has no examples: only its header row")
    assert "x, y" not in said, said


def test_npz_arrays_of_different_lengths_are_counted(tmp_path):
    np.savez(tmp_path / "t.npz", x=np.zeros((20, 3)), y=np.arange(10) % 2)
    _refused(f"npz:{tmp_path / 't.npz'}", "x holds 20 examples and y 10")
    np.savez(tmp_path / "c.npz", x=np.zeros((20, 3)), y=np.arange(20) % 2, client=np.arange(12))
    _refused(f"npz:{tmp_path / 'c.npz'}", "client holds 12")


def test_npz_labels_saved_as_whole_floats_are_their_classes(tmp_path):
    """y as float (pandas' column, y.astype(float)) was refused as 'labels must be whole numbers >= 0' though every
    one was; a CSV's '1.0' was already class 1."""
    x = np.random.default_rng(0).standard_normal((30, 3))
    np.savez(tmp_path / "t.npz", x=x, y=(np.arange(30) % 3).astype(np.float64))
    splits = load_dataset(f"npz:{tmp_path / 't.npz'}")
    assert splits.num_classes == 3 and splits.train.y.dtype == np.int64
    assert sorted(np.concatenate([splits.train.y, splits.test.y]).tolist()) == sorted((np.arange(30) % 3).tolist())
    np.savez(tmp_path / "half.npz", x=x, y=np.where(np.arange(30) == 7, 0.5, 1.0))
    _refused(f"npz:{tmp_path / 'half.npz'}", "half.npz: y of example 7 (counting from 0) is 0.5, not a class number")
    np.savez(tmp_path / "text.npz", x=x, y=np.array(["cat", "dog", "owl"] * 10))
    _refused(f"npz:{tmp_path / 'text.npz'}", "y holds <U3, not class numbers")


def test_a_negative_label_is_named_by_its_line_or_example(tmp_path):
    (tmp_path / "t.csv").write_text("a,b,label\n" + _rows() + "0.5,0.5,-1\n")
    _refused(f"csv:{tmp_path / 't.csv'}", "t.csv: line 32, the label is -1")
    np.savez(tmp_path / "t.npz", x=np.zeros((20, 3)), y=np.arange(20) % 2 - (np.arange(20) == 4))
    _refused(f"npz:{tmp_path / 't.npz'}", "t.npz: y of example 4 (counting from 0) is -1")


def test_natural_of_a_table_without_a_client_column_says_to_add_one(tmp_path, capfd):
    (tmp_path / "t.csv").write_text("a,b,label\n" + _rows())
    done = run_main(["simulate", "--dataset", f"csv:{tmp_path / 't.csv'}", "--clients", "2", "--rounds", "1",
                     "--partition", "natural", "--device", "cpu", "--out", str(tmp_path / "out")], capfd)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("fedpar simulate:")]
    assert len(said) == 1 and "a 'client' column" in said[-1], done.stderr[-3000:]


def test_natural_gives_each_client_of_the_file_its_rows_but_a_fifth(tmp_path):
    """Each writer's client gets its own rows, a fifth of them (one at least) held out for the test set."""
    writers = ["site-b"] * 10 + ["site-a"] * 7 + ["site-c"] * 1 + ["site-a"] * 3
    rows = _rows(len(writers)).splitlines()
    (tmp_path / "t.csv").write_text("a,b,label,client\n" + "".join(f"{r},{w}\n" for r, w in zip(rows, writers)))
    splits = load_dataset(f"csv:{tmp_path / 't.csv'}")
    parts = partition_indices(splits, "auto", 3, seed=0)
    assert [len(p) for p in parts] == [10 - 2, 10 - 2, 1]  # site-a, site-b, site-c: sorted by id
    assert len(splits.test) == 4


def test_a_large_csv_loads_in_a_few_times_its_size(tmp_path):
    """A 12 MB CSV took 200 MB to read (every cell a Python string, then a float), so that a 1 GB table, read by
    the coordinator and each worker process of simulate, needed some 50 GB."""
    n, width = 100_000, 10
    x = np.random.default_rng(0).standard_normal((n, width)).round(6)
    path = tmp_path / "big.csv"
    with open(path, "w") as f:
        f.write(",".join(f"f{i}" for i in range(width)) + ",label,client\n")
        f.writelines(",".join(map(repr, r)) + f",{i % 3},c{i % 50}\n" for i, r in enumerate(x.tolist()))
    size = path.stat().st_size
    tracemalloc.start()
    try:
        splits = load_dataset(f"csv:{path}")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(splits.train) + len(splits.test) == n and splits.input_shape == (width,)
    assert np.allclose(np.sort(np.concatenate([splits.train.x, splits.test.x]).sum(1)), np.sort(x.sum(1)), atol=1e-4)
    assert peak < 4 * size, (peak, size)


def _said_once(done, code: int) -> str:
    """The one 'fedpar simulate:' line of a run that ended with exit ``code``, with no traceback."""
    assert done.returncode == code and "Traceback" not in done.stderr, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("fedpar simulate:")]
    assert len(said) == 1, done.stderr[-3000:]
    return said[0]


def test_a_csv_too_large_for_this_machine_s_memory_is_said_before_it_is_read(tmp_path):
    """Read whole by simulate's coordinator and by each of its worker processes, a table larger than memory could
    only end in the kernel's out-of-memory kill; synthetic data was measured up front, a table was not."""
    from fedpar.datasets.registry import check_dataset_fits

    path = tmp_path / "huge.csv"
    path.write_text("a,b,c,label\n" + _rows(2000, 3))
    with open(path, "r+b") as f:
        f.truncate(1 << 40)  # a sparse terabyte: its first lines say how many cells it holds
    with pytest.raises(ValueError) as refused:
        check_dataset_fits(f"csv:{path}", 3, "iid")
    said = str(refused.value)
    assert f"{path} (about " in said and "GiB of memory and this machine has" in said, said
    assert "a smaller table" in said, said


def test_simulate_says_an_npz_too_large_for_this_machine_s_memory_before_reading_it(tmp_path, capfd):
    import io
    import zipfile

    header = io.BytesIO()
    np.lib.format.write_array_header_2_0(header, {"descr": "<f8", "fortran_order": False, "shape": (10**9, 1000)})
    with zipfile.ZipFile(tmp_path / "huge.npz", "w") as z:  # x's header only: its size is what the check reads
        z.writestr("x.npy", header.getvalue())
        y = io.BytesIO()
        np.save(y, np.arange(10) % 2)
        z.writestr("y.npy", y.getvalue())
    said = _said_once(run_main(["simulate", "--dataset", f"npz:{tmp_path / 'huge.npz'}", "--clients", "2",
                                "--rounds", "1", "--partition", "iid", "--device", "cpu",
                                "--out", str(tmp_path / "out")], capfd), 2)
    assert "(about 1,000,000,000,000 numbers" in said and "GiB of memory and this machine has" in said, said


def test_a_table_that_fits_is_not_refused_by_the_memory_check(tmp_path):
    from fedpar.datasets.registry import check_dataset_fits

    (tmp_path / "t.csv").write_text("a,b,c,label\n" + _rows(2000, 3))
    np.savez(tmp_path / "t.npz", x=np.zeros((2000, 3)), y=np.arange(2000) % 2)
    for name in (f"csv:{tmp_path / 't.csv'}", f"npz:{tmp_path / 't.npz'}", f"csv:{tmp_path / 'none.csv'}"):
        check_dataset_fits(name, 3, "iid")  # nothing said: a missing file is the loader's to name


def test_the_label_skew_of_many_classes_is_measured_without_a_table_of_every_class(tmp_path):
    """A table of 65,536 class numbers (as many as a label may have) made the summary's label skew a table of 2,000
    clients x 65,536 classes: over 1 GB and 8 s at the end of every simulation."""
    from fedpar.datasets.clientdata import label_counts, label_skew

    labels = np.arange(2000 * 32)  # each class once: each client holds 32 classes, one example of each
    parts = np.split(np.random.default_rng(0).permutation(len(labels)), 2000)
    tracemalloc.start()
    try:
        skew = label_skew(parts, labels, 65_536)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert skew == {"mean_classes_per_client": 32.0, "mean_top_class_share": pytest.approx(1 / 32)}
    assert peak < 20 * 2**20, peak
    small = np.random.default_rng(1).integers(0, 5, 300)
    few = [np.arange(0, 100), np.arange(100, 110), np.zeros(0, np.int64), np.arange(110, 300)]
    counts = label_counts(few, small, 5)
    sizes = np.maximum(counts.sum(1), 1)
    assert label_skew(few, small, 5) == {"mean_classes_per_client": pytest.approx((counts > 0).sum(1).mean()),
                                         "mean_top_class_share": pytest.approx((counts.max(1) / sizes).mean())}


def test_natural_is_taken_in_any_letters_as_the_other_partitions_are(tmp_path):
    """'--partition IID' and 'Dirichlet:0.5' were taken, 'Natural' refused by a line listing 'natural'."""
    from fedpar.datasets.members import member_source

    (tmp_path / "t.csv").write_text("a,b,label,client\n" + "".join(
        f"{r},c{i % 3}\n" for i, r in enumerate(_rows(30).splitlines())))
    splits = load_dataset(f"csv:{tmp_path / 't.csv'}")
    natural = [p.tolist() for p in partition_indices(splits, "natural", 3, seed=0)]
    assert [p.tolist() for p in partition_indices(splits, " Natural", 3, seed=0)] == natural
    assert member_source(splits, "NATURAL", 3, seed=0).sizes.tolist() == [len(p) for p in natural]


@pytest.mark.parametrize("kind", ["csv", "npz"])
def test_a_table_that_is_a_named_pipe_is_refused_not_waited_on(tmp_path, capfd, kind):
    """The memory check opened --dataset's file before the loader said it is no regular file: a named pipe hung."""
    import os
    import threading

    from fedpar.datasets.registry import check_dataset_fits

    pipe = tmp_path / f"t.{kind}"
    os.mkfifo(pipe)
    checked = threading.Thread(target=check_dataset_fits, args=(f"{kind}:{pipe}", 3, "iid"), daemon=True)
    checked.start()
    checked.join(10)
    if checked.is_alive():  # let it go: a writer's open ends the reader's wait
        os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
    assert not checked.is_alive(), "the memory check waited on a named pipe"
    said = _said_once(run_main(["simulate", "--dataset", f"{kind}:{pipe}", "--clients", "2", "--rounds", "1",
                                "--partition", "iid", "--device", "cpu", "--out", str(tmp_path / "out")], capfd), 2)
    assert f"{pipe} is not a regular file" in said, said


def test_a_spreadsheet_s_crlf_quoted_csv_reads_as_the_plain_one(tmp_path):
    """Line ends, quotes and a byte-order mark change nothing in what a client gets."""
    rows = _rows(40).splitlines()
    (tmp_path / "plain.csv").write_text("a,b,label,client\n" + "".join(f"{r},c{i % 4}\n" for i, r in enumerate(rows)))
    quoted = "".join(",".join(f'"{cell}"' for cell in f"{r},c{i % 4}".split(",")) + "\r\n" for i, r in enumerate(rows))
    (tmp_path / "excel.csv").write_bytes(("\ufeff\"a\",\"b\",\"label\",\"client\"\r\n" + quoted).encode("utf-8"))
    plain, excel = (load_dataset(f"csv:{tmp_path / name}") for name in ("plain.csv", "excel.csv"))
    for split in ("train", "test"):
        assert np.array_equal(getattr(plain, split).x, getattr(excel, split).x)
        assert np.array_equal(getattr(plain, split).y, getattr(excel, split).y)
    assert np.array_equal(plain.train_owners, excel.train_owners)


def test_a_table_sorted_by_label_holds_out_every_class_of_each_client(tmp_path):
    """Each client's first fifth was its test share: a table exported sorted by client then label (20 rows of each
    of 5 classes a client) had a test set of class 0 only, and no example of class 0 to train on."""
    rng = np.random.default_rng(0)
    rows = [f"{rng.normal() + label:.3f},{rng.normal():.3f},{label},site{c}"
            for c in range(4) for label in range(5) for _ in range(20)]
    (tmp_path / "t.csv").write_text("a,b,label,client\n" + "\n".join(rows) + "\n")
    splits = load_dataset(f"csv:{tmp_path / 't.csv'}")
    assert len(splits.test) == 80 and np.bincount(splits.train_owners).tolist() == [80] * 4  # a fifth of each
    assert (np.bincount(splits.test.y, minlength=5) >= 8).all(), np.bincount(splits.test.y)  # 16 each expected
    assert (np.bincount(splits.train.y, minlength=5) >= 48).all(), np.bincount(splits.train.y)  # 64 each expected
    again = load_dataset(f"csv:{tmp_path / 't.csv'}")
    assert np.array_equal(again.test.x, splits.test.x) and np.array_equal(again.train_owners, splits.train_owners)

"""A user's CSV table whose features are far out of scale, or whose labels are ids rather than class numbers, run by
`fedpar train` and `fedpar simulate`: one line naming the line and column (or the labels) and what to do, never a
NaN-loss line that blames the learning rate, nor a model of a million outputs."""

from __future__ import annotations

import numpy as np

from support.in_process import run_main


def _table(path, scale: float = 1.0, labels=(0, 1)) -> str:
    """A CSV of 200 rows, its column 'b' multiplied by ``scale`` and its two classes numbered ``labels``."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 3))
    x[:, 1] *= scale
    y = np.where(x[:, 0] > 0, labels[1], labels[0])
    path.write_text("a,b,c,label\n" + "".join(f"{r[0]!r},{r[1]!r},{r[2]!r},{c}\n" for r, c in zip(x.tolist(), y)))
    return f"csv:{path}"


def _train(dataset: str, tmp_path, capfd):
    return run_main(["train", "--dataset", dataset, "--epochs", "1", "--device", "cpu",
                     "--out", str(tmp_path / "train")], capfd)


def _simulate(dataset: str, tmp_path, capfd):
    return run_main(["simulate", "--dataset", dataset, "--clients", "2", "--rounds", "1", "--partition", "iid",
                     "--device", "cpu", "--out", str(tmp_path / "simulate")], capfd)


def _said(done, code: int) -> str:
    """The one line a run that ended with exit ``code`` said (after its progress, which starts no line with it)."""
    assert done.returncode == code, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("fedpar ")]
    assert len(lines) == 1, done.stderr[-3000:]
    return lines[0]


def test_an_overflowing_feature_is_refused_up_front_naming_its_line_and_column(tmp_path, capfd):
    """1e30 trained to a NaN loss, and the line said to lower --lr."""
    dataset = _table(tmp_path / "huge.csv", scale=1e30)
    for run, command in ((_train, "train"), (_simulate, "simulate")):
        said = _said(run(dataset, tmp_path, capfd), 2)
        assert said.startswith(f"fedpar {command}: {tmp_path / 'huge.csv'}: line 2, column 'b' is "), said
        assert said.endswith(", too large to train on (past about 1.8e+19, its square overflows float32): "
                             "standardise that feature (e.g. to mean 0 and sd 1, with the same statistics at every "
                             "site), or drop such examples"), said


def test_a_loss_gone_nan_on_features_far_out_of_scale_names_them_as_the_likely_cause(tmp_path, capfd):
    """Features of 1e15 load (they are finite and square within float32) but diverge: the line said to lower --lr
    (train, simulate), or that the task's loss might not be finite (simulate)."""
    dataset = _table(tmp_path / "large.csv", scale=1e15)
    said = _said(_train(dataset, tmp_path, capfd), 1)
    assert said.startswith("fedpar train: the training loss is nan at step "), said
    assert "training diverged, likely because the features are far out of scale (they reach 3.11e+15): standardise " \
           "each feature (e.g. to mean 0 and sd 1, with the same statistics at every site); else lower --lr, or " \
           "set --grad-clip" in said, said
    said = _said(_simulate(dataset, tmp_path, capfd), 1)
    assert said.startswith("fedpar simulate: every round failed (1 of 1): the members' training failed: task "
                           f"'mlp on {dataset}': the training loss is nan (lr 0.1): training diverged, likely because "
                           "the features are far out of scale (they reach "), said
    assert said.endswith("): standardise each feature (e.g. to mean 0 and sd 1, with the same statistics at every "
                         "site)"), said


def test_labels_that_are_ids_are_refused_saying_they_are_not_renumbered(tmp_path, capfd):
    """Labels 0 and 60000 built a model of 60,001 outputs; 0 and 1000000 are past the bound on classes."""
    for labels, says in (((0, 60000), "labels are class numbers 0..K-1, but only 2 of the 60001 numbers 0..60000 "
                                      "occur (a model of 60001 outputs, most never trained); renumber them 0..1 the "
                                      "same way at every site, e.g. y = np.unique(y, return_inverse=True)[1]"),
                         ((0, 1000000), "labels are class numbers 0..K-1 (K at most 65536), but one is 1000000; "
                                        "renumber them")):
        dataset = _table(tmp_path / "ids.csv", labels=labels)
        for run, command in ((_train, "train"), (_simulate, "simulate")):
            said = _said(run(dataset, tmp_path, capfd), 2)
            assert said.startswith(f"fedpar {command}: {tmp_path / 'ids.csv'}: {says}"), said


def test_labels_with_a_few_unused_class_numbers_still_train(tmp_path, capfd):
    """Classes 2 and 5 of 0..5 (a subset, or 1-based labels) are class numbers, not ids: a model of 6 outputs."""
    done = _train(_table(tmp_path / "gaps.csv", labels=(2, 5)), tmp_path, capfd)
    assert done.returncode == 0, done.stderr[-3000:]

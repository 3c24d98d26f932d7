"""`fedpar simulate` end to end: a real coordinator and 10 real agents on loopback gRPC."""

import json
import subprocess

import pytest
import torch
from safetensors.numpy import load_file

from fedpar.cli.main import main
from fedpar.datasets import load_dataset
from fedpar.models import weight_specs
from fedpar.models.for_data import build_model_for_data
from fedpar.protocol.codec import ModelLayout
from support.classifier_score import evaluate_classifier
from support.in_process import logging_as_a_fresh_process


def _simulate(args: list[str], capfd) -> subprocess.CompletedProcess:
    """`fedpar simulate ARGS` by its main in this process (the simulation runs in its child, the clients in worker
    processes): its exit code, and what it and its processes wrote to stdout and stderr, its log included."""
    capfd.readouterr()
    with logging_as_a_fresh_process():
        code = main(["simulate", *args])
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["fedpar", "simulate", *args], code, out, err)


@pytest.mark.timeout(900)
def test_simulate_ten_clients_reaches_90_percent_on_digits(tmp_path, capfd):
    out = tmp_path / "run"
    result = _simulate(["--clients", "10", "--rounds", "10", "--dataset", "digits", "--partition", "iid",
                        "--out", str(out)], capfd)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "test_accuracy" in result.stdout  # the per-round table
    assert f"wrote {out}/metrics.jsonl, metrics.csv, global.safetensors, global.json, summary.json, accuracy.png, " \
           "loss.png and labels.png" in result.stdout.splitlines()  # the model first, then the summary and plots
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 10 and summary["wall_seconds"] > 0
    assert summary["final_test_accuracy"] >= 0.90
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(1, 11))
    for key in ("sampled", "reported", "late", "test_accuracy", "round_seconds", "upload_bytes"):
        assert all(key in r for r in rows)
    # Uncompressed: every accepted upload is the whole float32 model.
    splits = load_dataset("digits")
    model_bytes = ModelLayout(weight_specs(build_model_for_data("mlp", splits.input_shape, splits.num_classes))).total_bytes
    assert all(r["upload_bytes"] == r["reported"] * model_bytes for r in rows)
    assert summary["mean_upload_bytes_per_round"] == sum(r["upload_bytes"] for r in rows) / 10
    for plot in ("accuracy.png", "loss.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The model to keep: the last round's global model, by state_dict name, and what rebuilds it.
    info = json.loads((out / "global.json").read_text())
    assert info["round"] == 10 and info["metrics"] == rows[-1] and info["model"]["model"] == "mlp"
    model = build_model_for_data("mlp", tuple(info["model"]["input_shape"]), info["model"]["num_classes"])
    model.load_state_dict({k: torch.from_numpy(v) for k, v in load_file(out / "global.safetensors").items()})
    assert evaluate_classifier(model, *splits.test.to_tensors()).accuracy == pytest.approx(rows[-1]["test_accuracy"])
    # Federated evaluation: the agents score the model they receive on their own validation splits, so
    # round r's score is that of the model the server tested after round r-1 (other data, same model).
    for before, row in zip(rows, rows[1:]):
        assert abs(row["federated_eval_accuracy"] - before["test_accuracy"]) < 0.1, (before, row)
    assert rows[0]["federated_eval_accuracy"] < 0.5  # the untrained initial model


@pytest.mark.timeout(600)
def test_heterogeneous_federation_overselects_and_leaves_slow_and_dropping_clients_behind(tmp_path):
    from fedpar.simulations.runner import SimulationConfig, run_simulation

    cfg = SimulationConfig(clients=12, rounds=3, partition="dirichlet:0.3", clients_per_round=6, overselect=1.3,
                           slow_fraction=0.25, slow_step_delay=0.5, drop_probability=0.2, deadline_seconds=2.5,
                           workers=1, out=str(tmp_path / "het"))
    summary = run_simulation(cfg)
    rows = [json.loads(line) for line in (tmp_path / "het" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3] and summary["failed_rounds"] == 0
    for r in rows:
        assert r["sampled"] == 8  # ceil(6 x 1.3) of the 12 live agents
        assert 1 <= r["reported"] <= 6  # the first K count; a round also closes at its deadline
        assert r["reported"] + r["rejected"] + r["late"] + r["silent"] + r["not_needed"] == r["sampled"]
    # Slow devices need ~0.5 s per step: they cannot be among the first K, and drops happen per agent.
    assert sum(r["silent"] + r["not_needed"] for r in rows) >= 3
    assert summary["final_test_accuracy"] > 0.3  # chance is 0.1: the fast clients still teach the model


@pytest.mark.timeout(120)
def test_coordinator_folds_on_one_thread_while_cpu_workers_train_and_gives_threads_back(tmp_path):
    from fedpar.simulations.runner import SimulationConfig, run_simulation

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen: list[int] = []  # torch's threads where the coordinator finishes each round
    try:
        summary = run_simulation(SimulationConfig(clients=2, rounds=2, workers=1, device="cpu",
                                                  out=str(tmp_path / "out")),
                                 on_round=lambda row: seen.append(torch.get_num_threads()))
        assert summary["failed_rounds"] == 0
        assert seen == [1, 1]
        assert torch.get_num_threads() == 2  # the caller's setting, back after the run
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("batching", ["on", "off"])
def test_members_without_time_to_train_are_said_once_a_round_per_host_and_no_train_hook_is_blamed(tmp_path, batching,
                                                                                                  capfd):
    """A deadline too short for every member: each host says it once a round (it said one line per member: 4,073
    lines for 100,000 clients), and fedpar's own loop is not told to 'loop over deadline.steps' (that is for a task's
    train hook)."""
    done = _simulate(["--clients", "20", "--rounds", "2", "--deadline", "1", "--slow-fraction", "1",
                      "--slow-step-delay", "2", "--client-batching", batching, "--quiet", "--out", str(tmp_path / "run")],
                     capfd)
    assert done.returncode == 1 and "every round failed (2 of 2)" in done.stderr, done.stderr[-2000:]
    assert "deadline.steps" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if "no time left to train" in line]
    assert len(said) <= 2 * 2, said  # at most once per host (2 workers) and round

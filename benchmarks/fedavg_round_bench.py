"""The FedAvg paper's round, clients one after another vs client-batched (client/batched_trainer.py).

The round: 10 clients of an IID split into 100 (C = 0.1), E = 5 local epochs, B = 10, SGD lr 0.1, the paper's
CNN, on MNIST when ``../shared/data/mnist`` holds it (600 examples a client) and on digits otherwise (about
14; ``--dataset`` picks). From the same initial model, round after round and interleaved: (1) sequential: each
client's LocalTrainer on ``device`` in turn; (2) batched: all 10 clients as one batched model on ``device``
(on CUDA each step replayed as a CUDA graph, and (2b) ``batched_eager``: the same without graphs);
each followed by the FedAvg of the clients' weights and the test accuracy of that averaged model. The two
trajectories must match, so that the ratio compares the same work: every round's accuracies within 0.3
points (``accuracy_matches``). Each step's gradients agree to about 1e-6 relative, but over hundreds of SGD
steps float32 rounding moves the weights apart (up to about 2e-2 on MNIST after two rounds, at the same
accuracy; ``max_weight_difference``). Beside them, the baseline the GPU must beat: (4) ``fedpar simulate`` of the same
round (100 clients, 10 a round, E, B, lr, the CNN) on the CPU with one agent worker per core, its median round
time from metrics.jsonl (round 1, with the workers' start-up, excluded); ``--no-simulate`` skips it.

Run: ``.venv/bin/python benchmarks/fedavg_round_bench.py [--device cpu|cuda] [--quick] [--rounds R]``.
``--quick``: E = 1 and at most 100 examples a client; ``--epochs E``: E local epochs of the whole shares (the steps
are alike from epoch to epoch, so E = 1 times a fifth of the round at the same ratio, on a loaded machine). TF32 is
off (both ways), so the trajectories compare.
Prints progress, a table and one JSON object; ``fedavg_round(device, quick)`` returns that object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from fedpar.aggregation import fedavg
from fedpar.cli.argtypes import FedparParser  # noqa: E402
from fedpar.client.batched_trainer import ClientBatchInput, train_clients_batched
from fedpar.client.trainer import LocalTrainer
from fedpar.datasets import load_dataset
from fedpar.models import get_weights, set_weights
from fedpar.models.for_data import build_model_for_data
from fedpar.datasets.clientdata import partition_indices
from fedpar.parallel.device import flush_denormals

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # tests/support
from support.classifier_score import evaluate_classifier  # noqa: E402

MNIST_DIRS = [HERE.parent.parent / "shared" / "data" / "mnist", HERE.parent / "shared" / "data" / "mnist"]
POPULATION, COHORT, EPOCHS, BATCH, LR, SEED = 100, 10, 5, 10, 0.1, 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _data(quick: bool, dataset: str | None):
    """(dataset name, splits, the cohort's local datasets): the first COHORT clients of an IID split in 100."""
    mnist = next((d for d in MNIST_DIRS if (d / "train.npz").exists()), None) if dataset != "digits" else None
    if dataset == "mnist" and mnist is None:
        raise SystemExit(f"fedavg_round_bench: no MNIST in {' or '.join(map(str, MNIST_DIRS))}")
    splits = load_dataset("mnist", mnist) if mnist else load_dataset("digits")
    parts = partition_indices(splits, "iid", POPULATION, SEED)[:COHORT]
    clients = [splits.train.subset(p[:100] if quick else p) for p in parts]
    return ("mnist" if mnist else "digits"), splits, clients


def _sequential_round(model: torch.nn.Module, trainers: list[LocalTrainer], global_weights, epochs: int,
                      round_id: int, device: torch.device):
    """Every client's LocalTrainer in turn from ``global_weights``; (FedAvg of their weights, seconds)."""
    _sync(device)
    start = time.perf_counter()
    results = []
    for trainer in trainers:
        set_weights(model, global_weights)
        result = trainer.train(epochs, BATCH, LR, round_id=round_id)
        results.append((get_weights(model), result.examples))
    averaged = fedavg(results)
    return averaged, time.perf_counter() - start


def _batched_round(model: torch.nn.Module, clients: list[ClientBatchInput], global_weights, epochs: int,
                   round_id: int, device: torch.device, cuda_graphs: bool = True):
    """All clients as one batched model from ``global_weights``; (FedAvg of their weights, seconds)."""
    set_weights(model, global_weights)
    _sync(device)
    start = time.perf_counter()
    outputs = train_clients_batched(model, clients, epochs, BATCH, LR, round_id, device, cuda_graphs=cuda_graphs)
    names = [name for name, _ in model.named_parameters()]  # the state's float entries (the CNN has no buffers)
    averaged = fedavg([([o.weights[n].numpy() for n in names], o.result.examples) for o in outputs])
    return averaged, time.perf_counter() - start


def simulate_on_cpu(dataset: str, epochs: int, rounds: int) -> dict:
    """The same round through ``fedpar simulate --device cpu`` with a worker per core: median round seconds."""
    workers = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as out:
        mnist = next((d for d in MNIST_DIRS if (d / "train.npz").exists()), None)
        data = ["--data-dir", str(mnist)] if dataset == "mnist" else []
        cmd = [sys.executable, "-m", "fedpar", "simulate", "--device", "cpu", "--workers", str(workers),
               "--clients", str(POPULATION), "--clients-per-round", str(COHORT), "--rounds", str(rounds + 1),
               "--model", "cnn", "--dataset", dataset, *data, "--local-epochs", str(epochs), "--batch-size",
               str(BATCH), "--lr", str(LR), "--seed", str(SEED), "--deadline", "3600", "--quiet", "--out", out]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["round_seconds"] for r in rows[1:]]
    return {"workers": workers, "round_seconds": seconds, "seconds_per_round": statistics.median(seconds),
            "test_accuracy": [r.get("test_accuracy") for r in rows[1:]]}


def fedavg_round(device: str, quick: bool, rounds: int | None = None,
                 dataset: str | None = None, simulate: bool = True, epochs: int | None = None) -> dict:
    """Seconds per FedAvg-paper round, sequential vs client-batched on ``device``, and both trajectories
    (``dataset``: mnist or digits; default MNIST when it is there)."""
    dev = torch.device(device)
    flush_denormals()
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        out = _measure(dev, quick, rounds or 2, dataset, epochs)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    if simulate and not quick:  # a quick run's clients hold 100 examples; simulate's hold all of theirs
        print("  simulate on the CPU ...", file=sys.stderr, flush=True)
        cpu = simulate_on_cpu(out["dataset"], out["epochs"], rounds or 2)
        cpu["batched_speedup"] = cpu["seconds_per_round"] / out["ways"]["batched"]["seconds_per_round"]
        out["simulate_cpu"] = cpu
    return out


def _measure(dev: torch.device, quick: bool, rounds: int, dataset: str | None,
             epochs: int | None = None) -> dict:
    epochs = epochs or (1 if quick else EPOCHS)
    name, splits, data = _data(quick, dataset)
    torch.manual_seed(SEED)
    model = build_model_for_data("cnn", splits.input_shape, splits.num_classes).to(dev)
    initial = get_weights(model)
    x_test, y_test = (t.to(dev) for t in splits.test.to_tensors())
    trainers = []
    for k, d in enumerate(data):
        trainer = LocalTrainer(model, d, seed=k, device=dev)
        trainers.append(trainer)
    clients = [ClientBatchInput(*d.to_tensors(), seed=k) for k, d in enumerate(data)]
    ways = {"sequential": lambda w, r: _sequential_round(model, trainers, w, epochs, r, dev),
            "batched": lambda w, r: _batched_round(model, clients, w, epochs, r, dev)}
    if dev.type == "cuda":  # the default replays each step as a CUDA graph: the same stack, every step eager
        ways["batched_eager"] = lambda w, r: _batched_round(model, clients, w, epochs, r, dev, False)
    # Warm-up, not timed: torch's lazy set-up (cuDNN, torch.func's dynamo import, compilation), on two batches
    # of every client (the batched step's shapes).
    trainers[0].warm_up()
    warm = [ClientBatchInput(c.x[:2 * BATCH], c.y[:2 * BATCH], c.seed) for c in clients]
    train_clients_batched(model, warm, 1, BATCH, 0.0, device=dev)
    train_clients_batched(model, warm, 7, BATCH, 0.0, device=dev)  # long enough to record its CUDA graph
    out = {"device": str(dev), "dataset": name, "clients": COHORT, "epochs": epochs, "batch_size": BATCH,
           "lr": LR, "examples_per_client": [len(d) for d in data], "rounds": rounds, "tf32": False,
           "torch_threads": torch.get_num_threads()}
    final = {label: initial for label in ways}
    out["ways"] = {label: {"round_seconds": [], "test_accuracy": []} for label in ways}
    for r in range(1, rounds + 1):
        for label, way in ways.items():  # interleaved: every way sees the same machine load, round by round
            final[label], s = way(final[label], r)
            set_weights(model, final[label])
            accuracy = evaluate_classifier(model, x_test, y_test).accuracy
            out["ways"][label]["round_seconds"].append(s)
            out["ways"][label]["test_accuracy"].append(accuracy)
            print(f"  {label}: round {r} {s:.3f} s, test accuracy {accuracy:.4f}", file=sys.stderr, flush=True)
    base = out["ways"]["sequential"]
    for label, way in out["ways"].items():
        way["seconds_per_round"] = statistics.median(way["round_seconds"])
        way["ratio_vs_sequential"] = way["seconds_per_round"] / base["seconds_per_round"]
        way["max_weight_difference"] = max(float(np.abs(a - b).max())
                                           for a, b in zip(final[label], final["sequential"]))
        way["accuracy_matches"] = all(abs(a - b) <= 0.003
                                      for a, b in zip(way["test_accuracy"], base["test_accuracy"]))
    return out


def main() -> None:
    """Command line: run the benchmark, print the table and the JSON object."""
    p = FedparParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--quick", action="store_true", help="E=1 and at most 100 examples a client: a smoke run")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds per way (after one untimed warm-up round)")
    p.add_argument("--dataset", choices=["mnist", "digits"], help="default: MNIST when it is there, else digits")
    p.add_argument("--epochs", type=int, help=f"local epochs (default {EPOCHS}, the paper's; 1 with --quick)")
    p.add_argument("--no-simulate", action="store_true", help="skip the fedpar simulate (CPU, all cores) baseline")
    a = p.parse_args()
    print(f"FedAvg round benchmark on {a.device} ({os.cpu_count()} cores)", file=sys.stderr, flush=True)
    r = fedavg_round(a.device, a.quick, a.rounds, a.dataset, simulate=not a.no_simulate, epochs=a.epochs)
    print(f"\n== FedAvg paper round: {r['dataset']} CNN, {r['clients']} clients x E={r['epochs']} x B={r['batch_size']}"
          f" on {r['device']} ==")
    print(f"{'way':<18}{'s/round':>10}{'ratio':>8}{'final accuracy':>16}{'max |dw|':>11}{'match':>7}")
    for label, way in r["ways"].items():
        print(f"{label:<18}{way['seconds_per_round']:>10.3f}{way['ratio_vs_sequential']:>8.2f}"
              f"{way['test_accuracy'][-1]:>16.4f}{way['max_weight_difference']:>11.2e}"
              f"{str(way['accuracy_matches']):>7}")
    if "simulate_cpu" in r:
        cpu = r["simulate_cpu"]
        print(f"{'simulate (CPU)':<18}{cpu['seconds_per_round']:>10.3f}  ({cpu['workers']} workers; its round time / "
              f"batched's = {cpu['batched_speedup']:.2f})")
    print("s/round: median of the timed rounds (training + FedAvg, not the evaluation); ratio: way / sequential")
    print(json.dumps(r))


if __name__ == "__main__":
    main()

"""The floor for `fedpar simulate`: the same FedAvg job as plain PyTorch in one process, no framework.

Same data split (fedpar's partitioner and local train/validation split, same seeds), same initial model,
same local SGD (epochs, batch size, learning rate, per-client shuffling seeds), same example-weighted
average and the same central evaluation every round. Only the coordinator, the agents and gRPC are gone.

Run: ``.venv/bin/python benchmarks/fedavg_floor.py --clients 10 --rounds 10 --dataset digits``
It prints one JSON object: per-round seconds and test accuracy, and the wall time since process start.
"""

from __future__ import annotations

import time

PROCESS_START = time.monotonic()  # before torch is imported: the floor pays its own start-up too

import argparse  # noqa: E402
import json  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fedpar.cli.argtypes import FedparParser  # noqa: E402
from fedpar.datasets import load_dataset  # noqa: E402
from fedpar.models.for_data import build_model_for_data  # noqa: E402
from fedpar.datasets.clientdata import client_parts, local_split  # noqa: E402
from fedpar.datasets.registry import full_dataset_name  # noqa: E402
from fedpar.client.local_loop import member_seed as seed_of  # noqa: E402
from fedpar.simulations.population import client_id  # noqa: E402
from fedpar.parallel.device import flush_denormals


def local_sgd(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, batch_size: int, lr: float,
              seed: int) -> int:
    """Plain minibatch SGD for ``epochs`` (fedpar's client shuffles the same way); returns examples seen."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    seen = 0
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=gen)
        for begin in range(0, len(y), batch_size):
            idx = order[begin:begin + batch_size]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen += len(idx)
    return seen


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy."""
    model.eval()
    return (model(x).argmax(dim=1) == y).float().mean().item()


def run(clients: int, rounds: int, dataset: str, data_dir: str | None, model_name: str, partition: str,
        epochs: int, batch_size: int, lr: float, val_fraction: float, seed: int, threads: int = 1,
        clients_per_round: int | None = None, examples_per_client: int | None = None) -> dict:
    """Run the FedAvg job: each round ``clients_per_round`` clients (default all) drawn as fedpar's coordinator
    draws them (numpy PCG64 seeded with ``seed``, without replacement, in id order)."""
    flush_denormals()
    # One intra-op thread: the fastest setting for these small models here (2 threads measured slower and
    # erratic whenever the other core is busy), so the floor is as low as plain PyTorch gets.
    torch.set_num_threads(threads)
    splits = load_dataset(full_dataset_name(dataset, clients), data_dir)
    parts = client_parts(splits, partition, clients, seed, examples_per_client)
    torch.manual_seed(seed)
    global_model = build_model_for_data(model_name, splits.input_shape, splits.num_classes)
    local = build_model_for_data(model_name, splits.input_shape, splits.num_classes)
    data = []
    for i, indices in enumerate(parts):
        train, _ = local_split(splits.train, indices, val_fraction, seed)
        data.append((*train.to_tensors(), seed_of(seed, client_id(i))))  # the seed fedpar's client i uses
    x_test, y_test = splits.test.to_tensors()
    sampler = np.random.Generator(np.random.PCG64(seed))
    cohort_size = clients_per_round or clients
    rows = []
    for round_id in range(1, rounds + 1):
        t0 = time.monotonic()
        total = 0
        summed = {k: torch.zeros_like(v) for k, v in global_model.state_dict().items()}
        cohort = (range(clients) if cohort_size >= clients
                  else sorted(sampler.choice(clients, size=cohort_size, replace=False)))
        for x, y, client_seed in (data[i] for i in cohort):
            local.load_state_dict(global_model.state_dict())
            n = local_sgd(local, x, y, epochs, batch_size, lr, client_seed * 1_000_003 + round_id)
            for k, v in local.state_dict().items():
                summed[k].add_(v, alpha=n)
            total += n
        global_model.load_state_dict({k: v / total for k, v in summed.items()})
        acc = accuracy(global_model, x_test, y_test)
        rows.append({"round": round_id, "round_seconds": time.monotonic() - t0, "test_accuracy": acc})
    return {"rounds": rows, "final_test_accuracy": rows[-1]["test_accuracy"],
            "wall_seconds": time.monotonic() - PROCESS_START}


def main() -> None:
    """Command line: the job's settings, defaults equal to `fedpar simulate`'s."""
    p = FedparParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--dataset", default="digits")
    p.add_argument("--data-dir")
    p.add_argument("--model", default="mlp")
    p.add_argument("--partition", default="iid")
    p.add_argument("--local-epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--clients-per-round", type=int, help="clients drawn each round (default: all)")
    p.add_argument("--examples-per-client", type=int, help="keep at most this many of each client's examples")
    a = p.parse_args()
    print(json.dumps(run(a.clients, a.rounds, a.dataset, a.data_dir, a.model, a.partition, a.local_epochs,
                         a.batch_size, a.lr, a.val_fraction, a.seed, a.threads,
                         a.clients_per_round, a.examples_per_client)))


if __name__ == "__main__":
    main()

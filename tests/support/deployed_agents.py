"""A real `fedpar serve` and one real `fedpar client` process per member of a simulated population, each as that
member (its id, its share, the run's --seed): what `fedpar simulate` with the same settings must learn
(tests/simulations/test_same_model.py, the zoo's digits model; test_qa73_data_same_model_own_task.py, a user's task)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from fedpar.server.final_model import load_final_model
from fedpar.simulations.population import client_id
from support.processes import port_in_file

ROOT = Path(__file__).resolve().parents[2]


def _fedpar(tmp: Path, name: str, args: list[str]) -> subprocess.Popen:
    with open(tmp / f"{name}.log", "w") as log:  # a file, not a pipe: a full pipe would block the process
        return subprocess.Popen([sys.executable, "-m", "fedpar", *args], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def deployed_model(tmp: Path, clients: int, seed: int, training: list[str], split: list[str],
                   rounds: list[str]) -> list[np.ndarray]:
    """The final global weights of serve (``training`` and ``rounds``, which hold ``--seed seed``) and ``clients``
    agents named as the simulation names its members, each given its member's share (``split``) and the run's seed
    (out: ``tmp``/deployed)."""
    serve = _fedpar(tmp, "serve", ["serve", "--insecure", "--port", "0", "--port-file", str(tmp / "port"), "--out",
                                   str(tmp / "deployed"), "--min-available", str(clients), *training, *rounds])
    agents: list[subprocess.Popen] = []
    try:
        address = f"127.0.0.1:{port_in_file(tmp / 'port', serve, tmp / 'serve.log')}"
        for n in range(clients):
            member = client_id(n)  # the member's id and partition in the simulation; its seed is the run's
            agents.append(_fedpar(tmp, member, [
                "client", "--insecure", "--server", address, "--agent-id", member, "--poll", "1", *training, *split,
                "--num-partitions", str(clients), "--partition-index", str(n), "--partition-seed", str(seed),
                "--seed", str(seed)]))
        assert serve.wait(120) == 0, (tmp / "serve.log").read_text()[-3000:]
        for a in agents:
            assert a.wait(60) == 0, (tmp / f"{a.args[a.args.index('--agent-id') + 1]}.log").read_text()[-3000:]
    finally:
        for p in (serve, *agents):
            if p.poll() is None:
                p.kill()
    return load_final_model(tmp / "deployed")[1]

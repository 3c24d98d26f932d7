"""A program that starts a CoordinatorServer from Python and ends without stop() ends quietly: the server is stopped
as the interpreter exits, not torn down half-way with a false 'coordinator stopped with an error'."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import sys, threading
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    from fedpar import ClientData, Partition, Task
    from fedpar.aggregation import FedAvg
    from fedpar.client.agent import Agent, AgentConfig
    from fedpar.client.task_trainer import TaskTrainer
    from fedpar.server.assembly import CoordinatorAssembly
    from fedpar.server.config import CoordinatorConfig

    X, Y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    task = Task(model=lambda: nn.Linear(4, 2), client_data=lambda p: ClientData(TensorDataset(X, Y)),
                loss=nn.functional.cross_entropy)
    config = CoordinatorConfig(rounds=1, clients_per_round=1, min_available=1, local_epochs=1)
    server = CoordinatorAssembly.for_task(task, 0, None).server(config, FedAvg())
    server.start()
    trainer = TaskTrainer(task, task.client_data(Partition()))
    agent = Agent(AgentConfig(server=server.address, agent_id="a", insecure=True), trainer)
    threading.Thread(target=agent.run, daemon=sys.argv[1] == "raise").start()
    assert server.wait(60)
    print("round", server.coordinator.metrics.last["round"])
    if sys.argv[1] == "raise":
        raise SystemExit("the program failed after start()")
''')


@pytest.mark.parametrize("how, code, stderr", [("end", 0, ""), ("raise", 1, "the program failed after start()")])
def test_a_server_never_stopped_ends_quietly_with_the_program(tmp_path, how, code, stderr):
    # before: 'Task was destroyed but it is pending!', 'coordinator stopped with an error' and a traceback ending in
    # 'RuntimeError: no running event loop' on stderr, though the run completed
    script = tmp_path / "unstopped.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "round 1"
    assert (done.returncode, done.stderr.strip()) == (code, stderr)

"""A rank of a large-model agent that fails or is killed: the agent stops its other ranks and says so in one line,
exit 1 (QA: torch's 'Terminating process N via signal SIGTERM' warning beside 'a rank of agent big failed: process 1
terminated with signal SIGKILL', and a task that raised in training printed the rank's whole traceback)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from support.processes import started

AGENT = [sys.executable, "-m", "fedpar", "client", "--agent-id", "big", "--server", "127.0.0.1:1", "--insecure",
         "--device", "cpu", "--nproc", "2", "--fsdp", "2", "--dist-timeout", "60"]

FIXED_BATCH_TASK = '''
from torch import nn
from fedpar import Task
from fedpar.datasets import load_dataset
from fedpar.tasks import share_of

splits = load_dataset("digits")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(64, 10)

    def forward(self, x):
        if self.training:
            x = x.reshape(16, 64)  # a batch size written into the model: wrong for any other batch
        return self.l(x.reshape(x.shape[0], -1))


def task():
    return Task(model=Net, client_data=lambda p: share_of(splits.train, p), test_data=lambda: splits.test,
                loss=nn.functional.cross_entropy)
'''


def test_a_task_that_raises_as_its_ranks_train_is_one_line(tmp_path):
    (tmp_path / "fixed_batch.py").write_text(FIXED_BATCH_TASK)
    done = subprocess.run([*AGENT, "--task", f"{tmp_path / 'fixed_batch.py'}:task", "--give-up-after", "5"],
                          capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in output and "Terminating process" not in output, output[-3000:]
    assert "of agent big failed: RuntimeError: shape '[16, 64]' is invalid" in output, output


def test_a_rank_killed_from_outside_stops_the_agent_in_one_line():
    agent = subprocess.Popen(AGENT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        said = ""
        while "dialing 127.0.0.1:1" not in said:  # rank 0 says so once every rank has built its shard
            line = agent.stdout.readline()
            assert line, f"the agent ended before its ranks met: {said}"
            said += line
        ranks = started(agent.pid)
        assert len(ranks) == 2, ranks
        victim = ranks[-1]
        os.kill(victim, signal.SIGKILL)
        code = agent.wait(30)
        output = agent.stdout.read()
        assert code == 1 and "Traceback" not in output and "Terminating process" not in output, output[-3000:]
        assert "of agent big was killed by SIGKILL" in output and "start it again" in output, output
        # QA: rank 0, stopped by the launch, first said "fedpar client: interrupted after 0 tasks, ..." (nobody was)
        assert [line for line in output.splitlines() if line.startswith("fedpar client:")] == [
            "fedpar client: rank 1 of agent big was killed by SIGKILL (out of memory, or stopped from outside), "
            "which stops the agent; start it again"], output
        end = time.monotonic() + 1  # the same 1 s bound as before, but no longer than the ranks take to go
        while [r for r in ranks if Path(f"/proc/{r}").exists()] and time.monotonic() < end:
            time.sleep(0.05)
        assert not [r for r in ranks if Path(f"/proc/{r}").exists()], "a rank outlived its agent"
    finally:
        if agent.poll() is None:
            agent.kill()


def test_under_torchrun_each_failed_rank_says_one_line(tmp_path):
    """torchrun's ranks printed their own tracebacks (torchrun's ChildFailedError summary after them is its own)."""
    (tmp_path / "fixed_batch.py").write_text(FIXED_BATCH_TASK)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "fedpar", *AGENT[3:AGENT.index("--nproc")], "--fsdp", "2", "--give-up-after", "5",
                           "--task", f"{tmp_path / 'fixed_batch.py'}:task"], capture_output=True, text=True,
                          timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "engine_trainer.py" not in output, output[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} of agent big failed: RuntimeError: shape '[16, 64]' is invalid" in output, output


def test_ctrl_c_in_the_terminal_of_a_torchrun_agent_is_said_once():
    """Ctrl-C reaches every rank of the terminal's process group: each rank said 'interrupted'."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "fedpar",
              *AGENT[3:AGENT.index("--nproc")], "--fsdp", "2"]
    agent = subprocess.Popen(launch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)  # its own process group, as a terminal's foreground job
    try:
        said = ""
        while "dialing 127.0.0.1:1" not in said:
            line = agent.stdout.readline()
            assert line, f"the agent ended before its ranks met: {said}"
            said += line
        os.killpg(agent.pid, signal.SIGINT)
        agent.wait(30)
        output = said + agent.stdout.read()
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    assert output.count("fedpar client: interrupted") == 1, output[-3000:]

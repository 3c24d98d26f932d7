"""torchrun's variables set by hand (left in a shell after a torchrun session, or half-set in a job script) for a
large-model agent or a population host: one line saying what to do and exit 2, never init_distributed's traceback
(QA: 'RuntimeError: WORLD_SIZE is set but RANK...' and a DistStoreError after --dist-timeout, both as tracebacks)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support.ports import free_port
from support.in_process import run_main

AGENT = ["client", "--agent-id", "a", "--server", "127.0.0.1:1", "--insecure", "--device", "cpu",
         "--give-up-after", "3", "--dist-timeout", "3"]
HOST = ["simulate-workers", "--server", "127.0.0.1:1", "--insecure", "--clients", "4", "--give-up-after", "3"]


def _start_process(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """``fedpar COMMAND`` as a process under ``env`` (over a clean copy of this one's torchrun variables), its output
    (stdout and stderr) in one pipe. For a rank that ends its process itself (parallel.init.exit_rank_process)."""
    base = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.Popen([sys.executable, "-m", "fedpar", *command], env={**base, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _run(command: list[str], env: dict[str, str], capfd) -> tuple[int, str]:
    """``fedpar COMMAND`` under ``env`` (over a clean copy of this one's torchrun variables): exit code, output. Its
    main runs in this process (support.in_process.run_main: the refusals come as the command reads its launch
    environment, before any rank or connection; the ranks it spawns are processes, their output captured too)."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
            mp.delenv(name, raising=False)
        for name, value in env.items():
            mp.setenv(name, value)
        done = run_main(command, capfd)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("command", [AGENT, HOST], ids=["client", "simulate-workers"])
@pytest.mark.parametrize("env, said", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set in the environment but RANK, MASTER_ADDR, MASTER_PORT are not"),
    ({"WORLD_SIZE": "two", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     "must be whole numbers"),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "make no group"),
])
def test_torchrun_variables_that_make_no_group_are_one_line(command, env, said, capfd):
    code, output = _run(command, env, capfd)
    assert code == 2 and said in output and "Traceback" not in output, output[-3000:]
    assert "unset WORLD_SIZE" in output and f"'fedpar {command[0]}' with torchrun" in output, output


@pytest.fixture(scope="module")
def alone() -> dict[str, tuple[int, str]]:
    """Rank 0 and rank 1 of a 2-rank agent, each a process of its own, side by side, each told another free
    MASTER_PORT (so neither ever meets a peer): each one's exit code and output, by rank."""
    ports = {free_port()}
    while len(ports) < 2:  # two ports, or the two would meet
        ports.add(free_port())
    never_met = [*AGENT, "--dist-timeout", "1"]  # no peer ever comes: how long each waits is not the claim
    procs = {rank: _start_process(never_met, {"WORLD_SIZE": "2", "RANK": rank, "MASTER_ADDR": "127.0.0.1",
                                          "MASTER_PORT": str(port)}) for rank, port in zip(("0", "1"), ports)}
    try:
        return {rank: (proc.wait(90), proc.communicate()[0]) for rank, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()


@pytest.mark.parametrize("rank", ["0", "1"])
def test_an_agent_rank_whose_peers_never_come_says_so_in_one_line(rank, alone):
    code, output = alone[rank]
    assert code == 2 and "Traceback" not in output, output[-3000:]
    assert f"rank {rank} of 2: the other ranks did not all meet at 127.0.0.1:" in output, output


def test_nproc_that_contradicts_torchrun_s_world_size_is_refused(capfd):
    env = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    code, output = _run([*AGENT, "--nproc", "4"], env, capfd)
    assert code == 2 and "--nproc 4 but torchrun's WORLD_SIZE is 2" in output and "Traceback" not in output, output


@pytest.mark.parametrize("degrees, ranks", [(["--fsdp", "2"], 2), (["--fsdp", "2", "--tp", "2"], 4)])
def test_degrees_without_nproc_say_how_many_ranks_to_ask_for(degrees, ranks, capfd):
    """It said 'cannot infer --dp-replicate: world size 1 is not divisible by ...; choose degrees whose product
    divides 1' (QA): the way out is --nproc."""
    code, output = _run([*AGENT, *degrees], {}, capfd)
    assert code == 2 and f"an agent of {ranks} ranks, but --nproc is 1; add --nproc {ranks}" in output, output


def test_a_layout_the_model_refuses_is_said_once(capfd):
    """Every rank found that --tp 3 cannot split the mlp's 128 outputs, and each said so: three lines, run together."""
    code, output = _run([*AGENT, "--nproc", "3", "--tp", "3"], {}, capfd)
    assert code == 2 and output.count("--tp 3 cannot split layer net.0") == 1, output[-3000:]

"""Two torchrun nodes of `fedpar simulate-workers` started with different population settings (a typo on one
machine): each host dealt itself members of the population its own settings describe, so some clients had no host
and a coordinator waiting for all of them (--min-available N) waited forever. Now the hosts compare their settings
as they meet, and rank 0 says which differ in one line; both nodes exit non-zero at once."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support.ports import free_port


def _node(rank: int, master: int, options: list[str]) -> subprocess.Popen:
    """Node ``rank`` of a two-node torchrun on 127.0.0.1 (one process each) hosting a population as ``options``
    say, for a coordinator that is not there (the hosts stop before they dial it)."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                             "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(master),
                             "-m", "fedpar", "simulate-workers", "--server", "127.0.0.1:1", "--insecure",
                             "--give-up-after", "5", *options], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@pytest.mark.parametrize("other, said", [
    (["--clients", "20"], "rank 1 was given --clients 20 where rank 0 has --clients 30"),
    (["--clients", "30", "--partition", "dirichlet:0.5"], "rank 1 was given other population settings than rank 0"),
])
def test_hosts_given_different_populations_refuse_in_one_line(other, said):
    master = free_port()
    nodes = [_node(0, master, ["--clients", "30"]), _node(1, master, other)]
    try:
        codes = [node.wait(120) for node in nodes]
        output = nodes[0].stdout.read()
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert all(codes), codes
    lines = [line for line in output.splitlines() if line.startswith("fedpar simulate-workers:")]
    assert len(lines) == 1 and said in lines[0] and "unreachable" not in output, output[-3000:]

"""`fedpar serve` refusing at start-up, before it binds anything or starts a rank: ports the aggregator ranks, the
control API or the metrics endpoint cannot have, --out and --checkpoint-dir with --state, no rounds. Each case is
`fedpar serve` by its main in the test process (support.in_process.run_main: the refusal comes before anything
starts) that must end with one line, exit 2 and no traceback."""

from __future__ import annotations

import socket
from pathlib import Path

from fedpar.security.certs import ensure_certs
from support.devices import RANKS_ON_CPU
from support.in_process import run_main

ROOT = Path(__file__).resolve().parents[2]


def _free_pair() -> int:
    """A port P such that P and P + 1 are free now."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port < 65535:
            with socket.socket() as next_one:
                try:
                    next_one.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue


def test_ports_and_options_serve_cannot_use_are_one_line_and_exit_2(tmp_path, capfd):
    certs = tmp_path / "certs"
    ensure_certs(certs, ["a1"], ["127.0.0.1"], operators=["op"])
    one_shot = _free_pair()
    holder = socket.socket()  # a port another process listens on: rank 1's of the one-shot case
    holder.bind(("127.0.0.1", one_shot + 1))
    holder.listen()
    busy, ranks_on_control = one_shot + 1, _free_pair()
    service = ["serve", "--certs", str(certs)]
    cases = [  # (args, words of the one line)
        ([*service, "--state", str(tmp_path / "rk.db"), "--port", str(ranks_on_control), "--control-port",
          str(ranks_on_control + 1), "--aggregator-ranks", "2", *RANKS_ON_CPU],
         (f"--aggregator-ranks 2 needs ports {ranks_on_control}..{ranks_on_control + 1}",
          f"{ranks_on_control + 1} is --control-port")),
        (["serve", "--insecure", "--port", str(one_shot), "--aggregator-ranks", "2", "--rounds", "1",
          "--out", str(tmp_path / "out"), *RANKS_ON_CPU],
         (f"--aggregator-ranks 2 needs ports {one_shot}..{busy}", f"{busy} is in use by another process")),
        (["serve", "--insecure", "--port", "65535", "--aggregator-ranks", "2", "--rounds", "1", *RANKS_ON_CPU],
         ("--aggregator-ranks 2 needs ports 65535..65536", "ports end at 65535; pick a --port of at most 65534")),
        ([*service, "--state", str(tmp_path / "m.db"), "--port", "0", "--control-port", "0", "--metrics-port",
          str(busy)], (f"port {busy} on 127.0.0.1 is in use", "--metrics-port")),
        ([*service, "--state", str(tmp_path / "c.db"), "--port", "0", "--control-port", "0", "--checkpoint-dir",
          str(tmp_path / "ck"), "--out", str(tmp_path / "o")],
         ("--out and --checkpoint-dir are not used with --state", f"{tmp_path / 'c.db'}.runs/ID/")),
        ([*service, "--state", str(tmp_path / "o.db"), "--port", "0", "--control-port", "0", "--out",
          str(tmp_path / "o")], ("fedpar serve: --out is not used with --state", "drop --out")),
        (["serve", "--insecure", "--port", "0", "--rounds", "0"], ("--rounds: 0 is out of range",)),
    ]
    try:
        results = [run_main(args, capfd, ROOT) for args, _ in cases]
    finally:
        holder.close()
    for (args, words), done in zip(cases, results):
        err = done.stderr
        lines = [line for line in err.splitlines() if line.strip()]
        assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in err, (args, done.returncode, err)
        assert all(word in lines[0] for word in words), (words, lines[0])
        assert "run the same command again" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "ck").exists() and not (tmp_path / "o").exists()


def test_a_failed_runs_reason_is_the_line_a_user_reads_and_a_bug_keeps_its_kind():
    from fedpar.cli.serve_service import RunService
    from fedpar.server.members import TooFewMembers
    from fedpar.task import TaskFailed

    said = [RunService.round_error(None, exc, None) for exc in (
        TooFewMembers("only 1 live agents after 300.0s; need min_available=2"),
        TaskFailed("the task's evaluation raised IndexError: Target 2 is out of bounds.: fix the task (t.py:task)"),
        RuntimeError("internal state went wrong"))]
    assert said == ["only 1 live agents after 300.0s; need min_available=2",
                    "the task's evaluation raised IndexError: Target 2 is out of bounds.: fix the task (t.py:task)",
                    "RuntimeError: internal state went wrong"]  # was 'TooFewMembers: ...', 'TaskFailed: ...'

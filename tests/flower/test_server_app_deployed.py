"""`fedpar serve --flower-app DIR` and two `fedpar client --flower-app DIR` as separate processes over mutual TLS
(`fedpar certs`): the app's ServerApp runs 2 rounds on the coordinator and both agents answer its Messages."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from support.earlier_run import earlier_run, file_digests
from support.in_process import main_here
from support.processes import port_from

pytest.importorskip("flwr")

ROOT = Path(__file__).resolve().parents[2]
APP = Path(__file__).parent / "tiny_app"
FEDPAR = [sys.executable, "-m", "fedpar.cli.main"]


def _serve_and_two_agents(app: Path, serve_args: list[str], listening: str, client_args: list[str]):
    """`fedpar serve --flower-app APP` and two `fedpar client --flower-app APP` agents (alice, bob) until they end:
    (serve, its output, the clients, their outputs)."""
    serve = subprocess.Popen([*FEDPAR, "serve", "--port", "0", "--min-available", "2", "--flower-app", str(app),
                              *serve_args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    clients, lines = [], []
    try:
        port = port_from(serve, lines, listening)
        clients = [subprocess.Popen([*FEDPAR, "client", "--server", f"127.0.0.1:{port}", *client_args,
                                     "--agent-id", agent_id, "--num-partitions", "2", "--partition-index", str(i),
                                     "--flower-app", str(app), "--threads", "1", "--give-up-after", "60"],
                                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                   for i, agent_id in enumerate(["alice", "bob"])]
        outputs = [c.communicate(timeout=120)[0] for c in clients]
        serve_out = "".join(lines) + serve.communicate(timeout=60)[0]
    finally:
        for proc in [serve, *clients]:
            if proc.poll() is None:
                proc.kill()
    return serve, serve_out, clients, outputs


def test_served_server_app_and_two_agents_over_mutual_tls_replacing_every_file_of_the_earlier_run(tmp_path):
    """Two server rounds over mutual TLS (`fedpar certs`' CA), each answered by both agents; the final model is the
    ServerApp's own; the run, having written a round, replaced every file of the earlier run in its --out."""
    certs = tmp_path / "certs"
    made = main_here("certs", "--out", str(certs), "--agents", "alice,bob")
    assert made.returncode == 0, made
    final, out = tmp_path / "final.npz", tmp_path / "run"
    earlier_run(out)
    serve, serve_out, clients, outputs = _serve_and_two_agents(
        APP, ["--certs", str(certs), "--run-config", f'final-path="{final}"', "--out", str(out)],
        "(mutual TLS) for Flower App", ["--certs", str(certs)])
    assert serve.returncode == 0, serve_out
    for client, out_text in zip(clients, outputs):
        # 2 server rounds, each a train and an evaluate message: 4 replies, none refused
        assert client.returncode == 0 and "4 messages, 4 answered (2 evaluate, 2 train), 0 failed" in out_text, \
            out_text
        # the ServerApp's own count of rounds, not "training finished after round 4" (its batches of Messages)
        assert "coordinator says: the Flower ServerApp finished after server round 2 (4 rounds of Messages)" \
            in out_text, out_text
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["flower_round"], r["message_type"], r["reported"]) for r in rows] == \
        [(1, "train", 2), (1, "evaluate", 2), (2, "train", 2), (2, "evaluate", 2)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 4 and summary["flower"]["train_metrics_clientapp"]["2"]["rounds"] == pytest.approx(2)
    from fedpar.server.final_model import load_final_model

    names, arrays = load_final_model(out)
    saved = dict(np.load(final))  # what the ServerApp itself saved from its Result
    for name, array in zip(names, arrays):
        np.testing.assert_array_equal(array, saved[name])
    assert not (out / "labels.png").exists() and not (out / ".earlier-run").exists()  # the earlier run's only
    assert (out / "metrics.csv").read_text().count("\n") == 5  # its header and its four rows, none of the earlier's
    assert f"wrote {out}/metrics.jsonl" in serve_out, serve_out[-3000:]


def test_served_app_under_fedpars_strategy_trains_two_deployed_client_apps(tmp_path):
    """`fedpar serve --flower-app DIR --strategy fedavg`: fedpar's rounds (not the ServerApp's) from the app's
    [tool.fedpar] model, answered by two `fedpar client --flower-app DIR` agents running the app's ClientApp."""
    example = ROOT / "examples" / "flower_app"
    serve, serve_out, clients, outputs = _serve_and_two_agents(
        example, ["--insecure", "--strategy", "fedavg", "--rounds", "2", "--out", str(tmp_path / "run")],
        "(PLAINTEXT (--insecure))", ["--insecure"])
    assert serve.returncode == 0, serve_out
    assert all(client.returncode == 0 for client in clients), outputs
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["round"], r["status"], r["reported"]) for r in rows] == [(1, "ok", 2), (2, "ok", 2)]
    assert rows[1]["train_loss"] < rows[0]["train_loss"]  # the ClientApps trained fedpar's global model
    model = json.loads((tmp_path / "run" / "global.json").read_text())["model"]
    assert model["flower_app"] == str(example)


@pytest.mark.parametrize("command", [["serve", "--insecure", "--port", "0"], ["simulate"]])
def test_rounds_for_a_server_app_that_counts_its_own_is_refused_in_one_line(command, tmp_path, capsys):
    from fedpar.cli.main import main

    code = main([*command, "--flower-app", str(APP), "--rounds", "3", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "--rounds" in err[0] and "--run-config num-server-rounds=N" in err[0] and "--strategy NAME" in err[0]
    assert not (tmp_path / "run").exists()


def test_a_config_files_rounds_for_a_server_app_is_a_note_and_only_what_was_typed_is_refused(tmp_path, capsys):
    # a file's [serve] table is shared by the command's uses: its rounds are for runs fedpar drives (cli/config.py
    # ignored_given); here the refusal names only the typed flag, after one note naming the file's key
    from fedpar.cli.main import main

    config = tmp_path / "serve.toml"
    config.write_text("[serve]\nrounds = 3\n")
    code = main(["serve", "--insecure", "--port", "0", "--config", str(config), "--flower-app", str(APP),
                 "--secure-aggregation", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 2, err
    assert err[0] == f"fedpar serve: note: ignored from {config}: rounds (the Flower App's ServerApp decides its rounds)"
    assert err[1].startswith("fedpar serve: --secure-aggregation: with --flower-app") and "--rounds" not in err[1]


def test_ctrl_c_stops_a_served_server_app_at_once_keeping_its_global_model(tmp_path):
    """serve wrote 'interrupted' and then hung (the ServerApp's thread waited for a round that was cancelled), and
    its global.safetensors held a one-element stand-in, not the app's arrays (QA)."""
    import signal

    out = tmp_path / "run"
    serve = subprocess.Popen([*FEDPAR, "serve", "--insecure", "--port", "0", "--min-available", "2", "--flower-app",
                              str(APP), "--run-config", "num-server-rounds=100000", "--out", str(out)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    clients, lines = [], []
    try:
        port = port_from(serve, lines, "(PLAINTEXT (--insecure))")
        clients = [subprocess.Popen([*FEDPAR, "client", "--server", f"127.0.0.1:{port}", "--insecure", "--agent-id",
                                     agent_id, "--num-partitions", "2", "--partition-index", str(i), "--flower-app",
                                     str(APP), "--threads", "1"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL) for i, agent_id in enumerate(["alice", "bob"])]
        end = time.monotonic() + 60
        while time.monotonic() < end and serve.poll() is None and \
                len((out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []) < 4:
            time.sleep(0.1)
        serve.send_signal(signal.SIGINT)
        serve_out = "".join(lines) + serve.communicate(timeout=10)[0]
    finally:
        for proc in [serve, *clients]:
            if proc.poll() is None:
                proc.kill()
    assert serve.returncode == 130 and "Traceback" not in serve_out, serve_out[-3000:]
    assert serve_out.count("Starting FedAvg strategy") == 1, serve_out[:3000]  # Flower's lines showed twice
    assert json.loads((out / "summary.json").read_text())["interrupted"] is True
    from fedpar.server.final_model import load_final_model

    names, _ = load_final_model(out)
    assert sorted(names) == ["b", "w"]


def test_ctrl_c_stops_serve_while_the_server_apps_strategy_waits_for_more_nodes_keeping_the_earlier_run(tmp_path):
    """The app's FedAvg waits for 2 nodes, 1 agent came: Ctrl-C printed 'interrupted' and serve hung for ever, the
    coordinator's loop waiting to close for the ServerApp's thread, asleep in Flower's own wait (QA). Its --out held
    an earlier run: its files stay as they were and serve says it wrote nothing (QA: its summary.json replaced the
    earlier one, and its rows would have gone on after the earlier run's)."""
    import signal

    out = tmp_path / "run"
    before = earlier_run(out)
    serve = subprocess.Popen([*FEDPAR, "serve", "--insecure", "--port", "0", "--min-available", "1", "--flower-app",
                              str(APP), "--out", str(out)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    agent, lines = None, []
    try:
        port = port_from(serve, lines, "(PLAINTEXT (--insecure)) for Flower App")
        assert (out / ".earlier-run").is_dir()  # set aside while the run has written no round
        agent = subprocess.Popen([*FEDPAR, "client", "--server", f"127.0.0.1:{port}", "--insecure", "--agent-id",
                                  "alice", "--num-partitions", "2", "--partition-index", "0", "--flower-app", str(APP),
                                  "--threads", "1"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while "agent alice joined" not in lines[-1] and serve.poll() is None:
            lines.append(serve.stdout.readline())
        # sent at the join, as the ServerApp's strategy starts its wait for a second node: it was lost in about 1 run
        # of 4 (serve went on, printing nothing) while the main thread waited with no timeout (the kernel handed the
        # signal to another thread: parallel/stopping.wait_awake)
        serve.send_signal(signal.SIGINT)
        serve_out = "".join(lines) + serve.communicate(timeout=10)[0]
    finally:
        for proc in [serve, agent]:
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert serve.returncode == 130 and "Traceback" not in serve_out, serve_out[-3000:]
    # counted in Message exchanges, not fedpar rounds read as the ServerApp's (2 per server round: train, evaluate)
    assert serve_out.strip().splitlines()[-1] == "fedpar serve: interrupted after 0 Message exchanges"
    assert f"wrote nothing to {out}" in serve_out.splitlines(), serve_out[-3000:]
    assert file_digests(out) == before
    assert not (out / ".earlier-run").exists()


def test_deployed_agents_clientapps_see_the_coordinators_run_config(tmp_path):
    """`fedpar serve --flower-app APP --run-config fail-partition=1`, agents with no --run-config: partition 1's
    ClientApp fails its train messages as the coordinator's run config says (an error reply each), partition 0's
    trains (tests/flower/test_run_config_from_coordinator.py)."""
    out = tmp_path / "run"
    serve, serve_out, clients, outputs = _serve_and_two_agents(
        APP, ["--insecure", "--run-config", "fail-partition=1", "--out", str(out)],
        "(PLAINTEXT (--insecure)) for Flower App", ["--insecure"])
    assert serve.returncode == 0 and all(c.returncode == 0 for c in clients), (serve_out, outputs)
    assert "ClientApp train handler failed: RuntimeError: this partition fails on purpose" in outputs[1], outputs[1]
    assert "fails on purpose" not in outputs[0], outputs[0]
    # bob's two error replies are failed messages in its summary, not answers (they counted as answers); a Flower App
    # agent counts Messages by type, not evaluate replies as accepted updates
    assert "agent alice: 4 messages, 4 answered (2 evaluate, 2 train), 0 failed" in outputs[0], outputs[0]
    assert "agent bob: 4 messages, 2 answered (2 evaluate), 2 failed" in outputs[1], outputs[1]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["message_type"], r["error_replies"]) for r in rows] == \
        [("train", 1), ("evaluate", 0), ("train", 1), ("evaluate", 0)], (rows, serve_out)

"""A Flower App run has one run config, the coordinator's: every task carries it (TaskSettings.run_config) and the
agents' ClientApps see it in Context.run_config, as a SuperNode's ClientApp sees the run's config, whatever the
agent's own copy of the app says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from support.processes import port_from

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from fedpar.client.flower_app_member import FlowerAppTrainer  # noqa: E402
from fedpar.protocol.task_settings import TaskSettings  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
APP = Path(__file__).parent / "tiny_app"
FEDPAR = [sys.executable, "-m", "fedpar.cli.main"]
INITIAL = [("w", np.zeros(2, np.float32))]


def test_the_run_config_travels_in_the_task_settings_and_bad_values_are_refused():
    settings = TaskSettings.from_json(TaskSettings(run_config={"lr": 0.5, "steps": 3, "name": "x", "on": True})
                                      .to_json())
    assert settings.run_config == {"lr": 0.5, "steps": 3, "name": "x", "on": True}
    assert "run_config" not in TaskSettings()  # unset: not on the wire
    for bad in ('{"run_config": [1]}', '{"run_config": {"lr": [1]}}', '{"run_config": {"": 1}}'):
        with pytest.raises(ValueError, match="run_config"):
            TaskSettings.from_json(bad)


def test_the_tasks_run_config_replaces_the_apps_own_in_train_and_evaluate():
    seen = []
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        seen.append(("train", dict(context.run_config)))
        arrays = ArrayRecord({k: Array(a.numpy() + 1) for k, a in msg.content["arrays"].items()})
        return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 4})}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        seen.append(("evaluate", dict(context.run_config)))
        return Message(RecordDict({"metrics": MetricRecord({"eval_loss": 1.0, "num-examples": 4})}), reply_to=msg)

    trainer = FlowerAppTrainer(app, {"local-steps": 1, "lr": 0.1}, INITIAL)
    trainer.use_member("client-0000", 0, 1, 4)
    sent = TaskSettings(run_config={"local-steps": 5, "lr": 0.1})
    for settings, expected in ((sent, {"local-steps": 5, "lr": 0.1}), (None, {"local-steps": 1, "lr": 0.1})):
        trainer.set_arrays([a for _, a in INITIAL])
        with trainer.holding_task(1):
            trainer.evaluate(settings)
            trainer.train(1, 4, 0.1, round_id=1, settings=settings)
        assert seen[-2:] == [("evaluate", expected), ("train", expected)]


def test_deployed_agents_clientapps_see_the_coordinators_run_config(tmp_path):
    """`fedpar serve --flower-app APP --run-config fail-partition=1`, agents with no --run-config: partition 1's
    ClientApp fails its train messages as the coordinator's config says (an error reply each), partition 0 trains."""
    out = tmp_path / "run"
    serve = subprocess.Popen([*FEDPAR, "serve", "--port", "0", "--min-available", "2", "--flower-app", str(APP),
                              "--insecure", "--run-config", "fail-partition=1", "--out", str(out)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    clients, lines = [], []
    try:
        port = port_from(serve, lines, "(PLAINTEXT (--insecure)) for Flower App")
        clients = [subprocess.Popen([*FEDPAR, "client", "--server", f"127.0.0.1:{port}", "--insecure",
                                     "--agent-id", agent_id, "--num-partitions", "2", "--partition-index", str(i),
                                     "--flower-app", str(APP), "--threads", "1", "--give-up-after", "60"],
                                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                   for i, agent_id in enumerate(["alice", "bob"])]
        outputs = [c.communicate(timeout=120)[0] for c in clients]
        serve_out = "".join(lines) + serve.communicate(timeout=60)[0]
    finally:
        for proc in [serve, *clients]:
            if proc.poll() is None:
                proc.kill()
    assert all(c.returncode == 0 for c in clients), outputs
    assert "ClientApp train handler failed: RuntimeError: this partition fails on purpose" in outputs[1], outputs[1]
    assert "fails on purpose" not in outputs[0], outputs[0]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["message_type"], r["error_replies"]) for r in rows] == \
        [("train", 1), ("evaluate", 0), ("train", 1), ("evaluate", 0)], (rows, serve_out)

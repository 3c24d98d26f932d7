"""A Flower App run has one run config, the coordinator's: every task carries it (TaskSettings.run_config) and the
agents' ClientApps see it in Context.run_config, as a SuperNode's ClientApp sees the run's config, whatever the
agent's own copy of the app says (deployed: tests/flower/test_server_app_deployed.py)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from fedpar.client.flower_app_member import FlowerAppTrainer  # noqa: E402
from fedpar.protocol.task_settings import TaskSettings  # noqa: E402

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

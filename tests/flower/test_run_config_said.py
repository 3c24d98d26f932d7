"""An agent's ClientApp sees the coordinator's run config; where this agent's copy differs (the app's defaults here,
even with no --run-config of its own), the line says whose each value is, once a process."""

from __future__ import annotations

import logging

from fedpar.client import flower_app_member
from fedpar.client.flower_app_member import runs_config


def test_the_coordinators_run_config_wins_and_the_difference_is_said_once_without_blaming_an_own_run_config(caplog,
                                                                                                         monkeypatch):
    monkeypatch.setattr(flower_app_member, "_SAID_DIFFERENT", set())
    own, sent = {"lr": 0.1, "local-steps": 3}, {"lr": 0.5, "local-steps": 3}
    with caplog.at_level(logging.INFO, logger=flower_app_member.log.name):
        assert runs_config(own, None) is own  # a coordinator that serves no app: the agent's own
        assert runs_config(own, sent) == sent and runs_config(own, dict(sent)) == sent
    said = [r.getMessage() for r in caplog.records if "run config" in r.getMessage()]
    assert len(said) == 1, said
    assert "copy of the app's [tool.flwr.app.config] with its own --run-config, if any) in lr (lr: 0.5, here 0.1)" \
        in said[0], said

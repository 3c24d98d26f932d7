"""TaskSettings: the one typed form of a task's extra_json, checked on both ends; agents refuse what they do not know."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from torch import nn

from fedpar.aggregation import build_strategy
from fedpar.aggregation.compression import CompressionConfig
from fedpar.client.agent import Agent, AgentConfig
from fedpar.client.trainer import LocalTrainer
from fedpar.datasets import ArrayDataset
from fedpar.protocol import fedpar_pb2 as pb
from fedpar.protocol.codec import ModelLayout
from fedpar.protocol.task_settings import TaskSettings
from fedpar.server.round_modes import CompressedRound, PlainRound


def test_round_trip_sends_only_what_is_set_and_reads_as_that_mapping():
    assert TaskSettings().to_json() == "{}" and TaskSettings() == {}
    settings = TaskSettings(compression="topk", topk_ratio=0.05, proximal_mu=0.1, dp_clip_norm=2, dp_local_noise=0)
    assert json.loads(settings.to_json()) == {"compression": "topk", "topk_ratio": 0.05, "proximal_mu": 0.1,
                                              "dp_clip_norm": 2.0, "dp_local_noise": 0.0}
    assert TaskSettings.from_json(settings.to_json()) == settings == dict(settings)
    assert settings["dp_clip_norm"] == 2.0 and "int8_block" not in settings and "secure_aggregation" not in settings
    assert TaskSettings.from_json('{"secure_aggregation": true}').secure_aggregation is True
    assert TaskSettings(evaluate=False).to_json() == '{"evaluate": false}' and TaskSettings().evaluate is True
    flower = TaskSettings(fit_config={"epochs": 2, "lr": 0.1, "tag": "x", "warm": True})  # a Flower strategy's
    assert TaskSettings.from_json(flower.to_json()).fit_config == {"epochs": 2, "lr": 0.1, "tag": "x", "warm": True}


@pytest.mark.parametrize("text, words", [
    ('{"mystery": 1}', "unknown 'mystery'"),
    ('{"compression": "zstd"}', "compression method must be one of"),
    ('{"compression": "topk", "topk_ratio": 0}', "topk_ratio must be in (0, 1]"),
    ('{"compression": "int8", "int8_block": 1.5}', "int8_block must be a whole number"),
    ('{"topk_ratio": 0.1}', "topk_ratio goes with compression 'topk'"),
    ('{"proximal_mu": -1}', "proximal_mu must be >= 0"),
    ('{"proximal_mu": true}', "proximal_mu must be a number"),
    ('{"dp_clip_norm": "0.5"}', "dp_clip_norm must be a number"),
    ('{"dp_local_noise": 0.5}', "dp_local_noise needs dp_clip_norm"),
    ('{"dp_clip_norm": 1, "dp_local_noise": -1}', "dp_clip_norm > 0 and dp_local_noise >= 0"),
    ('{"secure_aggregation": 1}', "secure_aggregation must be true or false"),
    ('{"evaluate": "no"}', "evaluate must be true or false"),
    ('{"secure_aggregation": true, "compression": "fp16"}', "neither compression nor client-side DP"),
    ('{"secure_aggregation": true, "dp_clip_norm": 1, "dp_local_noise": 0.5}', "client-side DP's local noise"),
    ('{"fit_config": [1]}', "fit_config must be an object"),
    ('{"fit_config": {"a": [1]}}', "fit_config 'a' must be a bool, int, finite float or str"),
    ('[1, 2]', "must be a JSON object"),
    ('{"proximal_mu": ', "not valid JSON"),
])
def test_bad_settings_are_refused_in_one_line_naming_the_setting(text, words):
    with pytest.raises(ValueError) as err:
        TaskSettings.from_json(text)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_coordinator_side_builds_settings_from_strategy_and_round_mode():
    layout = ModelLayout.of_arrays(["w"], [np.zeros(8, np.float32)])
    strategy = build_strategy("dp-fedprox", proximal_mu=0.1, noise_multiplier=0.5, clip_norm=1.0, population=4,
                              clients_per_round=2, mode="client")
    base = strategy.client_config(1)
    assert PlainRound(layout, strategy, None).task_settings(base) == {"proximal_mu": 0.1, "dp_clip_norm": 1.0,
                                                                    "dp_local_noise": 0.0}
    int8 = CompressedRound(layout, CompressionConfig("int8", int8_block=64), strategy, None).task_settings(base)
    assert (int8.compression, int8.int8_block, int8.proximal_mu) == ("int8", 64, 0.1)
    with pytest.raises(ValueError, match="proximal_mu must be >= 0"):
        replace(base, proximal_mu=-0.5)  # validated where it is built, too


def test_an_agent_refuses_a_task_whose_settings_it_does_not_know_before_training():
    rng = np.random.default_rng(0)
    data = ArrayDataset(rng.standard_normal((20, 4)).astype(np.float32), rng.integers(0, 3, 20))
    agent = Agent(AgentConfig(insecure=True, server="127.0.0.1:1", agent_id="a"), LocalTrainer(nn.Linear(4, 3), data))
    try:
        task = pb.TrainTask(round=1, task_id="t", deadline_seconds=5.0, extra_json='{"compression": "fp16", "x": 1}')
        assert agent.run_task(agent.seats[0], 0, task) is True  # the task is done with: no download, no training, no upload
    finally:
        agent.close()
    assert agent.stats.refused == 1 and agent.stats.accepted == 0
    assert agent.stats.refusals[0].startswith("task settings: the task asks for settings this agent cannot do: "
                                              "unknown 'x'")


def test_secure_aggregation_goes_with_client_side_clipping_without_local_noise():
    settings = TaskSettings.from_json('{"secure_aggregation": true, "dp_clip_norm": 1.5, "dp_local_noise": 0}')
    assert settings.secure_aggregation and settings.dp_clip_norm == 1.5

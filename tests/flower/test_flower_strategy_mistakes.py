"""A Flower strategy (``--strategy flower:path/file.py:Class``, legacy or Message API) whose own code raises or
answers what fedpar cannot use stops ``fedpar simulate`` (a real coordinator and worker processes over loopback
gRPC) in one line naming the method and the strategy, with no traceback and no final model written from its
answer."""

from __future__ import annotations

import textwrap

import pytest

from support.in_process import run_main

pytest.importorskip("flwr")

STRATEGIES = textwrap.dedent("""
    import numpy as np
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import FedAvg


    class Raises(FedAvg):
        def aggregate_fit(self, server_round, results, failures):
            raise RuntimeError("boom in aggregate")


    class ReturnsNone(FedAvg):
        def aggregate_fit(self, server_round, results, failures):
            return None


    class ReturnsNaN(FedAvg):
        def aggregate_fit(self, server_round, results, failures):
            parameters, metrics = super().aggregate_fit(server_round, results, failures)
            arrays = parameters_to_ndarrays(parameters)
            arrays[1][:] = np.nan
            return ndarrays_to_parameters(arrays), metrics


    class OddConfig(FedAvg):
        def configure_fit(self, server_round, parameters, client_manager):
            return [("cohort", {"lr": 1})]


    from flwr.app import Array, ArrayRecord
    from flwr.serverapp.strategy import FedAvg as MessageFedAvg


    class MessageNaN(MessageFedAvg):
        def aggregate_train(self, server_round, replies):
            arrays, metrics = super().aggregate_train(server_round, replies)
            return ArrayRecord({k: Array(np.full(v.shape, np.nan, np.float32)) for k, v in arrays.items()}), metrics


    class MessageConfigRaises(MessageFedAvg):
        def configure_train(self, server_round, arrays, config, grid):
            raise RuntimeError("boom in configure")


    class MessageListConfig(MessageFedAvg):
        def configure_evaluate(self, server_round, arrays, config, grid):
            config["sizes"] = [1, 2]
            return super().configure_evaluate(server_round, arrays, config, grid)
""")


@pytest.mark.parametrize("cls, said", [
    ("Raises", "round 1: {ref}'s aggregation raised RuntimeError: boom in aggregate: fix the strategy"),
    ("ReturnsNone", "round 1: {ref}'s aggregate_fit returned None, not a (Parameters or None, dict of metrics) "
                    "pair: fix the strategy"),
    ("ReturnsNaN", "round 1: {ref}'s aggregate_fit returned NaN or Inf in array 1, which cannot be the global "
                   "model: fix the strategy"),
    ("OddConfig", "round 1: {ref}'s configure_fit returned a list of 1 tuple, not a list of (ClientProxy, FitIns) "
                  "pairs: fix the strategy"),
    ("MessageNaN", "round 1: {ref}'s aggregation returned NaN or Inf in array 0, which cannot be the global model: "
                   "fix the strategy"),
    ("MessageConfigRaises", "round 1: {ref}'s configure_train raised RuntimeError: boom in configure: fix the "
                            "strategy"),
    ("MessageListConfig", "round 1: {ref}'s configure_evaluate config 'sizes' is a list; fedpar sends bool, int, float "
                          "and str values to its members: fix the strategy"),
])
def test_a_flower_strategy_that_fails_stops_simulate_in_one_line(tmp_path, cls, said, capfd, monkeypatch):
    """Each printed 'coordinator stopped with an error' and a traceback (ReturnsNone: 'cannot unpack non-iterable
    NoneType'); ReturnsNaN failed every round and ended 'too few updates arrived; check --min-reports, --deadline'."""
    (tmp_path / "mine.py").write_text(STRATEGIES)
    ref = f"flower:{tmp_path / 'mine.py'}:{cls}"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the workers' (simulate's main runs in this process)
    done = run_main(["simulate", "--strategy", ref, "--clients", "2", "--rounds", "2", "--workers", "1", "--quiet",
                     "--out", str(tmp_path / "out")], capfd)
    lines = [line for line in done.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines and lines[-1].startswith(f"fedpar simulate: {said.format(ref=ref)}"), done.stderr[-3000:]
    assert "stopped with an error" not in done.stderr and "unusable model" not in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "out" / "global.safetensors").exists()

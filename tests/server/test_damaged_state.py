"""Every malformed state.json entry, and a round directory that is a link, is refused at start-up: one clear error
naming the file (exit 2 from `fedpar serve`), never a traceback from deep in the restore."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedpar.aggregation import build_strategy
from fedpar.datasets import load_dataset
from fedpar.models import get_weights, weight_specs
from fedpar.models.for_data import build_model_for_data
from fedpar.protocol.run_logs import RunningSummary
from fedpar.server.checkpoint import Checkpoint, CheckpointError, save_checkpoint
from fedpar.server.config import CoordinatorConfig
from fedpar.server.coordinator import Coordinator
from fedpar.server.members import CohortSampler


def _digits_mlp():
    """The model `fedpar serve` builds by default (mlp on digits, seed 0): its names and weights."""
    splits = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model_for_data("mlp", splits.input_shape, splits.num_classes)
    return [n for n, _, _ in weight_specs(model)], get_weights(model)


def _save(root: Path, **state_overrides) -> Path:
    names, arrays = _digits_mlp()
    state = {"sampler": CohortSampler(0).state(), "strategy": build_strategy("fedavg").state_dict()[1],
             "example_caps": {"a": 7}, "metrics_row": ROW, "metrics_summary": _summary(), **state_overrides}
    state = {k: v for k, v in state.items() if v is not None}  # None: an entry older checkpoints lack
    return save_checkpoint(root, Checkpoint(1, names, arrays, {}, state))


def _coordinator(root: Path) -> Coordinator:
    names, arrays = _digits_mlp()
    coordinator = Coordinator(CoordinatorConfig(checkpoint_dir=root), names, arrays, build_strategy("fedavg"))
    coordinator.restore()  # what the server does once its port answers health checks
    coordinator.taking_calls()  # ... and as the agents' calls come to it: the run's example caps start
    return coordinator


ROW = {"round": 1, "status": "ok", "round_seconds": 2.0, "upload_bytes": 10, "wall_seconds": 3.0}


def _summary() -> dict:
    summary = RunningSummary()
    summary.add(ROW)
    return summary.state()


def test_a_good_checkpoint_resumes(tmp_path):
    _save(tmp_path)
    coordinator = _coordinator(tmp_path)
    assert coordinator.round_id == 1 and coordinator.metrics.summary.result()["mean_round_seconds"] == 2.0
    assert coordinator.registry.join("a", 50, {}).num_examples == 7


def test_a_checkpoint_from_before_summaries_and_caps_resumes(tmp_path):
    _save(tmp_path, agents=[{"agent_id": "a", "num_examples": 7, "capabilities": {}}], example_caps=None,
          metrics_summary=None)
    coordinator = _coordinator(tmp_path)  # the summary is counted from the row it has (no metrics file here)
    assert coordinator.round_id == 1 and coordinator.metrics.summary.result()["rounds"] == 1
    assert coordinator.registry.join("a", 50, {}).num_examples == 7


BAD_ENTRIES = {
    "sampler_state_not_a_mapping": {"sampler": {"bit_generator": "PCG64", "state": "x", "has_uint32": 0,
                                                "uinteger": 0}},
    "sampler_not_an_object": {"sampler": [1, 2]},
    "strategy_not_an_object": {"strategy": 7},
    "strategy_round_not_a_number": {"strategy": {"strategy": "fedavg", "round": "soon"}},
    "agents_not_a_list": {"agents": {"a": 1}},
    "agent_entry_garbage": {"agents": [["a", 7]]},
    "metrics_row_not_an_object": {"metrics_row": "ok"},
    "example_caps_not_an_object": {"example_caps": [["a", 7]]},
    "example_cap_garbage": {"example_caps": {"a": "seven"}},
    "metrics_summary_not_an_object": {"metrics_summary": 3},
    "metrics_summary_garbage": {"metrics_summary": {"rounds": "many"}},
}


@pytest.mark.parametrize("name", BAD_ENTRIES)
def test_each_malformed_state_entry_is_refused_naming_the_file(tmp_path, name):
    bad = BAD_ENTRIES[name]
    directory = _save(tmp_path, **bad, **({"example_caps": None} if "agents" in bad else {}))
    with pytest.raises(CheckpointError) as err:
        _coordinator(tmp_path)
    message = str(err.value)
    assert str(directory / "state.json") in message and "damaged checkpoint" in message
    entry = next(iter(BAD_ENTRIES[name]))
    assert repr(entry) in message


def test_a_checkpoint_of_another_strategy_is_said_so_not_called_damaged(tmp_path):
    _save(tmp_path, strategy={"strategy": "krum"})
    with pytest.raises(CheckpointError) as err:
        _coordinator(tmp_path)
    assert "was made with strategy 'krum', not 'fedavg'; resume with the --strategy (and --privacy) it was made " \
        "with" in str(err.value) and "damaged" not in str(err.value)


def test_a_round_directory_that_links_outside_is_refused(tmp_path):
    root, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    real = _save(elsewhere)
    root.mkdir()
    (root / real.name).symlink_to(real, target_is_directory=True)
    (root / "LATEST").write_text(real.name)
    with pytest.raises(CheckpointError, match="is a link to .*outside"):
        _coordinator(root)


def test_serve_refuses_a_damaged_checkpoint_in_one_line_with_exit_2(tmp_path, capsys):
    from fedpar.cli.main import main

    directory = _save(tmp_path, **BAD_ENTRIES["sampler_state_not_a_mapping"])
    # `fedpar serve` in this process (the exit code is what main returns): the refusal comes at start-up
    code = main(["serve", "--insecure", "--port", "0", "--checkpoint-dir", str(tmp_path), "--out",
                 str(tmp_path / "out")])
    stderr = capsys.readouterr().err
    assert code == 2
    errors = [line for line in stderr.splitlines() if line.startswith("fedpar serve:")]
    assert len(errors) == 1 and str(directory / "state.json") in errors[0] and "'sampler'" in errors[0]
    assert "Traceback" not in stderr

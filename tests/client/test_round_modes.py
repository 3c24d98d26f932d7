"""The agent's round modes: what each sends, and what a refusal undoes."""

from __future__ import annotations

import numpy as np
import pytest

from fedpar.client.compressed import UpdateCompressor
from fedpar.client.local_loop import TrainResult
from fedpar.client.trainer_protocol import UpdateRefused
from fedpar.client.transfer import CompressedUpload, PlainUpload
from fedpar.protocol.codec import ModelLayout
from fedpar.protocol.task_settings import TaskSettings

GLOBAL = [np.zeros(100, np.float32)]
LAYOUT = ModelLayout.of_arrays(["w"], GLOBAL)
RESULT = TrainResult(1, 10, 0.5, False, 0.1)
ENDS_AT = float("inf")  # when an upload must be over: the stand-in transport takes no time


def _mode(cls, settings, accept: bool, **extra):
    sent = []

    def send(prepared, result, metrics, ends_at):
        sent.append(prepared)
        return accept
    return cls(settings, LAYOUT, send, **extra), sent


def test_plain_sends_the_clipped_new_weights():
    mode, sent = _mode(PlainUpload, TaskSettings(dp_clip_norm=1.0), accept=True)
    assert mode.begin() and mode.upload([np.full(100, 1.0, np.float32)], GLOBAL, RESULT, {}, ENDS_AT)
    assert sent[0].encoding == "" and np.linalg.norm(sent[0].arrays[0]) == np.float32(1.0)


def test_compressed_rolls_back_its_residual_only_for_an_update_sent_and_refused():
    compressor = UpdateCompressor(LAYOUT, seed=0)
    settings = TaskSettings(compression="topk", topk_ratio=0.1)
    trained = [np.linspace(-1, 1, 100).astype(np.float32)]
    mode, sent = _mode(CompressedUpload, settings, accept=True, compressor=compressor)
    assert mode.upload(trained, GLOBAL, RESULT, {}, ENDS_AT) and sent[0].encoding == "topk"
    kept = [r.copy() for r in compressor.compressor.residual("")]

    mode, sent = _mode(CompressedUpload, settings, accept=False, compressor=compressor)
    assert not mode.upload(trained, GLOBAL, RESULT, {}, ENDS_AT) and sent
    assert all(np.array_equal(a, b) for a, b in zip(compressor.compressor.residual(""), kept))  # rolled back

    broken = [np.full(100, np.nan, np.float32)]  # diverged training: refused before the DP step or any encoding
    mode, sent = _mode(CompressedUpload, TaskSettings(compression="topk", topk_ratio=0.1, dp_clip_norm=1.0),
                                 accept=True, compressor=compressor)
    assert mode.upload(trained, GLOBAL, RESULT, {}, ENDS_AT)  # an accepted update: its residual stays
    after = [r.copy() for r in compressor.compressor.residual("")]
    with pytest.raises(UpdateRefused, match="training left NaN or Inf"):  # the runtime tells the coordinator
        mode.upload(broken, GLOBAL, RESULT, {}, ENDS_AT)
    assert len(sent) == 1
    assert all(np.array_equal(a, b) for a, b in zip(compressor.compressor.residual(""), after))


def test_an_update_the_task_s_settings_cannot_send_is_refused_for_the_coordinator_to_hear():
    trained = [np.full(100, 1.0, np.float32)]
    mode, sent = _mode(PlainUpload, TaskSettings(dp_clip_norm=1.0, dp_local_noise=1e308), accept=True)
    with pytest.raises(UpdateRefused, match=r"client DP noise \(dp_local_noise 1e\+308 x dp_clip_norm 1\) made tensor "
                                            "'w' Inf"):
        mode.upload(trained, GLOBAL, RESULT, {}, ENDS_AT)
    compressor = UpdateCompressor(LAYOUT, seed=0)
    mode, sent2 = _mode(CompressedUpload, TaskSettings(compression="int8", int8_block=2 ** 62), accept=True,
                        compressor=compressor)
    with pytest.raises(UpdateRefused, match="preparing the update: "):  # it cannot be encoded: no update will come
        mode.upload(trained, GLOBAL, RESULT, {}, ENDS_AT)
    assert not sent and not sent2

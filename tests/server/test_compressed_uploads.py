"""Compressed uploads over real gRPC: exact layouts, validated content, same model as in-process decoding."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from fedpar.aggregation import fedavg
from fedpar.aggregation.compressed_delta import pack
from fedpar.aggregation.compression import Compressor, encode_update
from fedpar.client.compressed import UpdateCompressor
from fedpar.client.transfer import upload_messages
from fedpar.protocol.codec import ModelLayout
from fedpar.protocol.compressed_wire import CompressionConfig, encoded_specs, header_fields

from support.compression_refs import decode_update

SHAPES = ((100, 100), (100,), (100, 10))  # 11,100 float32 parameters = 44,400 bytes
NAMES = ["fc1.weight", "fc1.bias", "fc2.weight"]
RAW = 4 * 11_100
CONFIGS = {"none": CompressionConfig(), "fp16": CompressionConfig("fp16"), "bf16": CompressionConfig("bf16"),
           "int8": CompressionConfig("int8", int8_block=256), "topk": CompressionConfig("topk", topk_ratio=0.01)}
# Exact bytes of one encoded update of SHAPES.
EXPECTED_BYTES = {
    "none": RAW,
    "fp16": 2 * 11_100,
    "bf16": 2 * 11_100,
    "int8": 11_100 + 4 * (40 + 1 + 4),  # int8 payload + a float32 scale per started block of 256
    "topk": 8 * (100 + 1 + 10),  # k = ceil(0.01 n) per tensor; int32 index + float32 value per entry
}


def _weights(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return [(scale * rng.standard_normal(s)).astype(np.float32) for s in SHAPES]


def _model_specs(weights):
    return ModelLayout.of_arrays(NAMES, weights).specs()


def _send(bot, task, arrays, config, n, specs=None, encoding=None, encoding_json=None, model_specs=None):
    """Upload encoded ``arrays`` with the header fields of ``config`` (each overridable to forge a bad upload)."""
    layout = ModelLayout(specs or encoded_specs(model_specs, config))
    enc, enc_json = header_fields(config)
    messages = upload_messages(bot.auth, task, layout, arrays, n, 1, {}, bot.max_chunk,
                               enc if encoding is None else encoding,
                               enc_json if encoding_json is None else encoding_json)
    return bot.upload(task, None, 0, messages=list(messages))


def _refused(call, *fragments):
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.value.code(), err.value.details())
    for fragment in fragments:
        assert fragment in err.value.details(), err.value.details()


@pytest.mark.parametrize("method", list(CONFIGS))
def test_a_compressed_round_equals_in_process_decoding_and_counts_bytes(start_coordinator, agents, method):
    config = CONFIGS[method]
    init = _weights(0)
    server = start_coordinator(init, names=NAMES, clients_per_round=3, min_available=3, upload_compression=config)
    bots = agents(server.address, ["a", "b", "c"])
    layout = ModelLayout.of_arrays(NAMES, init)
    counts = [10, 25, 65]
    reference = Compressor(config)
    decoded = []
    for i, (bot, n) in enumerate(zip(bots, counts)):
        task = bot.task()
        extra = json.loads(task.extra_json)
        assert extra.get("compression", "none") == method
        global_weights = bot.download(task, layout)
        new = [g + d for g, d in zip(global_weights, _weights(10 + i, scale=0.05))]
        if method == "none":
            assert bot.upload(task, new, n, NAMES).accepted
            decoded.append(new)
            continue
        enc = encode_update(reference, new, global_weights, bot.agent_id)
        assert _send(bot, task, pack(layout.specs(), enc), config, n, model_specs=layout.specs()).accepted
        decoded.append(decode_update(reference, enc, global_weights))
    assert server.wait(30)
    row = server.coordinator.metrics.last
    assert (row["status"], row["reported"], row["rejected"]) == ("ok", 3, 0)
    assert row["upload_bytes"] == 3 * EXPECTED_BYTES[method]
    expected = fedavg(zip(decoded, counts))
    for new, exp in zip(server.coordinator.weights, expected):
        assert new.dtype == np.float32
        np.testing.assert_allclose(new, exp, rtol=1e-6, atol=1e-7)


def test_bytes_per_update_shrink_by_the_expected_factor():
    specs = _model_specs(_weights(0))
    ratios = {m: RAW / ModelLayout(encoded_specs(specs, c)).total_bytes for m, c in CONFIGS.items() if m != "none"}
    assert ratios["fp16"] == ratios["bf16"] == 2.0
    assert ratios["int8"] == pytest.approx(44_400 / 11_280) and 3.9 < ratios["int8"] < 4.0
    assert ratios["topk"] == 50.0


def test_bad_compressed_uploads_are_refused_and_change_nothing(start_coordinator, agents):
    config = CONFIGS["topk"]
    init = _weights(0)
    ids = ["k", "dtype", "range", "dup", "nan", "method", "plain", "knobs", "good"]
    server = start_coordinator(init, names=NAMES, clients_per_round=len(ids), min_available=len(ids),
                               upload_compression=config)
    bots = dict(zip(ids, agents(server.address, ids)))
    tasks = {i: bots[i].task() for i in ids}
    specs = _model_specs(init)
    right = encoded_specs(specs, config)
    delta = _weights(5, scale=0.05)

    def packed():
        comp = Compressor(config)
        return pack(specs, encode_update(comp, [g + d for g, d in zip(init, delta)], init))

    # Header refusals (nothing read yet; the agent may still send a good update this round).
    wrong_k = [(n, d, (s[0] + 1,)) if n == "fc1.weight.idx" or n == "fc1.weight.val" else (n, d, s) for n, d, s in right]
    arrays = packed()
    arrays[0], arrays[1] = np.append(arrays[0], 7).astype(np.int32), np.append(arrays[1], 1.0).astype(np.float32)
    _refused(lambda: _send(bots["k"], tasks["k"], arrays, config, 10, specs=wrong_k),
             "does not match the topk encoding", "'fc1.weight.idx'", "int32[100]")
    wrong_dtype = [(n, "int64" if n.endswith(".idx") else d, s) for n, d, s in right]
    arrays = [a.astype(np.int64) if a.dtype == np.int32 else a for a in packed()]
    _refused(lambda: _send(bots["dtype"], tasks["dtype"], arrays, config, 10, specs=wrong_dtype), "int32")
    _refused(lambda: _send(bots["method"], tasks["method"], packed(), config, 10, model_specs=specs, encoding="int8"),
             "this run takes topk-compressed updates", "'int8'")
    _refused(lambda: bots["plain"].upload(tasks["plain"], [g + d for g, d in zip(init, delta)], 10, NAMES),
             "this run takes topk-compressed updates", "'none'")
    _refused(lambda: _send(bots["knobs"], tasks["knobs"], packed(), config, 10, model_specs=specs,
                           encoding_json='{"topk_ratio": 0.5}'), "does not match this run's topk settings")

    # Content refusals, found once the data is in: final for this round.
    arrays = packed()
    arrays[0][-1] = 10_000  # fc1.weight has 10,000 entries: index 10,000 is out of range
    _refused(lambda: _send(bots["range"], tasks["range"], arrays, config, 10, model_specs=specs),
             "'fc1.weight'", "indices must lie in [0, 10000)")
    arrays = packed()
    arrays[4][1] = arrays[4][0]  # fc2.weight: the same index twice
    _refused(lambda: _send(bots["dup"], tasks["dup"], arrays, config, 10, model_specs=specs),
             "'fc2.weight'", "unique")
    arrays = packed()
    arrays[3][0] = np.nan
    _refused(lambda: _send(bots["nan"], tasks["nan"], arrays, config, 10, model_specs=specs), "NaN")

    assert all(a.tobytes() == b.tobytes() for a, b in zip(server.coordinator.weights, init))
    # Agents refused at the header may send a correct update; then the round holds only valid updates.
    good = {}
    for i, who in enumerate(["good", "k", "dtype", "method", "plain", "knobs"]):
        comp = Compressor(config)
        enc = encode_update(comp, [g + d for g, d in zip(init, _weights(20 + i, 0.05))], init)
        assert _send(bots[who], tasks[who], pack(specs, enc), config, 10 + i, model_specs=specs).accepted
        good[who] = (decode_update(comp, enc, init), 10 + i)
    assert server.wait(30)
    row = server.coordinator.metrics.last
    assert (row["reported"], row["rejected"], row["upload_bytes"]) == (6, 3, 6 * EXPECTED_BYTES["topk"])
    for new, exp in zip(server.coordinator.weights, fedavg(good.values())):
        np.testing.assert_allclose(new, exp, rtol=1e-6, atol=1e-7)


def test_bad_int8_and_bf16_content_and_unconfigured_encodings_are_refused(start_coordinator, agents):
    init = _weights(0)
    specs = _model_specs(init)
    new = [g + d for g, d in zip(init, _weights(3, 0.05))]

    int8 = CONFIGS["int8"]
    server = start_coordinator(init, names=NAMES, clients_per_round=3, min_available=3, upload_compression=int8)
    bots = agents(server.address, ["neg", "q", "inf"])
    tasks = [b.task() for b in bots]
    arrays = pack(specs, encode_update(Compressor(int8), new, init))
    arrays[1][0] = -1.0  # fc1.weight.scale
    _refused(lambda: _send(bots[0], tasks[0], arrays, int8, 10, model_specs=specs), "scales must be finite and >= 0")
    arrays = pack(specs, encode_update(Compressor(int8), new, init))
    arrays[2][3] = -128
    _refused(lambda: _send(bots[1], tasks[1], arrays, int8, 10, model_specs=specs), "[-127, 127]")
    arrays = pack(specs, encode_update(Compressor(int8), new, init))
    arrays[3][0] = 3e38  # a finite scale whose decoded delta overflows
    _refused(lambda: _send(bots[2], tasks[2], arrays, int8, 10, model_specs=specs), "'fc1.bias'", "Inf")
    assert server.wait(30)
    assert server.coordinator.metrics.last["status"] == "failed"
    assert all(a.tobytes() == b.tobytes() for a, b in zip(server.coordinator.weights, init))

    bf16 = CONFIGS["bf16"]
    server = start_coordinator(init, names=NAMES, clients_per_round=1, min_available=1, upload_compression=bf16)
    (bot,) = agents(server.address, ["bf"])
    task = bot.task()
    arrays = pack(specs, encode_update(Compressor(bf16), new, init))
    arrays[2][5] = 0x7FC0  # a bfloat16 NaN
    _refused(lambda: _send(bot, task, arrays, bf16, 10, model_specs=specs), "'fc2.weight'", "NaN or Inf")
    assert all(a.tobytes() == b.tobytes() for a, b in zip(server.coordinator.weights, init))

    server = start_coordinator(init, names=NAMES, clients_per_round=1, min_available=1)
    (bot,) = agents(server.address, ["plain"])
    task = bot.task()
    assert "compression" not in json.loads(task.extra_json)
    arrays = pack(specs, encode_update(Compressor(CONFIGS["fp16"]), new, init))
    _refused(lambda: _send(bot, task, arrays, CONFIGS["fp16"], 10, model_specs=specs),
             "this run takes uncompressed updates")
    assert bot.upload(task, new, 10, NAMES).accepted
    assert server.wait(30)


def test_the_agent_side_keeps_its_residual_unless_the_update_is_refused():
    init = _weights(0)
    layout = ModelLayout.of_arrays(NAMES, init)
    side = UpdateCompressor(layout, seed=1)
    extra = {"compression": "topk", "topk_ratio": 0.01}
    new = [g + d for g, d in zip(init, _weights(4, 0.05))]
    first = side.prepare(extra, new, init)
    assert (first.encoding, json.loads(first.encoding_json)) == ("topk", {"topk_ratio": 0.01})
    assert first.layout.total_bytes == EXPECTED_BYTES["topk"]
    kept = side.compressor.residual("")
    side.prepare(extra, new, init)
    side.refused()  # the second update never counted: back to the residual after the first
    assert all(np.array_equal(a, b) for a, b in zip(side.compressor.residual(""), kept))
    broken = [a.copy() for a in new]
    broken[1][0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        side.prepare(extra, broken, init)  # nothing is sent: the residual stays as it was
    plain = side.prepare({}, new, init)
    assert plain.encoding == "" and plain.layout == layout and plain.arrays[0] is new[0]
    side.refused()  # an uncompressed update leaves the top-k residual alone
    assert all(np.array_equal(a, b) for a, b in zip(side.compressor.residual(""), kept))
    with pytest.raises(ValueError, match="cannot do"):
        side.prepare({"compression": "zstd"}, new, init)

"""Tensor codec and tensor files: exact round trips and refusal of hostile headers and streams."""

import json
import struct

import numpy as np
import pytest

from fedpar.protocol.codec import CodecError, ModelLayout, TensorAssembler, iter_chunks
from fedpar.protocol.tensorfile import load_tensors, save_tensors

from support.codec_refs import decode_arrays


def _model(rng):
    return (["a", "b", "empty", "c", "d"],
            [rng.standard_normal((3, 5)).astype(np.float32), rng.integers(0, 9, 7).astype(np.int64),
             np.zeros((0, 4), np.float32), rng.standard_normal(11).astype(np.float16),
             rng.standard_normal((2, 2, 2))])


@pytest.mark.parametrize("chunk_bytes", [1, 3, 7, 16, 64, 10_000])
def test_chunked_round_trip_is_bit_exact_for_any_chunk_size(chunk_bytes):
    names, arrays = _model(np.random.default_rng(0))
    layout = ModelLayout.of_arrays(names, arrays)
    chunks = list(iter_chunks(arrays, chunk_bytes))
    assert all(len(data) <= chunk_bytes for _, data in chunks)
    assert sum(len(d) for _, d in chunks) == layout.total_bytes
    out = decode_arrays(layout, chunks, chunk_bytes)
    for a, b in zip(arrays, out):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


def test_assembler_refuses_out_of_order_oversized_and_overlong_chunks():
    names, arrays = _model(np.random.default_rng(1))
    layout = ModelLayout.of_arrays(names, arrays)
    chunks = list(iter_chunks(arrays, 16))
    asm = TensorAssembler(layout, 16)
    with pytest.raises(CodecError, match="expected byte 0"):
        asm.write(chunks[1][0], chunks[1][1])
    with pytest.raises(CodecError, match="exceeds the limit"):
        asm.write(0, b"x" * 17)
    for offset, data in chunks:
        asm.write(offset, data)
    assert asm.complete
    with pytest.raises(CodecError, match="past the end"):
        asm.write(layout.total_bytes, b"x")
    with pytest.raises(CodecError, match="stream ended"):
        decode_arrays(layout, chunks[:-1], 16)


def test_non_finite_values_are_found_by_name():
    layout = ModelLayout([("w", "float32", (4,)), ("n", "int64", (1,))])
    asm = TensorAssembler(layout, 100)
    asm.write(0, np.array([1, 2, np.inf, 4], np.float32).tobytes() + np.array([5]).tobytes())
    assert asm.first_non_finite() == "w"


@pytest.mark.parametrize("specs, message", [
    ([("x", "object", (1,))], "dtype"),
    ([("x", "float32", (-1,))], "non-negative"),
    ([("x", "float32", (1,)), ("x", "float32", (1,))], "twice"),
    ([("", "float32", (1,))], "name"),
    ([("x", "float32", (1 << 21, 1 << 21))], "absurdly large"),
    ([("x", "float32", (1,) * 9)], "dims"),
])
def test_hostile_headers_are_refused(specs, message):
    with pytest.raises(CodecError, match=message):
        ModelLayout(specs)


def test_layout_size_limit():
    with pytest.raises(CodecError, match="limit"):
        ModelLayout([("x", "float32", (1000,))], max_total_bytes=3999)


def test_mismatch_names_the_first_difference():
    a = ModelLayout([("w", "float32", (2, 3)), ("b", "float32", (3,))])
    assert a.mismatch(a) is None
    assert "'b'" in a.mismatch(ModelLayout([("w", "float32", (2, 3)), ("b", "float64", (3,))]))
    assert "expected 1 tensors" in a.mismatch(ModelLayout([("w", "float32", (2, 3))]))


def test_tensor_file_round_trip_keeps_the_order_and_reads_with_the_safetensors_package(tmp_path):
    from safetensors.numpy import load_file

    names, arrays = _model(np.random.default_rng(2))
    arrays.append(np.arange(4, dtype=">u2"))  # big-endian and uint16 come back little-endian, equal
    names.append("u16")
    path = tmp_path / "m.safetensors"
    save_tensors(path, names, arrays, {"round": "3"})
    got_names, got, meta = load_tensors(path)
    assert got_names == names and meta == {"round": "3"}
    plain = load_file(path)  # any safetensors reader sees the same tensors
    for name, a, b in zip(names, arrays, got):
        assert a.shape == b.shape and a.dtype.newbyteorder("<") == b.dtype and np.array_equal(a, b)
        assert plain[name].tobytes() == b.tobytes()
    assert not list(tmp_path.glob(".*"))  # the temporary file was renamed
    (tmp_path / "other.json").write_text("{}")  # any other output: the umask's mode (the package's file was 0600)
    assert path.stat().st_mode & 0o777 == (tmp_path / "other.json").stat().st_mode & 0o777


def _legacy_file(names, arrays) -> bytes:
    """A file as fedpar wrote them before it used the safetensors package: tensors in the order given."""
    header, offset = {"__metadata__": {"round": "1"}}, 0
    for name, a in zip(names, arrays):
        header[name] = {"dtype": {"float32": "F32", "int64": "I64"}[a.dtype.name], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob + b"".join(a.tobytes() for a in arrays)


def test_files_without_a_saved_order_come_back_in_data_order(tmp_path):
    names, arrays = ["z", "a", "m"], [np.ones(2, np.float32), np.arange(3), np.zeros((2, 2), np.float32)]
    path = tmp_path / "old.safetensors"
    path.write_bytes(_legacy_file(names, arrays))
    got_names, got, meta = load_tensors(path)
    assert got_names == names and meta == {"round": "1"}
    assert all(np.array_equal(a, b) for a, b in zip(arrays, got))


def test_truncated_or_garbled_tensor_files_are_refused(tmp_path):
    path = tmp_path / "m.safetensors"
    save_tensors(path, ["w"], [np.ones(10, np.float32)])
    raw = path.read_bytes()
    for damaged in (raw[:-4], struct.pack("<Q", 1 << 40) + b"{}", struct.pack("<Q", 5) + b"nope!", b""):
        path.write_bytes(damaged)
        with pytest.raises(CodecError, match="truncated or damaged"):
            load_tensors(path)
    path.write_bytes(raw.replace(b'[\\"w\\"]', b'[\\"v\\"]'))
    with pytest.raises(CodecError, match="does not list the file's tensors"):
        load_tensors(path)


def test_wire_bytes_is_the_concatenation_a_chunked_stream_carries():
    from fedpar.protocol.codec import wire_bytes

    arrays = [np.arange(5, dtype=np.float16), np.array([True, False]), np.zeros((0, 3), np.float32),
              np.arange(6, dtype=">f4").reshape(2, 3), np.asarray(3.0)]
    assert wire_bytes(arrays) == b"".join(bytes(d) for _, d in iter_chunks(arrays, 7))

"""The wire codec: arrays round-trip exactly, anything outside the allow-list is refused, nothing unpickles."""

from __future__ import annotations

import pickle
import struct

import msgpack
import numpy as np
import pytest

from tinkerq import types
from tinkerq.errors import MalformedMessageError
from tinkerq.wire import codec, messages


@pytest.mark.parametrize("dtype", ["int64", "int32", "float32", "float64", "float16", "uint8", "bool"])
@pytest.mark.parametrize("shape", [(0,), (5,), (3, 4), (2, 1, 3)])
def test_arrays_round_trip(dtype, shape):
    array = (np.arange(int(np.prod(shape))) % 7).astype(dtype).reshape(shape)
    back = codec.unpackb(codec.packb({"a": array, "nested": [array]}))
    assert back["a"].dtype == array.dtype and back["a"].shape == array.shape
    np.testing.assert_array_equal(back["a"], array)
    np.testing.assert_array_equal(back["nested"][0], array)


def test_non_contiguous_and_big_endian_arrays_encode_as_values():
    a = np.arange(12, dtype=">i8").reshape(3, 4)[:, ::2]
    back = codec.unpackb(codec.packb(a))
    np.testing.assert_array_equal(back, a)
    assert back.dtype == np.dtype("<i8")


@pytest.mark.parametrize("value", [np.array([1 + 2j]), np.array(["a", "b"]), np.array([object()], dtype=object)])
def test_forbidden_dtypes_are_refused_on_encode(value):
    with pytest.raises(MalformedMessageError, match="cannot travel"):
        codec.packb({"x": value})


def test_unknown_python_objects_are_refused():
    with pytest.raises(MalformedMessageError):
        codec.packb({"x": object()})


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (msgpack.packb(msgpack.ExtType(1, b"")), "truncated"),
        (msgpack.packb(msgpack.ExtType(1, struct.pack("<BB", 42, 0))), "dtype code 42"),
        (msgpack.packb(msgpack.ExtType(1, struct.pack("<BBQ", 1, 1, 4) + b"\0" * 8)), "should carry 32 bytes"),
        (msgpack.packb(msgpack.ExtType(1, struct.pack("<BB", 1, 9))), "dimensions"),
        (msgpack.packb(msgpack.ExtType(7, b"x")), "unknown msgpack extension"),
        (b"\xc1", "not valid"),
        (b"\x92\x01", "not valid"),  # truncated array
        (msgpack.packb({1: 2}), "not valid"),  # non-string map keys
        (pickle.dumps({"a": 1}), "not valid"),
    ],
)
def test_malformed_bytes_raise_a_named_error(payload, words):
    with pytest.raises(MalformedMessageError, match=words):
        codec.unpackb(payload)


def test_size_limit():
    data = codec.packb(np.zeros(100, np.float32))
    with pytest.raises(MalformedMessageError, match="exceeds the limit"):
        codec.unpackb(data, max_bytes=100)


def test_decoded_arrays_are_read_only_views():
    back = codec.unpackb(codec.packb(np.arange(4)))
    assert not back.flags.writeable  # callers copy before writing (the worker does)


def test_datums_round_trip_through_messages():
    data = [
        types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                    loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [0.0, 1.0, 0.5]}),
        types.Datum(model_input=types.ModelInput(chunks=[types.EncodedTextChunk([5]), types.EncodedTextChunk([6])]),
                    loss_fn_inputs={"target_tokens": np.array([6, 7]), "weights": np.array([1.0, 1.0])}),
    ]
    body = codec.unpackb(codec.packb(messages.encode_loss_request(data, "cross_entropy", None)))
    back, loss_fn, config = messages.decode_loss_request(body)
    assert loss_fn == "cross_entropy" and config is None
    for a, b in zip(data, back, strict=True):
        assert a.model_input.to_ints() == b.model_input.to_ints()
        assert a.loss_fn_inputs == b.loss_fn_inputs
    assert back[1].loss_fn_inputs["weights"].dtype == "float32"  # coerced by key


def test_tensor_data_matches_tinker():
    td = types.TensorData.from_numpy(np.array([[1.0, 2.0]], dtype=np.float32))
    assert td.dtype == "float32" and td.shape == [1, 2] and td.data == [1.0, 2.0] and td.tolist() == [1.0, 2.0]
    assert types.TensorData(data=[1, 2, 3], dtype="int64").to_numpy().dtype == np.int64
    with pytest.raises(ValueError, match="dtype"):
        types.TensorData([1], dtype="int8")
    m = types.ModelInput.from_ints([1, 2]).append_int(3)
    assert m.to_ints() == [1, 2, 3] and m.length == 3


def test_adam_defaults_are_tinkers():
    a = types.AdamParams()
    assert (a.learning_rate, a.beta1, a.beta2, a.eps, a.weight_decay, a.grad_clip_norm) == (
        1e-4, 0.9, 0.95, 1e-12, 0.0, 0.0)

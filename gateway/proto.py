"""The protobuf payloads the tinker SDK (0.38) exchanges with the gateway, to and from tinkerq types.

Three messages use protobuf (``/work/shared/reference/tinker-http.md`` §6): the ``forward_backward`` request
body, and the ``ForwardBackwardOutput`` / ``SampleResponse`` results served by ``retrieve_future``. The
message classes come from the SDK's generated module ``tinker.proto.tinker_public_pb2`` (Apache-2.0); the
conversions here are our own.

Decoding trusts nothing: every inconsistency in a request is a user error that names the datum and the key.
Semantic checks (loss names, required inputs, shapes against the token count, token ids) are left to
:func:`tinkerq.validation.validate_loss_request`, which runs on the decoded request.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
from google.protobuf.message import DecodeError

from tinkerq import types
from tinkerq.errors import MalformedMessageError, ServerError, ValidationError

_SDK_PB2 = "tinker.proto.tinker_public_pb2"


def _load_public_pb2() -> ModuleType:
    """The SDK's generated protobuf module, without importing the ``tinker`` package.

    ``import tinker`` runs the SDK's ``__init__``, which imports torch whenever torch is installed; the
    gateway must stay light (tests/test_layering.py). The generated file itself needs only protobuf, so it is
    loaded on its own under a private name. Protobuf keeps one class per descriptor, so its message classes
    are the very ones the SDK uses if the SDK is imported later (as the tests do).
    """
    loaded = sys.modules.get(_SDK_PB2)
    if loaded is not None:
        return loaded
    spec = importlib.util.find_spec("tinker")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the gateway needs the tinker SDK's protobuf module: pip install 'tinkerq[gateway]'")
    path = Path(next(iter(spec.submodule_search_locations))) / "proto" / "tinker_public_pb2.py"
    name = "_tinkerq_gateway_tinker_public_pb2"
    file_spec = importlib.util.spec_from_file_location(name, path)
    if file_spec is None or file_spec.loader is None:
        raise ImportError(f"cannot load the tinker SDK's protobuf module from {path}")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[name] = module
    file_spec.loader.exec_module(module)
    return module


if TYPE_CHECKING:
    from tinker.proto import tinker_public_pb2 as pb
else:
    pb = _load_public_pb2()


# Request tensors: proto dtype -> (little-endian wire dtype, the dtype our TensorData holds). TensorData speaks
# int64 and float32 only, so int32 widens and bfloat16 (raw upper halves of float32) becomes float32.
_WIRE_DTYPES: dict[pb.DType.ValueType, tuple[np.dtype, np.dtype]] = {
    pb.DTYPE_FLOAT32: (np.dtype("<f4"), np.dtype(np.float32)),
    pb.DTYPE_INT64: (np.dtype("<i8"), np.dtype(np.int64)),
    pb.DTYPE_INT32: (np.dtype("<i4"), np.dtype(np.int64)),
    pb.DTYPE_BFLOAT16: (np.dtype("<u2"), np.dtype(np.float32)),
}
_INDEX = np.dtype("<i8")  # CSR crow/col indices and BatchedTensor offsets are int64 little-endian
_TOKEN = np.dtype("<i4")  # EncodedTextChunk.tokens and SampledSequence.tokens are int32 little-endian

# A sparse tensor's dense size is set by its declared shape, not by its bytes: cap it so a tiny body cannot
# make us allocate gigabytes (64 Mi cells = 512 MiB of int64, far above any real (N, K) target).
MAX_SPARSE_DENSE_ELEMENTS = 64 * 1024 * 1024

_OTHER_CHUNKS: dict[str | None, str] = {"image": "an image chunk", "dmel": "a dmel (audio) chunk", None: "empty"}

_STOP_REASONS: dict[str, pb.StopReason.ValueType] = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}

# Reductions the SDK understands in a metric key "name:reduction" (tinker/lib/chunked_fwdbwd_helpers.py).
_SDK_REDUCTIONS = frozenset({"mean", "sum", "min", "max", "slack", "hash2", "unique"})


@dataclass
class ForwardBackwardCall:
    """A decoded ``POST /api/v1/forward_backward`` body (also ``forward``: ``forward_only`` is then True)."""

    model_id: str
    seq_id: int
    data: list[types.Datum]
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None
    forward_only: bool


# -- forward_backward request ------------------------------------------------------------------------------

def decode_forward_backward_request(body: bytes) -> ForwardBackwardCall:
    """Decode a ForwardBackwardRequest protobuf; MalformedMessageError / ValidationError (user errors) if bad.

    The Datums are what tinkerq's producer would send for the same data (int64 tokens in one chunk, int64 or
    float32 tensors), so the worker computes the same numbers whichever door the request came in by.
    """
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(bytes(body))
    except DecodeError as exc:
        raise MalformedMessageError(f"body is not a ForwardBackwardRequest protobuf: {exc}") from exc
    if msg.seq_id < 1:
        # proto3 has no "unset": 0 is what an SDK that did not set seq_id sends; ordering needs a real one.
        raise ValidationError(f"seq_id must be >= 1 (the SDK sends its request id + 1), got {msg.seq_id}")
    return ForwardBackwardCall(
        model_id=msg.model_id,
        seq_id=int(msg.seq_id),
        data=[_decode_datum(i, d) for i, d in enumerate(msg.data)],
        loss_fn=msg.loss_fn,
        loss_fn_config=_decode_loss_fn_config(msg),
        forward_only=bool(msg.forward_only),
    )


def _decode_loss_fn_config(msg: pb.ForwardBackwardRequest) -> dict[str, float | str] | None:
    # The SDK writes numbers to both maps and strings only to v2, so v2 wins; the legacy map still counts for
    # a client that only knows it.
    config: dict[str, float | str] = {key: float(value) for key, value in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind == "number":
            config[key] = float(value.number)
        elif kind == "text":
            config[key] = value.text
        else:
            raise MalformedMessageError(f"loss_fn_config_v2[{key!r}] has neither a number nor a text value")
    return config or None


def _decode_datum(i: int, datum: pb.Datum) -> types.Datum:
    # Provenance spans (fields 3 and 4) are accepted and ignored: no loss served here reads them.
    parts: list[np.ndarray] = []
    for j, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            what = _OTHER_CHUNKS.get(kind, f"a {kind} chunk")
            raise ValidationError(f"datum {i}: model_input chunk {j} is {what}; this server serves token input "
                                  f"only (EncodedTextChunk)")
        raw = chunk.encoded_text.tokens
        if len(raw) % _TOKEN.itemsize:
            raise MalformedMessageError(f"datum {i}: model_input chunk {j} has {len(raw)} token bytes, not a "
                                        f"multiple of 4 (int32 tokens)")
        parts.append(np.frombuffer(raw, dtype=_TOKEN))
    # One int64 chunk, exactly as the producer's wire form decodes (ModelInput.to_numpy joins the chunks).
    tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
    inputs = {key: _decode_tensor(i, key, tensor) for key, tensor in datum.loss_fn_inputs.items()}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def _from_wire(where: str, part: str, raw: bytes, wire: np.dtype) -> np.ndarray:
    if len(raw) % wire.itemsize:
        raise MalformedMessageError(f"{where}: {part} has {len(raw)} bytes, not a multiple of {wire.itemsize} "
                                    f"(the size of one {wire.name} value)")
    return np.frombuffer(raw, dtype=wire)


def _to_tensor_dtype(values: np.ndarray, target: np.dtype) -> np.ndarray:
    if values.dtype == np.dtype("<u2"):  # bfloat16 is the upper 16 bits of a float32
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(target)  # a writable copy in native byte order


def _decode_tensor(i: int, key: str, tensor: pb.Tensor) -> types.TensorData:
    where = f"datum {i}: loss_fn_inputs[{key!r}]"
    if tensor.dtype not in _WIRE_DTYPES:
        name = "DTYPE_UNSPECIFIED" if tensor.dtype == pb.DTYPE_UNSPECIFIED else f"unknown dtype {tensor.dtype}"
        raise MalformedMessageError(f"{where} has {name}; expected FLOAT32, INT64, INT32 or BFLOAT16")
    wire, target = _WIRE_DTYPES[tensor.dtype]
    shape = [int(s) for s in tensor.shape]
    if any(s < 0 for s in shape):
        raise MalformedMessageError(f"{where} has a negative dimension in shape {shape}")
    encoding = tensor.WhichOneof("encoding")
    if encoding == "dense":
        values = _from_wire(where, "dense data", tensor.dense, wire)
        if not shape:  # the SDK leaves shape empty only for a TensorData built without one: 1-D
            shape = [values.size]
        if values.size != math.prod(shape):
            raise MalformedMessageError(f"{where} has {values.size} values but its shape {shape} needs "
                                        f"{math.prod(shape)}")
        array = _to_tensor_dtype(values, target).reshape(shape)
    elif encoding == "sparse_csr":
        array = _densify_csr(where, tensor.sparse_csr, shape, wire, target)
    else:
        raise MalformedMessageError(f"{where} has neither dense nor sparse_csr data")
    return types.TensorData.from_numpy(array)


def _densify_csr(where: str, csr: pb.SparseCsr, shape: list[int], wire: np.dtype, target: np.dtype) -> np.ndarray:
    """A CSR tensor as the dense 2-D array it stands for; cells it does not list are 0 (the SDK's pad)."""
    if len(shape) != 2:
        raise MalformedMessageError(f"{where} is sparse_csr with shape {shape}; a CSR tensor has a 2-D shape")
    rows, cols = shape
    if rows * cols > MAX_SPARSE_DENSE_ELEMENTS:
        raise MalformedMessageError(f"{where} is sparse_csr with shape {shape}: {rows * cols} cells, more than "
                                    f"this server densifies ({MAX_SPARSE_DENSE_ELEMENTS})")
    values = _from_wire(where, "sparse_csr values", csr.values, wire)
    crow = _from_wire(where, "sparse_csr crow_indices", csr.crow_indices, _INDEX)
    col = _from_wire(where, "sparse_csr col_indices", csr.col_indices, _INDEX)
    nnz = values.size
    if crow.size != rows + 1:
        raise MalformedMessageError(f"{where}: sparse_csr crow_indices has {crow.size} entries; shape {shape} "
                                    f"needs rows + 1 = {rows + 1}")
    if col.size != nnz:
        raise MalformedMessageError(f"{where}: sparse_csr has {nnz} values but {col.size} col_indices")
    if crow[0] != 0 or crow[-1] != nnz or (np.diff(crow) < 0).any():
        raise MalformedMessageError(f"{where}: sparse_csr crow_indices must rise from 0 to the value count "
                                    f"{nnz} without decreasing, got {crow[:8].tolist()}...")
    if nnz and (col.min() < 0 or col.max() >= cols):
        raise MalformedMessageError(f"{where}: sparse_csr col_indices must be in [0, {cols}), got values from "
                                    f"{int(col.min())} to {int(col.max())}")
    row = np.repeat(np.arange(rows), np.diff(crow))
    if ((row[1:] == row[:-1]) & (col[1:] <= col[:-1])).any():  # a repeated cell would silently overwrite
        raise MalformedMessageError(f"{where}: sparse_csr col_indices must increase strictly within each row")
    dense = np.zeros((rows, cols), dtype=target)
    dense[row, col] = _to_tensor_dtype(values, target)
    return dense


# -- forward_backward result -------------------------------------------------------------------------------

def _metric_key(key: str) -> str:
    """``key`` in the SDK's required ``name:reduction`` form.

    The SDK splits every forward_backward metric key on ":" and unpacks exactly two parts (a ValueError in the
    user's process otherwise), and it silently drops a reduction it does not know. tinkerq's worker already
    emits only well-formed keys with known reductions (loss:sum, ratio:mean, log_ratio:min, log_ratio:max,
    kl_sample_train:mean, clip_fraction:mean, squared_log_ratio:mean), which pass through unchanged. Any other
    key is mapped, so a future worker metric can neither crash the SDK nor vanish:

    * ``name:reduction`` with a known reduction but extra colons in the name: those colons become "/"
      ("a:b:mean" -> "a/b:mean");
    * no colon, or an unknown reduction: the whole key (colons -> "/") gets ``:unique``, the one reduction
      that combines nothing, so no number is averaged or summed under a guessed rule ("tokens" ->
      "tokens:unique", "x:avg" -> "x/avg:unique").
    """
    name, sep, reduction = key.rpartition(":")
    if sep and reduction in _SDK_REDUCTIONS:
        return f"{name.replace(':', '/') or 'metric'}:{reduction}"
    return f"{key.replace(':', '/') or 'metric'}:unique"


_Column = tuple[np.ndarray, "pb.DType.ValueType"]  # one datum's values for one field, and their wire dtype


def _output_array(i: int, name: str, tensor: types.TensorData) -> _Column:
    array = tensor.to_numpy()
    if array.dtype.kind == "f":
        return array.astype("<f4", copy=False), pb.DTYPE_FLOAT32
    if array.dtype.kind in "iub":
        return array.astype("<i8", copy=False), pb.DTYPE_INT64
    raise ServerError(f"forward_backward output {i}[{name!r}] has dtype {array.dtype}, which the SDK cannot read")


def _signature(outputs: dict[str, _Column]) -> tuple[tuple[str, int, tuple[int, ...]], ...]:
    # One BatchedTensor holds one dtype and one trailing shape per field.
    return tuple((name, dt, tuple(arr.shape[1:])) for name, (arr, dt) in sorted(outputs.items()))


def _array_record(rows: list[dict[str, _Column]]) -> pb.ArrayRecord:
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(rows))
    for name, (first, dtype) in rows[0].items():
        arrays = [row[name][0] for row in rows]
        sizes = np.array([a.nbytes for a in arrays], dtype=np.int64)
        field = record.fields[name]
        field.data = b"".join(a.tobytes() for a in arrays)
        field.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(_INDEX).tobytes()  # byte offsets
        field.dtype = dtype
        field.trailing_shape.extend(first.shape[1:])  # empty for 1-D: the SDK reads it as 1-D
    return record


def encode_forward_backward_output(out: types.ForwardBackwardOutput) -> bytes:
    """Our result as the ForwardBackwardOutput protobuf the SDK decodes (response_conv).

    Normally one ArrayRecord with every datum back to back. Datums whose tensors differ in dtype or trailing
    shape start a new record (the SDK concatenates records), so ragged per-datum outputs still encode.
    """
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type)
    mapped: dict[str, float] = {}
    for key, value in out.metrics.items():
        if _metric_key(key) == key:
            msg.metrics[key] = float(value)
        else:
            mapped[_metric_key(key)] = float(value)
    for key, value in mapped.items():
        if key not in msg.metrics:  # a well-formed key wins over one mapped onto the same name
            msg.metrics[key] = value

    rows: list[dict[str, _Column]] = []
    for i, output in enumerate(out.loss_fn_outputs):
        row = {}
        for name, tensor in output.items():
            array, dtype = _output_array(i, name, tensor)
            row[name] = (array.reshape(1) if array.ndim == 0 else array, dtype)
        if rows and set(row) != set(rows[0]):
            # The SDK slices every field by datum index: all datums must carry the same fields.
            raise ServerError(f"forward_backward output {i} has fields {sorted(row)}, output 0 has "
                              f"{sorted(rows[0])}")
        rows.append(row)
    if not rows:
        msg.loss_fn_outputs.append(pb.ArrayRecord(type_tag="ArrayRecord", num_datums=0))
    start = 0
    for end in range(1, len(rows) + 1):
        if end == len(rows) or _signature(rows[end]) != _signature(rows[start]):
            msg.loss_fn_outputs.append(_array_record(rows[start:end]))
            start = end
    return msg.SerializeToString()


# -- sample result -----------------------------------------------------------------------------------------

def _int32_tokens(where: str, tokens: object) -> bytes:
    array = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if array.size and (array.min() < np.iinfo(np.int32).min or array.max() > np.iinfo(np.int32).max):
        raise ServerError(f"{where}: a token id does not fit the protocol's int32")
    return array.astype(_TOKEN).tobytes()


def encode_sample_response(resp: types.SampleResponse,
                           target_layout: tuple[list[int], list[int]] | None = None) -> bytes:
    """Our sample result as the SampleResponse protobuf the SDK decodes (response_conv).

    Every sequence carries its logprobs: the SDK user (the cookbook's RL loops) reads them, so a sequence
    without them is a server bug, raised here rather than sent on. Sequence ids are not in the proto: the SDK
    stamps them from the asample promise. ``target_layout``: the CSR indices (crow, col) of a sparse
    target_prompt_logprobs request, whose answer has the same layout.
    """
    msg = pb.SampleResponse()
    for i, seq in enumerate(resp.sequences):
        where = f"sampled sequence {i}"
        stop_reason = _STOP_REASONS.get(seq.stop_reason)
        if stop_reason is None:
            raise ServerError(f"{where}: stop_reason {seq.stop_reason!r} is not one of {sorted(_STOP_REASONS)}")
        if seq.logprobs is None:
            raise ServerError(f"{where} has no logprobs; the gateway always sends them (the SDK's users read them)")
        if len(seq.logprobs) != len(seq.tokens):
            raise ServerError(f"{where} has {len(seq.tokens)} tokens but {len(seq.logprobs)} logprobs")
        msg.sequences.append(pb.SampledSequence(
            stop_reason=stop_reason,
            tokens=_int32_tokens(where, seq.tokens),
            logprobs=np.asarray(seq.logprobs, dtype="<f4").tobytes(),
        ))
        if seq.topk_logprobs is not None:
            msg.sequences[-1].topk_sampled_logprobs.CopyFrom(_topk(seq.topk_logprobs))
    if resp.prompt_logprobs is not None:
        # None (position 0 has no context) travels as NaN; the SDK turns NaN back into None.
        values = [math.nan if lp is None else float(lp) for lp in resp.prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    if resp.topk_prompt_logprobs is not None:
        msg.topk_prompt_logprobs.CopyFrom(_topk(resp.topk_prompt_logprobs))
    if resp.target_prompt_logprobs is not None:
        msg.target_prompt_logprobs.CopyFrom(_target_tensor(resp.target_prompt_logprobs.to_numpy(), target_layout))
    if resp.prompt_alt_tokens is not None:
        alt = resp.prompt_alt_tokens
        msg.prompt_alt_tokens.tokens.CopyFrom(_dense_tensor(alt.tokens.to_numpy().astype(_TOKEN), pb.DTYPE_INT32))
        msg.prompt_alt_tokens.logprobs.CopyFrom(_dense_tensor(alt.logprobs.to_numpy().astype("<f4"), pb.DTYPE_FLOAT32))
    # The prompt tokens a prompt cache served (the cookbook's cost estimate reads it): 0, there is no cache yet.
    msg.prompt_cache_hit_tokens = int(getattr(resp, "prompt_cache_hit_tokens", 0) or 0)
    return msg.SerializeToString()


def _topk(topk: types.TopkLogprobs) -> pb.TopkLogprobs:
    """Tinker's dense N x k matrices, row-major (empty cells are already the sentinel 0 / -99999.0)."""
    n, k = topk.token_ids.shape
    return pb.TopkLogprobs(token_ids=np.ascontiguousarray(topk.token_ids, dtype=_TOKEN).tobytes(),
                           logprobs=np.ascontiguousarray(topk.logprobs, dtype="<f4").tobytes(), k=k, length=n)


def _dense_tensor(array: np.ndarray, dtype: pb.DType.ValueType) -> pb.Tensor:
    return pb.Tensor(dense=np.ascontiguousarray(array).tobytes(), dtype=dtype, shape=list(array.shape))


def _target_tensor(values: np.ndarray, layout: tuple[list[int], list[int]] | None) -> pb.Tensor:
    """The target logprobs (L - 1, K) float32, dense, or in the request's CSR layout (the listed cells only)."""
    values = np.asarray(values, dtype="<f4")
    if layout is None:
        return _dense_tensor(values, pb.DTYPE_FLOAT32)
    crow, col = np.asarray(layout[0], dtype="<i8"), np.asarray(layout[1], dtype="<i8")
    rows = np.repeat(np.arange(len(crow) - 1), np.diff(crow))
    return pb.Tensor(sparse_csr=pb.SparseCsr(values=values[rows, col].tobytes(), crow_indices=crow.tobytes(),
                                             col_indices=col.tobytes()),
                     dtype=pb.DTYPE_FLOAT32, shape=list(values.shape))

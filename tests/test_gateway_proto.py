"""gateway/proto.py against the tinker SDK's own converters: what the SDK encodes we decode, what we encode it
reads back. Fast, no services."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from tinker import types as sdk
from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results
from tinker.proto import request_conv, response_conv
from tinker.proto import tinker_public_pb2 as pb

from tinkerq import types
from tinkerq.errors import MalformedMessageError, ServerError, ValidationError
from tinkerq.gateway import proto
from tinkerq.validation import Limits, validate_loss_request
from tinkerq.wire import codec, messages

MODEL_ID = "session-1:train:0"
LIMITS = Limits(max_datums=64, max_batch_tokens=4096)


def sdk_body(data: list[sdk.Datum], loss_fn: str = "cross_entropy", loss_fn_config=None, *,
             forward_only: bool = False, seq_id: int | None = 1) -> bytes:
    """The request body exactly as TrainingClient -> resources/training.py builds it."""
    request = sdk.ForwardBackwardRequest(
        forward_backward_input=sdk.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config),
        model_id=MODEL_ID,
        seq_id=seq_id,
    )
    msg = request_conv.forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def sdk_msg(data: list[sdk.Datum], **kwargs) -> pb.ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(sdk_body(data, **kwargs))
    return msg


def assert_same_datums(got: list[types.Datum], want: list[types.Datum]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        g_tokens, w_tokens = g.model_input.to_numpy(), w.model_input.to_numpy()
        assert g_tokens.dtype == np.int64 and np.array_equal(g_tokens, w_tokens)
        assert sorted(g.loss_fn_inputs) == sorted(w.loss_fn_inputs)
        for key, tensor in w.loss_fn_inputs.items():
            assert g.loss_fn_inputs[key] == tensor, key  # same dtype and values
            assert g.loss_fn_inputs[key].shape == tensor.shape, key
    # Byte for byte what the producer would put on the wire for the directly built datums (a proto map has no
    # order, so the inputs are compared by key).
    def wire(data: list[types.Datum]) -> bytes:
        encoded = [messages.encode_datum(d) for d in data]
        return codec.packb([{**e, "inputs": dict(sorted(e["inputs"].items()))} for e in encoded])

    assert wire(got) == wire(want)


def rng_tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, 1000, size=n).tolist()


def test_importing_the_module_leaves_the_sdk_and_torch_out():
    # `import tinker` imports torch when it is installed; the gateway loads only the SDK's generated module.
    code = ("import sys, tinkerq.gateway.proto; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'tinker'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- requests the SDK encodes ---------------------------------------------------------------------------------

def test_cross_entropy_round_trip_with_variable_lengths():
    rng = np.random.default_rng(0)
    sdk_data, want = [], []
    for n in (3, 9, 1, 17):
        tokens, targets = rng_tokens(rng, n), rng_tokens(rng, n)
        weights = rng.random(n).astype(np.float32)
        # Plain lists, numpy arrays and explicit TensorData: the three ways users build SDK datums.
        sdk_inputs = {"target_tokens": targets, "weights": weights} if n % 2 else {
            "target_tokens": sdk.TensorData(data=targets, dtype="int64", shape=[n]),
            "weights": weights.tolist()}
        sdk_data.append(sdk.Datum(model_input=tinker.ModelInput.from_ints(tokens), loss_fn_inputs=sdk_inputs))
        want.append(types.Datum(model_input=types.ModelInput.from_ints(tokens),
                                loss_fn_inputs={"target_tokens": targets, "weights": weights.tolist()}))

    call = proto.decode_forward_backward_request(sdk_body(sdk_data, seq_id=7))

    assert (call.model_id, call.seq_id, call.loss_fn, call.loss_fn_config, call.forward_only) == (
        MODEL_ID, 7, "cross_entropy", None, False)
    assert_same_datums(call.data, want)
    assert call.data[0].loss_fn_inputs["target_tokens"].dtype == "int64"
    assert call.data[0].loss_fn_inputs["weights"].dtype == "float32"
    validate_loss_request(call.data, call.loss_fn, call.loss_fn_config, limits=LIMITS, vocab_size=1000)


def test_importance_sampling_with_string_and_numeric_config_forward_only():
    rng = np.random.default_rng(1)
    sdk_data, want = [], []
    for n in (5, 2):
        tokens, targets = rng_tokens(rng, n), rng_tokens(rng, n)
        logprobs, advantages = (-rng.random(n)).tolist(), rng.normal(size=n).tolist()
        inputs = {"target_tokens": targets, "logprobs": logprobs, "advantages": advantages}
        sdk_data.append(sdk.Datum(model_input=tinker.ModelInput.from_ints(tokens), loss_fn_inputs=inputs))
        want.append(types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs))

    body = sdk_body(sdk_data, "importance_sampling", {"clip_low_threshold": 0.8, "mode": "token", "beta": 2},
                    forward_only=True, seq_id=3)
    call = proto.decode_forward_backward_request(body)

    assert call.loss_fn == "importance_sampling" and call.forward_only is True and call.seq_id == 3
    assert call.loss_fn_config == {"clip_low_threshold": 0.8, "mode": "token", "beta": 2.0}
    assert_same_datums(call.data, want)
    for datum in call.data:
        assert {k: t.dtype for k, t in datum.loss_fn_inputs.items()} == {
            "target_tokens": "int64", "logprobs": "float32", "advantages": "float32"}


def test_legacy_only_config_and_empty_config():
    msg = sdk_msg([sdk.Datum(model_input=tinker.ModelInput.from_ints([1, 2]),
                             loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]})],
                  loss_fn_config={"beta": 0.5})
    msg.ClearField("loss_fn_config_v2")  # an older client: numbers in the legacy map only
    assert proto.decode_forward_backward_request(msg.SerializeToString()).loss_fn_config == {"beta": 0.5}
    msg.ClearField("loss_fn_config")
    assert proto.decode_forward_backward_request(msg.SerializeToString()).loss_fn_config is None


def test_two_dimensional_targets_dense_and_sparse():
    rng = np.random.default_rng(2)
    n, k = 6, 4
    dense_targets = rng.integers(1, 1000, size=(n, k))
    # Mostly zeros (a top-K target padded with 0): the SDK sends torch 2-D target_tokens/weights as CSR.
    sparse_targets = np.zeros((n, k), dtype=np.int64)
    sparse_targets[[0, 2, 5], [1, 0, 3]] = [17, 4, 999]
    sparse_weights = np.zeros((n, k), dtype=np.float32)
    sparse_weights[1, 2] = 0.25
    tokens = rng_tokens(rng, n)
    sdk_data = [
        sdk.Datum(model_input=tinker.ModelInput.from_ints(tokens),
                  loss_fn_inputs={"target_tokens": sdk.TensorData.from_numpy(dense_targets)}),
        sdk.Datum(model_input=tinker.ModelInput.from_ints(tokens),
                  loss_fn_inputs={"target_tokens": torch.from_numpy(sparse_targets),
                                  "weights": torch.from_numpy(sparse_weights)}),
    ]
    msg = sdk_msg(sdk_data)
    assert msg.data[0].loss_fn_inputs["target_tokens"].WhichOneof("encoding") == "dense"
    assert msg.data[1].loss_fn_inputs["target_tokens"].WhichOneof("encoding") == "sparse_csr"
    assert msg.data[1].loss_fn_inputs["weights"].WhichOneof("encoding") == "sparse_csr"

    call = proto.decode_forward_backward_request(msg.SerializeToString())

    assert_same_datums(call.data, [
        types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs={"target_tokens": dense_targets}),
        types.Datum(model_input=types.ModelInput.from_ints(tokens),
                    loss_fn_inputs={"target_tokens": sparse_targets, "weights": sparse_weights}),
    ])
    assert call.data[1].loss_fn_inputs["target_tokens"].shape == [n, k]
    assert call.data[1].loss_fn_inputs["weights"].to_numpy().flags.writeable


def test_several_chunks_provenance_and_unshaped_tensor():
    chunks = [tinker.EncodedTextChunk(tokens=[5, 6]), tinker.EncodedTextChunk(tokens=[7]),
              tinker.EncodedTextChunk(tokens=[8, 9, 10])]
    datum = sdk.Datum(model_input=tinker.ModelInput(chunks=chunks),
                      loss_fn_inputs={"target_tokens": sdk.TensorData(data=[6, 7, 8, 9, 10, 11], dtype="int64"),
                                      "weights": [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]})
    datum = datum.with_provenance(
        model_input=[sdk.PromptProvenanceSpan(sequence_id="seq-a", length=3),
                     sdk.SampledProvenanceSpan(sequence_id="seq-a", length=3)],
        loss_fn_inputs=[sdk.PromptProvenanceSpan(sequence_id="seq-a", offset=1, length=6)],
    )
    msg = sdk_msg([datum])
    assert len(msg.data[0].model_input_spans) == 2 and not msg.data[0].loss_fn_inputs["target_tokens"].shape

    call = proto.decode_forward_backward_request(msg.SerializeToString())

    assert_same_datums(call.data, [types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8, 9, 10]),
        loss_fn_inputs={"target_tokens": [6, 7, 8, 9, 10, 11], "weights": [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]})])


def test_int32_and_bfloat16_tensors_widen():
    bf16_exact = np.array([1.0, -2.5, 0.15625, 0.0], dtype=np.float32)  # representable in bfloat16
    msg = sdk_msg([sdk.Datum(model_input=tinker.ModelInput.from_ints([1, 2, 3, 4]), loss_fn_inputs={})])
    inputs = msg.data[0].loss_fn_inputs
    inputs["target_tokens"].CopyFrom(pb.Tensor(dense=np.array([4, 3, 2, 1], "<i4").tobytes(),
                                               dtype=pb.DTYPE_INT32, shape=[4]))
    inputs["weights"].CopyFrom(pb.Tensor(dense=(bf16_exact.view(np.uint32) >> 16).astype("<u2").tobytes(),
                                         dtype=pb.DTYPE_BFLOAT16, shape=[4]))

    datum = proto.decode_forward_backward_request(msg.SerializeToString()).data[0]

    assert datum.loss_fn_inputs["target_tokens"] == types.TensorData([4, 3, 2, 1], dtype="int64")
    assert datum.loss_fn_inputs["weights"] == types.TensorData(bf16_exact, dtype="float32")


# -- results the SDK decodes --------------------------------------------------------------------------------

WORKER_METRICS = {"loss:sum": 12.5, "ratio:mean": 1.01, "log_ratio:min": -0.2, "log_ratio:max": 0.3,
                  "kl_sample_train:mean": 0.001, "clip_fraction:mean": 0.25}


def test_forward_backward_output_round_trip():
    rng = np.random.default_rng(3)
    outputs = [{"logprobs": types.TensorData.from_numpy(-rng.random(n).astype(np.float32)),
                "elementwise_loss": types.TensorData.from_numpy(rng.random(n))}  # float64: sent as float32
               for n in (4, 1, 11)]
    out = types.ForwardBackwardOutput(loss_fn_output_type="importance_sampling", loss_fn_outputs=outputs,
                                      metrics=WORKER_METRICS)

    encoded = proto.encode_forward_backward_output(out)
    got = response_conv.deserialize_forward_backward_output(encoded)

    raw = pb.ForwardBackwardOutput.FromString(encoded)
    assert len(raw.loss_fn_outputs) == 1 and raw.loss_fn_outputs[0].num_datums == 3
    assert got.loss_fn_output_type == "importance_sampling"
    assert got.metrics == pytest.approx(WORKER_METRICS) and set(got.metrics) == set(WORKER_METRICS)
    assert len(got.loss_fn_outputs) == 3
    for mine, theirs in zip(outputs, got.loss_fn_outputs, strict=True):
        assert set(theirs) == {"logprobs", "elementwise_loss"}
        for name, tensor in mine.items():
            assert theirs[name].dtype == "float32" and theirs[name].shape == tensor.shape
            np.testing.assert_array_equal(theirs[name].to_numpy(), tensor.to_numpy().astype(np.float32))
    # The SDK merges chunks' metrics by splitting every key: ours must survive it.
    merged = combine_fwd_bwd_output_results([got, got])
    assert merged.metrics["loss:sum"] == pytest.approx(25.0)
    assert merged.metrics["ratio:mean"] == pytest.approx(1.01)


def test_forward_backward_output_shapes_dtypes_and_ragged_records():
    topk = np.arange(12, dtype=np.int64).reshape(4, 3)
    outputs = [{"ids": types.TensorData.from_numpy(topk), "x": types.TensorData([1.5, 2.5], dtype="float32")},
               {"ids": types.TensorData.from_numpy(topk[:2]), "x": types.TensorData([3.5], dtype="float32")},
               {"ids": types.TensorData.from_numpy(np.arange(10, dtype=np.int64).reshape(2, 5)),  # new trailing
                "x": types.TensorData([], dtype="float32")}]
    encoded = proto.encode_forward_backward_output(types.ForwardBackwardOutput("cross_entropy", outputs, {}))
    got = response_conv.deserialize_forward_backward_output(encoded)

    assert len(pb.ForwardBackwardOutput.FromString(encoded).loss_fn_outputs) == 2
    assert [o["ids"].shape for o in got.loss_fn_outputs] == [[4, 3], [2, 3], [2, 5]]
    assert all(o["ids"].dtype == "int64" for o in got.loss_fn_outputs)
    np.testing.assert_array_equal(got.loss_fn_outputs[1]["ids"].to_numpy(), topk[:2])
    assert [o["x"].tolist() for o in got.loss_fn_outputs] == [[1.5, 2.5], [3.5], []]


def test_zero_datums():
    encoded = proto.encode_forward_backward_output(types.ForwardBackwardOutput("cross_entropy", [], {"loss:sum": 0.0}))
    got = response_conv.deserialize_forward_backward_output(encoded)
    assert got.loss_fn_outputs == [] and got.metrics == {"loss:sum": 0.0}


def test_malformed_metric_keys_are_mapped_not_fatal():
    metrics = {"loss:sum": 1.0, "tokens": 7.0, "a:b:mean": 2.0, "x:avg": 3.0}
    outputs = [{"logprobs": types.TensorData([-1.0], dtype="float32")}]
    got = response_conv.deserialize_forward_backward_output(
        proto.encode_forward_backward_output(types.ForwardBackwardOutput("cross_entropy", outputs, metrics)))
    assert got.metrics == {"loss:sum": 1.0, "tokens:unique": 7.0, "a/b:mean": 2.0, "x/avg:unique": 3.0}
    combine_fwd_bwd_output_results([got, got])  # would raise on a key without exactly one ':'


def test_output_with_mismatched_fields_is_a_server_error():
    outputs = [{"logprobs": types.TensorData([0.0], dtype="float32")}, {}]
    with pytest.raises(ServerError, match=r"output 1 has fields \[\]"):
        proto.encode_forward_backward_output(types.ForwardBackwardOutput("cross_entropy", outputs, {}))


def test_sample_response_round_trip():
    resp = types.SampleResponse(
        sequences=[types.SampledSequence("stop", [5, 6, 7], [-0.5, -1.25, -0.0078125]),
                   types.SampledSequence("length", [9], [-3.0], sequence_id="ignored")],
        prompt_logprobs=[None, -1.5, -0.25],
    )
    got = response_conv.deserialize_sample_response(proto.encode_sample_response(resp))

    assert [s.stop_reason for s in got.sequences] == ["stop", "length"]
    assert [s.tokens for s in got.sequences] == [[5, 6, 7], [9]]
    assert [s.logprobs for s in got.sequences] == [[-0.5, -1.25, -0.0078125], [-3.0]]
    assert got.prompt_logprobs == [None, -1.5, -0.25]

    plain = response_conv.deserialize_sample_response(
        proto.encode_sample_response(types.SampleResponse([types.SampledSequence("stop", [1], [-1.0])])))
    assert plain.prompt_logprobs is None and plain.sequences[0].logprobs == [-1.0]


@pytest.mark.parametrize(("sequence", "fragment"), [
    (types.SampledSequence("stop", [1, 2], None), "has no logprobs"),
    (types.SampledSequence("stop", [1, 2], [-1.0]), "2 tokens but 1 logprobs"),
    (types.SampledSequence("eos", [1], [-1.0]), "stop_reason 'eos'"),  # type: ignore[arg-type]
    (types.SampledSequence("stop", [2**31], [-1.0]), "int32"),
])
def test_bad_sample_response_is_a_server_error(sequence, fragment):
    with pytest.raises(ServerError, match=fragment):
        proto.encode_sample_response(types.SampleResponse([sequence]))


# -- bad requests ---------------------------------------------------------------------------------------------

def good_msg() -> pb.ForwardBackwardRequest:
    return sdk_msg([
        sdk.Datum(model_input=tinker.ModelInput.from_ints([1, 2, 3, 4]),
                  loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0, 1.0, 1.0, 1.0]}),
        sdk.Datum(model_input=tinker.ModelInput.from_ints([1, 2]),
                  loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]}),
    ], loss_fn_config={"beta": 1.0})


def decode_error(msg: pb.ForwardBackwardRequest) -> str:
    with pytest.raises((MalformedMessageError, ValidationError)) as info:
        proto.decode_forward_backward_request(msg.SerializeToString())
    assert info.value.is_user_error
    return info.value.message


def test_good_msg_decodes():
    assert len(proto.decode_forward_backward_request(good_msg().SerializeToString()).data) == 2


@pytest.mark.parametrize("body", [b"\xff\xff\xff\xff not a protobuf", np.random.default_rng(0).bytes(64),
                                  good_msg().SerializeToString()[:40]])
def test_bodies_that_are_not_protobuf(body):
    with pytest.raises(MalformedMessageError, match="body is not a ForwardBackwardRequest protobuf: "):
        proto.decode_forward_backward_request(body)


def test_seq_id_zero():
    msg = good_msg()
    msg.seq_id = 0
    with pytest.raises(ValidationError, match=r"seq_id must be >= 1.*got 0"):
        proto.decode_forward_backward_request(msg.SerializeToString())


def test_image_and_dmel_chunks_are_refused():
    image = sdk.Datum(model_input=tinker.ModelInput(chunks=[tinker.EncodedTextChunk(tokens=[1]),
                                                            sdk.ImageChunk(data=b"\x89PNG", format="png")]),
                      loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0, 1.0]})
    with pytest.raises(ValidationError, match=r"datum 0: model_input chunk 1 is an image chunk.*token input only"):
        proto.decode_forward_backward_request(sdk_body([image]))
    msg = good_msg()
    msg.data[1].model_input[0].dmel.dmel = b"\x00"
    assert "datum 1: model_input chunk 0 is a dmel (audio) chunk" in decode_error(msg)


def test_token_bytes_not_int32():
    msg = good_msg()
    msg.data[1].model_input[0].encoded_text.tokens += b"\x00"
    assert decode_error(msg) == "datum 1: model_input chunk 0 has 9 token bytes, not a multiple of 4 (int32 tokens)"


def test_dense_byte_length_not_a_multiple_of_the_item_size():
    msg = good_msg()
    msg.data[0].loss_fn_inputs["weights"].dense = b"\x00" * 7
    assert decode_error(msg).startswith("datum 0: loss_fn_inputs['weights']: dense data has 7 bytes, not a multiple "
                                        "of 4")


def test_shape_mismatch():
    msg = good_msg()
    msg.data[1].loss_fn_inputs["target_tokens"].shape[:] = [3]
    assert decode_error(msg) == "datum 1: loss_fn_inputs['target_tokens'] has 2 values but its shape [3] needs 3"
    msg.data[1].loss_fn_inputs["target_tokens"].shape[:] = [-2]
    assert "negative dimension" in decode_error(msg)


def test_unspecified_dtype_and_missing_data():
    msg = good_msg()
    msg.data[0].loss_fn_inputs["weights"].dtype = pb.DTYPE_UNSPECIFIED
    assert "datum 0: loss_fn_inputs['weights'] has DTYPE_UNSPECIFIED" in decode_error(msg)
    msg = good_msg()
    msg.data[0].loss_fn_inputs["weights"].ClearField("dense")
    assert "datum 0: loss_fn_inputs['weights'] has neither dense nor sparse_csr data" in decode_error(msg)


def test_loss_config_value_without_a_value():
    msg = good_msg()
    msg.loss_fn_config_v2["beta"].ClearField("number")
    assert "loss_fn_config_v2['beta'] has neither a number nor a text value" in decode_error(msg)


def csr_msg(values, crow, col, shape, dtype=np.int64) -> pb.ForwardBackwardRequest:
    msg = good_msg()
    tensor = msg.data[1].loss_fn_inputs["target_tokens"]
    tensor.Clear()
    tensor.dtype = pb.DTYPE_INT64 if dtype == np.int64 else pb.DTYPE_FLOAT32
    tensor.shape[:] = shape
    tensor.sparse_csr.values = np.asarray(values, dtype=dtype).tobytes()
    tensor.sparse_csr.crow_indices = np.asarray(crow, dtype="<i8").tobytes()
    tensor.sparse_csr.col_indices = np.asarray(col, dtype="<i8").tobytes()
    return msg


def test_valid_csr_by_hand():
    datum = proto.decode_forward_backward_request(
        csr_msg([7, 8, 9], [0, 2, 2, 3], [0, 2, 1], [3, 3]).SerializeToString()).data[1]
    np.testing.assert_array_equal(datum.loss_fn_inputs["target_tokens"].to_numpy(),
                                  [[7, 0, 8], [0, 0, 0], [0, 9, 0]])


@pytest.mark.parametrize(("values", "crow", "col", "shape", "fragment"), [
    ([1, 2], [0, 2], [0, 1], [2, 2], "crow_indices has 2 entries; shape [2, 2] needs rows + 1 = 3"),
    ([1, 2], [0, 1, 2], [0], [2, 2], "has 2 values but 1 col_indices"),
    ([1, 2], [0, 2, 1], [0, 1], [2, 2], "crow_indices must rise from 0 to the value count 2"),
    ([1, 2], [0, 1, 3], [0, 1], [2, 2], "crow_indices must rise from 0 to the value count 2"),
    ([1, 2], [0, 1, 2], [0, 2], [2, 2], "col_indices must be in [0, 2)"),
    ([1, 2], [0, 1, 2], [-1, 0], [2, 2], "col_indices must be in [0, 2)"),
    ([1, 2], [0, 2, 2], [1, 1], [2, 2], "col_indices must increase strictly within each row"),
    ([1, 2], [0, 1, 2], [0, 1], [4], "is sparse_csr with shape [4]; a CSR tensor has a 2-D shape"),
    ([1], [0, 1, 1], [0], [2, 10**9], "more than this server densifies"),
])
def test_bad_csr(values, crow, col, shape, fragment):
    message = decode_error(csr_msg(values, crow, col, shape))
    assert message.startswith("datum 1: loss_fn_inputs['target_tokens']") and fragment in message


def test_csr_index_bytes_not_int64():
    msg = csr_msg([1, 2], [0, 1, 2], [0, 1], [2, 2])
    msg.data[1].loss_fn_inputs["target_tokens"].sparse_csr.col_indices += b"\x00\x00\x00\x00"
    assert "sparse_csr col_indices has 20 bytes, not a multiple of 8" in decode_error(msg)


def test_nan_weight_is_left_to_the_validator():
    # A NaN weight decodes as sent: the validator (run after decoding) is what rejects it, naming datum and key.
    msg = good_msg()
    msg.data[0].loss_fn_inputs["weights"].dense = np.array([1, math.nan, 1, 1], "<f4").tobytes()
    call = proto.decode_forward_backward_request(msg.SerializeToString())
    with pytest.raises(ValidationError, match=r"datum 0: loss_fn_inputs\['weights'\] has a non-finite value"):
        validate_loss_request(call.data, call.loss_fn, None, limits=LIMITS)

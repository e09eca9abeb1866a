"""Every malformed, oversized or inconsistent request gets a clear user error on the caller's future;
the model is exactly as before and the worker keeps serving. Nothing is ever unpickled."""

from __future__ import annotations

import struct
import uuid

import msgpack
import numpy as np
import pytest
import torch

from tests.conftest import WORKER_MAX_MESSAGE_BYTES
from tests.helpers import VOCAB, load_reference, make_batch, max_weight_diff, reference_step, send_raw
from tinkerq import errors, types
from tinkerq.producer.futures import APIFuture
from tinkerq.wire import codec, messages

pytestmark = pytest.mark.timeout(180)


def _datum(tokens, targets, weights) -> dict:
    """A datum as it appears on the wire, built by hand so the producer's own checks are bypassed."""
    d = {"tokens": np.asarray(tokens), "inputs": {}}
    if targets is not None:
        d["inputs"]["target_tokens"] = np.asarray(targets)
    if weights is not None:
        d["inputs"]["weights"] = np.asarray(weights)
    return d


def _body(*data, loss_fn="cross_entropy", config=None) -> dict:
    return {"loss_fn": loss_fn, "loss_fn_config": config, "data": list(data)}


GOOD = (np.array([1, 2, 3]), np.array([2, 3, 4]), np.array([0.0, 1.0, 1.0], dtype=np.float32))

# (case id, raw body, words the error must contain)
WORKER_CASES = [
    ("token-out-of-vocab", _body(_datum([1, 2, VOCAB + 5], GOOD[1], GOOD[2])),
     ["datum 0", "model_input", "vocabulary"]),
    ("target-out-of-vocab", _body(_datum(*GOOD), _datum(GOOD[0], [1, VOCAB, 2], GOOD[2])),
     ["datum 1", "target_tokens", "vocabulary"]),
    ("negative-token", _body(_datum([1, -3, 2], GOOD[1], GOOD[2])), ["datum 0", "negative"]),
    ("weights-length", _body(_datum(GOOD[0], GOOD[1], np.ones(4, np.float32))), ["datum 0", "weights", "shape"]),
    ("targets-length", _body(_datum(GOOD[0], [1, 2], GOOD[2])), ["datum 0", "target_tokens", "shape"]),
    ("missing-targets", _body(_datum(GOOD[0], None, GOOD[2])), ["datum 0", "missing", "target_tokens"]),
    ("missing-weights", _body(_datum(GOOD[0], GOOD[1], None)), ["datum 0", "missing", "weights"]),
    ("float-tokens", _body(_datum(np.array([1.0, 2.0, 3.0]), GOOD[1], GOOD[2])), ["datum 0", "integers"]),
    ("int-weights", _body(_datum(GOOD[0], GOOD[1], np.array([0, 1, 1]))), ["datum 0", "weights", "dtype"]),
    ("nan-weight", _body(_datum(GOOD[0], GOOD[1], np.array([0, np.nan, 1], np.float32))),
     ["datum 0", "weights", "non-finite"]),
    ("inf-weight", _body(_datum(*GOOD), _datum(GOOD[0], GOOD[1], np.array([0, 1, np.inf], np.float32))),
     ["datum 1", "non-finite"]),
    ("empty-batch", _body(), ["empty"]),
    ("empty-datum", _body(_datum(np.array([], np.int64), np.array([], np.int64), np.array([], np.float32))),
     ["datum 0", "empty"]),
    ("unknown-loss", _body(_datum(*GOOD), loss_fn="mse"), ["unknown loss_fn", "mse"]),
    ("unknown-config", _body(_datum(*GOOD), config={"beta": 0.1}), ["loss_fn_config", "beta"]),
    ("unknown-input", {"loss_fn": "cross_entropy", "loss_fn_config": None,
                       "data": [{"tokens": GOOD[0], "inputs": {"target_tokens": GOOD[1], "weights": GOOD[2],
                                                                "mask": GOOD[2]}}]}, ["datum 0", "mask"]),
    ("datum-not-map", {"loss_fn": "cross_entropy", "loss_fn_config": None, "data": [[1, 2, 3]]}, ["datum 0"]),
    ("tokens-not-array", {"loss_fn": "cross_entropy", "loss_fn_config": None,
                          "data": [{"tokens": [1, 2], "inputs": {}}]}, ["datum 0", "tokens"]),
    ("body-not-map", [1, 2, 3], ["body must be a map"]),
    ("huge-weights", _body(_datum(GOOD[0], GOOD[1], np.full(3, 3e38, np.float32))), ["loss is", "nothing was applied"]),
]


@pytest.fixture
def tc(training_client):
    return training_client


def _send_body(tc, op: str, body, seq_id: int | None = None) -> APIFuture:
    """Send a raw body with the next sequence number, as a producer that skipped validation would."""
    return tc._submit(op, body, messages.decode_forward_backward_output, argsrepr="test", seq_id=seq_id)


def _send_payload_ref(tc, op: str, ref: dict, envelope_patch: dict | None = None) -> APIFuture:
    # An envelope the worker cannot read consumes no sequence number: don't take one from the client.
    seq_id = 10**9 if envelope_patch else tc.next_seq_id()
    envelope = messages.make_envelope(op, tc.model_id, seq_id, ref)
    envelope.update(envelope_patch or {})
    return send_raw(tc, op, envelope)


def _assert_user_error(future: APIFuture, words: list[str]) -> errors.TinkerqError:
    with pytest.raises(errors.TinkerqError) as info:
        future.result(timeout=60)
    err = info.value
    assert err.category == "user", err
    assert isinstance(err, ValueError)
    for word in words:
        assert word in err.message, (word, err.message)
    return err


def test_worker_refuses_every_bad_request_and_keeps_the_model(tc, model_dir):
    probe = make_batch(np.random.default_rng(7), 3)
    before = tc.forward(probe).result(timeout=60)

    # Every case through both forward_backward and forward: the worker validates on its own.
    for case, body, words in WORKER_CASES:
        for op in ("forward_backward", "forward"):
            try:
                _assert_user_error(_send_body(tc, op, body), words)
            except AssertionError as exc:
                raise AssertionError(f"case {case} ({op}): {exc}") from exc

    # Malformed bytes, forbidden extension types, bad envelopes, expired claim checks, oversized payloads.
    bad_ext = msgpack.packb({"loss_fn": "cross_entropy", "data": [msgpack.ExtType(1, struct.pack("<BB", 99, 0))]})
    _assert_user_error(_send_payload_ref(tc, "forward_backward", {"inline": b"\xc1\xc1garbage"}), ["not valid"])
    _assert_user_error(_send_payload_ref(tc, "forward_backward", {"inline": bad_ext}), ["dtype code 99"])
    _assert_user_error(_send_payload_ref(tc, "forward_backward", {"blob": "tinkerq:blob:" + uuid.uuid4().hex,
                                                                  "size": 10}), ["expired"])
    _assert_user_error(_send_payload_ref(tc, "forward_backward", {"blob": "some:other:key"}), ["not a tinkerq blob"])
    _assert_user_error(_send_payload_ref(tc, "forward_backward", {"inline": codec.packb(_body(_datum(*GOOD)))},
                                         {"v": 99}), ["version"])
    _assert_user_error(_send_payload_ref(tc, "optim_step", {"inline": codec.packb({"adam": {"lr": 1}})}),
                       ["unknown AdamParams"])
    big = _datum(np.ones(WORKER_MAX_MESSAGE_BYTES // 8, np.int64), None, None)
    _assert_user_error(_send_body(tc, "forward_backward", _body(big)), ["exceeds the limit"])

    after = tc.forward(probe).result(timeout=60)
    assert after.metrics == before.metrics
    # No gradient leaked from any refused request: one good step lands exactly where the reference does.
    adam = types.AdamParams(learning_rate=1e-2)
    tc.forward_backward(probe)
    tc.optim_step(adam).result(timeout=60)
    ref = load_reference(model_dir)
    reference_step(ref, torch.optim.AdamW(ref.parameters()), [probe], adam)
    assert max_weight_diff(ref, tc.save_weights_for_sampler("after-bad").result(timeout=60).path) < 1e-6


def test_producer_refuses_bad_input_without_sending(tc):
    bad = [types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                       loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0, 1.0, 1.0]})]
    future = tc.forward_backward(bad)
    assert future.task_id is None  # never left the process
    _assert_user_error(future, ["datum 0", "target_tokens", "shape"])
    _assert_user_error(tc.forward_backward([]), ["empty"])
    _assert_user_error(tc.forward_backward(make_batch(np.random.default_rng(0), 1), loss_fn="nope"), ["nope"])
    _assert_user_error(tc.optim_step(types.AdamParams(learning_rate=float("nan"))), ["learning_rate"])
    _assert_user_error(tc.optim_step(types.AdamParams(beta2=1.5)), ["beta2"])
    # Refused calls used no sequence number: a gap would leave this next request waiting forever.
    assert np.isfinite(tc.forward(make_batch(np.random.default_rng(0), 1)).result(timeout=30).metrics["loss:sum"])


def test_non_finite_gradient_norm_refuses_the_step(tc, model_dir):
    probe = make_batch(np.random.default_rng(8), 2)
    before = tc.forward(probe).result(timeout=60).metrics["loss:sum"]
    # Finite loss, but squared gradients overflow float32: the step must be refused, weights untouched.
    huge = [types.Datum(model_input=d.model_input,
                        loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"],
                                        "weights": np.full(d.model_input.length, 1e30, np.float32)})
            for d in probe]
    fb = tc.forward_backward(huge)
    step = tc.optim_step(types.AdamParams(learning_rate=1e-2))
    failures = [f.exception(timeout=60) for f in (fb, step)]
    assert any(isinstance(e, errors.NonFiniteError) for e in failures), failures
    assert tc.forward(probe).result(timeout=60).metrics["loss:sum"] == before
    # And the session still trains normally afterwards.
    tc.forward_backward(probe)
    assert tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60).metrics["grad_norm:mean"] > 0
    assert tc.forward(probe).result(timeout=60).metrics["loss:sum"] < before


def test_unknown_model_fails_fast(service):
    """Refused from the registry in the call itself: create_training_client otherwise returns a future at once
    and the refusal would come from its result(), after a create request had waited for an answer."""
    with pytest.raises(errors.UnknownModelError, match="no worker serves"):
        service.create_training_client("/no/such/model")  # no .result(): it raises before anything is posted


class _Explosive:
    """Unpickling this would create a file: proof that nothing was unpickled if the file never appears."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_message_is_refused_without_decoding(tc, tmp_path, worker):
    marker = tmp_path / "unpickled"
    make, args = _Explosive(str(tmp_path / "selftest")).__reduce__()  # what unpickling it would call
    make(*args).close()
    assert (tmp_path / "selftest").exists()  # the bomb works (without unpickling anything here)
    future = send_raw(tc, "forward", _Explosive(str(marker)), serializer="pickle")
    err = future.exception(timeout=30)
    assert isinstance(err, errors.TinkerqError) and err.category == "user", err
    assert "application/x-python-serialize" in err.message
    assert not marker.exists()
    # The worker keeps serving.
    out = tc.forward(make_batch(np.random.default_rng(9), 1)).result(timeout=60)
    assert np.isfinite(out.metrics["loss:sum"])
    assert not marker.exists()

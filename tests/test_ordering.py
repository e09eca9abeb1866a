"""Requests of one session apply in the client's order, whatever order the broker delivers them in."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.helpers import load_reference, make_batch, max_weight_diff, reference_step, send_raw
from tinkerq import types
from tinkerq.wire import codec, messages

pytestmark = pytest.mark.timeout(180)


def _send_raw(tc, op: str, body: dict, seq_id: int, task_id: str | None = None):
    """Post one request exactly as the producer does, with a chosen seq_id (and task id, for redelivery)."""
    claim_check = tc.service.connection.claim_check()
    envelope = messages.make_envelope(op, tc.model_id, seq_id, claim_check.wrap(codec.packb(body)))
    return send_raw(tc, op, envelope, task_id=task_id, decode=lambda b: b)


def _reply_body(future, tc):
    return future.result(timeout=60)


def test_reordered_and_redelivered_requests_apply_once_in_order(training_client, model_dir):
    tc = training_client
    rng = np.random.default_rng(5)
    batches = [make_batch(rng, 2, max_len=20) for _ in range(10)]
    adam = types.AdamParams(learning_rate=5e-3)
    requests = []
    for batch in batches:
        requests.append(("forward_backward", messages.encode_loss_request(batch, "cross_entropy", None),
                         tc.next_seq_id()))
        requests.append(("optim_step", messages.encode_adam(adam), tc.next_seq_id()))

    order = list(range(len(requests)))
    random.Random(0).shuffle(order)
    assert order != sorted(order)
    sent = {}
    for i in order:
        op, body, seq = requests[i]
        sent[seq] = _send_raw(tc, op, body, seq)
    # Redeliveries: the same task (same id) again, and a client retry (new id) of an early request.
    redelivered = _send_raw(tc, *requests[3][:2], requests[3][2], task_id=sent[requests[3][2]].task_id)
    retried = _send_raw(tc, *requests[0][:2], requests[0][2])
    retried_step = _send_raw(tc, *requests[1][:2], requests[1][2])  # re-applying it would move the weights

    bodies = {seq: _reply_body(r, tc) for seq, r in sent.items()}
    again, first = _reply_body(retried, tc), bodies[requests[0][2]]
    assert again["metrics"] == first["metrics"]
    for x, y in zip(again["outputs"], first["outputs"], strict=True):
        np.testing.assert_array_equal(x["logprobs"], y["logprobs"])
    assert _reply_body(retried_step, tc)["metrics"] == bodies[requests[1][2]]["metrics"]
    assert _reply_body(redelivered, tc)["metrics"] == bodies[requests[3][2]]["metrics"]

    ref = load_reference(model_dir)
    ref_opt = torch.optim.AdamW(ref.parameters())
    for k, batch in enumerate(batches):
        norm = reference_step(ref, ref_opt, [batch], adam)
        assert bodies[requests[2 * k + 1][2]]["metrics"]["grad_norm:mean"] == pytest.approx(norm, rel=1e-5)
    # The normal API continues after the hand-made sequence numbers.
    saved = tc.save_weights_for_sampler("reordered").result(timeout=60).path
    assert max_weight_diff(ref, saved) < 1e-6


def test_sessions_are_isolated(service, model_dir):
    a = service.create_training_client(str(model_dir))
    b = service.create_training_client(str(model_dir))
    try:
        data = make_batch(np.random.default_rng(6), 3)
        before = b.forward(data).result(timeout=60).metrics["loss:sum"]
        a.forward_backward(data)
        a.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
        assert a.forward(data).result(timeout=60).metrics["loss:sum"] < before
        assert b.forward(data).result(timeout=60).metrics["loss:sum"] == before
    finally:
        a.close()
        b.close()


def test_a_missing_request_fails_the_ones_after_it_within_the_bound(training_client):
    """If a request never arrives, the ones queued behind it fail clearly instead of hanging forever."""
    from tests.conftest import WORKER_GAP_TIMEOUT_S
    from tinkerq import errors

    tc = training_client
    lost = tc.next_seq_id()  # taken, never sent: as if the broker lost the message
    later = tc.forward(make_batch(np.random.default_rng(10), 1))
    err = later.exception(timeout=60)  # a hang guard only
    assert isinstance(err, errors.ServerError), err
    assert f"seq {lost}" in err.message and "never reached" in err.message
    # Failed by the test worker's gap bound running out (not by some other, longer, timeout).
    assert f"within {WORKER_GAP_TIMEOUT_S:g} s (TINKERQ_GAP_TIMEOUT_S)" in err.message, err.message
    # The session refuses further work with the same explanation.
    again = tc.forward(make_batch(np.random.default_rng(11), 1)).exception(timeout=30)
    assert isinstance(again, errors.ServerError) and "never reached" in again.message


def test_a_request_deleted_from_the_queue_and_its_successors_all_get_answers(training_client, worker):
    """An operator (or a failure) removes a queued request: it and the requests after it fail, none hangs."""
    import json
    import os
    import signal

    import redis

    from tests.conftest import WORKER_GAP_TIMEOUT_S
    from tinkerq import errors

    tc = training_client
    r = redis.Redis.from_url(tc.service.settings.broker_url)
    tc.forward(make_batch(np.random.default_rng(12), 1)).result(timeout=60)
    # The worker takes what reaches its queue into its scheduler at once: frozen for the few milliseconds it
    # takes to post three requests and delete the second, it cannot take that one first, however loaded the
    # machine. (The first goes to the BRPOP it may have waiting: Redis hands it over even to a stopped process.)
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        first = tc.forward(make_batch(np.random.default_rng(12), 1))
        doomed = tc.forward(make_batch(np.random.default_rng(13), 1))
        after = tc.forward(make_batch(np.random.default_rng(14), 1))
        removed = 0
        for raw in r.lrange(tc._queue, 0, -1):
            if json.loads(raw)["headers"]["id"] == doomed.task_id:
                removed += r.lrem(tc._queue, 1, raw)
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    assert removed == 1
    first.result(timeout=60)
    for future in (after, doomed):
        err = future.exception(timeout=60)  # a hang guard only
        assert isinstance(err, errors.ServerError) and "never reached" in err.message, err
        assert f"within {WORKER_GAP_TIMEOUT_S:g} s (TINKERQ_GAP_TIMEOUT_S)" in err.message, err.message


def test_futures_are_awaited_concurrently(training_client):
    """asyncio code (the cookbook's gather over *_async calls) gets every answer, in its own order."""
    import asyncio

    tc = training_client
    rng = np.random.default_rng(15)
    batches = [make_batch(rng, 2) for _ in range(6)]

    async def run() -> list:
        futures = [await tc.forward_async(b) for b in batches]
        return await asyncio.gather(*reversed(futures))

    outs = list(reversed(asyncio.run(run())))
    for batch, out in zip(batches, outs, strict=True):
        assert out.metrics == tc.forward(batch).result(timeout=60).metrics

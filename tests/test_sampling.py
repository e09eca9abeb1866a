"""Sampling through the fleet: seeds, stop rules, filters, snapshots, and logprobs equal to forward's."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from tests.helpers import make_batch
from tinkerq import errors, keys, types
from tinkerq.wire import codec, messages

pytestmark = pytest.mark.timeout(180)

PROMPT = types.ModelInput.from_ints([1, 10, 11, 12, 13])
NEVER = "\u2603\u2603"  # a stop string outside the tiny vocabulary: requests that must run to max_tokens


def _forward_logprobs(tc, prompt: types.ModelInput, seq: types.SampledSequence) -> np.ndarray:
    full = prompt.to_ints() + seq.tokens
    datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)})
    out = tc.forward([datum]).result(timeout=60)
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()[prompt.length - 1:]


def test_sampled_logprobs_equal_forward_and_seeds_repeat(training_client):
    tc = training_client
    sampler = tc.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=12, seed=7, temperature=1.0)
    first = sampler.sample(PROMPT, 4, params).result(timeout=60)
    again = sampler.sample(PROMPT, 4, params).result(timeout=60)
    other = sampler.sample(PROMPT, 4, types.SamplingParams(max_tokens=12, seed=8)).result(timeout=60)
    assert len(first.sequences) == 4
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    assert [s.tokens for s in first.sequences] != [s.tokens for s in other.sequences]
    assert len({tuple(s.tokens) for s in first.sequences}) > 1  # samples of one request differ
    for seq in first.sequences:
        assert len(seq.tokens) == len(seq.logprobs) and 1 <= len(seq.tokens) <= 12
        assert seq.stop_reason in ("stop", "length")
        np.testing.assert_allclose(seq.logprobs, _forward_logprobs(tc, PROMPT, seq), atol=1e-4, rtol=0)


def test_stop_tokens_strings_and_greedy(training_client):
    sampler = training_client.save_weights_and_get_sampling_client()
    greedy = sampler.sample(PROMPT, 3, types.SamplingParams(max_tokens=8, temperature=0.0)).result(timeout=60)
    assert len({tuple(s.tokens) for s in greedy.sequences}) == 1  # greedy: every sample the same
    top1 = sampler.sample(PROMPT, 2, types.SamplingParams(max_tokens=8, top_k=1, seed=1)).result(timeout=60)
    assert top1.sequences[0].tokens == greedy.sequences[0].tokens
    nucleus = sampler.sample(PROMPT, 2, types.SamplingParams(max_tokens=8, top_p=1e-6, seed=2)).result(timeout=60)
    assert nucleus.sequences[0].tokens == greedy.sequences[0].tokens  # a tiny nucleus keeps only the argmax

    stop_token = greedy.sequences[0].tokens[2]
    out = sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=8, temperature=0.0, stop=[stop_token]))
    seq = out.result(timeout=60).sequences[0]
    assert seq.stop_reason == "stop" and seq.tokens[-1] == stop_token
    assert stop_token not in seq.tokens[:-1] and len(seq.tokens) <= 3

    from tinkerq.recipes.demo_model import build_tokenizer

    text = build_tokenizer().decode(greedy.sequences[0].tokens[:3])
    out = sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=8, temperature=0.0, stop=text[-1]))
    seq = out.result(timeout=60).sequences[0]
    assert seq.stop_reason == "stop" and len(seq.tokens) <= 3

    capped = sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=3, temperature=0.0, stop=[96]))
    assert capped.result(timeout=60).sequences[0].stop_reason == "length"


def test_sampling_client_keeps_its_snapshot(training_client):
    tc = training_client
    before = tc.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=6, seed=3)
    old = before.sample(PROMPT, 2, params).result(timeout=60)
    data = make_batch(np.random.default_rng(12), 4)
    for _ in range(3):
        tc.forward_backward(data)
        tc.optim_step(types.AdamParams(learning_rate=5e-2))
    # Submitted after the steps, but it samples the snapshot taken before them.
    still = before.sample(PROMPT, 2, params).result(timeout=60)
    assert [s.logprobs for s in still.sequences] == [s.logprobs for s in old.sequences]
    after = tc.save_weights_and_get_sampling_client()
    new = after.sample(PROMPT, 2, params).result(timeout=60)
    assert [s.logprobs for s in new.sequences] != [s.logprobs for s in old.sequences]
    for seq in new.sequences:  # a fresh snapshot sees the trained weights, as forward does
        np.testing.assert_allclose(seq.logprobs, _forward_logprobs(tc, PROMPT, seq), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("prompt", "num", "params", "words"),
    [
        (types.ModelInput.from_ints([]), 1, types.SamplingParams(max_tokens=2), "prompt is empty"),
        (types.ModelInput.from_ints([1, 500]), 1, types.SamplingParams(max_tokens=2), "vocabulary"),
        (PROMPT, 0, types.SamplingParams(max_tokens=2), "num_samples"),
        (PROMPT, 257, types.SamplingParams(max_tokens=2), "TINKERQ_MAX_NUM_SAMPLES"),
        (PROMPT, 1, types.SamplingParams(max_tokens=0), "max_tokens"),
        (PROMPT, 1, types.SamplingParams(max_tokens=10_000), "TINKERQ_MAX_SAMPLE_TOKENS"),
        (PROMPT, 1, types.SamplingParams(max_tokens=5_000), "maximum"),
        (PROMPT, 1, types.SamplingParams(max_tokens=2, temperature=-1), "temperature"),
        (PROMPT, 1, types.SamplingParams(max_tokens=2, top_k=0), "top_k"),
        (PROMPT, 1, types.SamplingParams(max_tokens=2, top_p=0), "top_p"),
        (PROMPT, 1, types.SamplingParams(max_tokens=2, stop=["a", 3]), "mix"),
    ],
)
def test_bad_sampling_requests_are_user_errors(training_client, prompt, num, params, words):
    sampler = training_client.save_weights_and_get_sampling_client()
    err = sampler.sample(prompt, num, params).exception(timeout=30)
    assert isinstance(err, errors.UserError) and words in err.message, err


def post_sample(service, worker: str, body: dict):
    """A sample request sent as the producer would, with whatever body, to one worker's sampling intake."""
    return service._dispatch.submit(
        "sample", codec.packb(body), model_id=uuid.uuid4().hex, seq_id=0, queue=keys.sample_queue(worker),
        decode=messages.decode_sample_response, worker=worker, sequenced=False, argsrepr="")


def test_worker_checks_sampling_too(service, training_client, redis_url):
    """Requests that skipped the producer's checks are refused by the worker, at once, while a batch runs;
    the rows already decoding are not disturbed and the worker keeps serving."""
    import redis

    tc = training_client
    worker = tc.info.worker
    sampler = tc.save_weights_and_get_sampling_client()
    running = sampler.sample(PROMPT, 4, types.SamplingParams(max_tokens=60, seed=5, stop=NEVER))
    source = {"snapshot": sampler.sampler_id}

    def body(**changes):
        b = messages.encode_sample_request(source, PROMPT, 1, types.SamplingParams(max_tokens=2))
        b.update(changes)
        return b

    bad = body()
    bad["params"]["temperature"] = float("nan")
    cases = [
        (bad, errors.UserError, "temperature"),
        (body(source={"snapshot": "0" * 32}), errors.UserError, "not available"),
        (body(source={"snapshot": "../../etc"}), errors.MalformedMessageError, "snapshot id"),
        (body(source={"path": "/etc"}), errors.UserError, "outside"),
        (body(num_samples=100_000), errors.UserError, "TINKERQ_MAX_NUM_SAMPLES"),
        (body(prompt=np.arange(1, 600, dtype=np.int64) % 90 + 1), errors.UserError, "maximum"),
    ]
    futures = [post_sample(service, worker, b) for b, _, _ in cases]
    # Not even a request: garbage in the intake list is dead-lettered, and the worker goes on.
    r = redis.Redis.from_url(redis_url)
    r.lpush(keys.sample_queue(worker), b"\xc1not msgpack")
    r.close()
    for future, (_, kind, words) in zip(futures, cases, strict=True):
        err = future.exception(timeout=30)
        assert isinstance(err, kind) and words in err.message, err
    assert not running.done() or running.exception() is None
    out = running.result(timeout=60)
    for seq in out.sequences:  # the running rows finished untouched
        assert seq.stop_reason == "length" and len(seq.tokens) == 60
        np.testing.assert_allclose(seq.logprobs, _forward_logprobs(tc, PROMPT, seq), atol=1e-4, rtol=0)
    ok = sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=2, seed=0)).result(timeout=30)
    assert len(ok.sequences[0].tokens) == 2 or ok.sequences[0].stop_reason == "stop"


def test_sampling_does_not_wait_for_later_training(training_client):
    """A sample on a snapshot is not queued behind the training requests submitted after it, and the
    training requests still run meanwhile (fair turns): ordering, not timing."""
    tc = training_client
    sampler = tc.save_weights_and_get_sampling_client()
    data = make_batch(np.random.default_rng(21), 16, max_len=60)
    steps = [tc.forward_backward(data) for _ in range(12)]
    sample = sampler.sample(PROMPT, 2, types.SamplingParams(max_tokens=4, seed=1))
    sample.result(timeout=120)
    assert not steps[-1].done(), "the sample waited for every training request submitted before it"
    for step in steps:
        assert np.isfinite(step.result(timeout=120).metrics["loss:sum"])


def test_concurrent_awaits_do_not_block_each_other(training_client):
    """asyncio.gather over sample futures (the cookbook's pattern): a short request's await returns while a
    long one submitted before it is still decoding, in the same batch."""
    import asyncio

    sampler = training_client.save_weights_and_get_sampling_client()
    finished: list[tuple[str, bool]] = []

    async def main() -> None:
        long = sampler.sample(PROMPT, 2, types.SamplingParams(max_tokens=120, seed=3, stop=NEVER))
        short = sampler.sample_async(PROMPT, 2, types.SamplingParams(max_tokens=2, seed=4, stop=NEVER))

        async def wait_long() -> types.SampleResponse:
            out = await long
            finished.append(("long", True))
            return out

        async def wait_short() -> types.SampleResponse:
            out = await short  # a coroutine giving the SampleResponse itself, as Tinker's sample_async
            finished.append(("short", long.done()))
            return out

        long_out, short_out = await asyncio.gather(wait_long(), wait_short())
        assert isinstance(short_out, types.SampleResponse) and len(short_out.sequences[0].tokens) == 2
        assert len(long_out.sequences[0].tokens) == 120

    asyncio.run(main())
    assert finished == [("short", False), ("long", True)]


def test_tinker_conveniences(service, training_client, model_dir):
    tok = training_client.get_tokenizer()
    assert tok.decode(tok.encode("abc", add_special_tokens=False)) == "abc"

"""Sampling through the fleet: seeds, stop rules, filters, snapshots, and logprobs equal to forward's."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import make_batch
from tinkerq import errors, types

pytestmark = pytest.mark.timeout(180)

PROMPT = types.ModelInput.from_ints([1, 10, 11, 12, 13])


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

    from recipes.demo_model import build_tokenizer

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
        (PROMPT, 1, types.SamplingParams(max_tokens=0), "max_tokens"),
        (PROMPT, 1, types.SamplingParams(max_tokens=10_000), "maximum"),
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


def test_worker_checks_sampling_too(training_client):
    """A request that skipped the producer's checks is refused by the worker, which keeps serving."""
    from tinkerq.wire import messages

    tc = training_client
    sampler = tc.save_weights_and_get_sampling_client()
    body = messages.encode_sample_request(sampler.sampler_id, PROMPT, 1, types.SamplingParams(max_tokens=2))
    body["params"]["temperature"] = float("nan")
    err = tc._submit("sample", body, messages.decode_sample_response, argsrepr="").exception(timeout=30)
    assert isinstance(err, errors.UserError) and "temperature" in err.message
    body = messages.encode_sample_request("nope", PROMPT, 1, types.SamplingParams(max_tokens=2))
    err = tc._submit("sample", body, messages.decode_sample_response, argsrepr="").exception(timeout=30)
    assert isinstance(err, errors.UserError) and "no longer held" in err.message
    ok = sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=2, seed=0)).result(timeout=30)
    assert len(ok.sequences[0].tokens) == 2 or ok.sequences[0].stop_reason == "stop"


def test_tinker_conveniences(service, training_client, model_dir):
    tok = training_client.get_tokenizer()
    assert tok.decode(tok.encode("abc", add_special_tokens=False)) == "abc"
    with pytest.raises(errors.UserError, match="create_training_client"):
        service.create_lora_training_client(str(model_dir), rank=16)

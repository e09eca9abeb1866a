"""Prompt logprobs (Tinker's include_prompt_logprobs / compute_logprobs): log p(prompt[i] | prompt[:i]) from the
sampling engine's prefill equals a plain forward's, whatever shares the batch, for every kind of weights."""

from __future__ import annotations

import contextlib
import copy
import threading

import numpy as np
import pytest
import torch

from tests.helpers import VOCAB, load_reference
from tests.test_sampling_engine import NO_STOP, PausingGate, make_job, prompt_of, stepping
from tinkerq import errors, types
from tinkerq.wire import codec, messages
from tinkerq.worker.sampling import TorchEngine, run_jobs

pytestmark = pytest.mark.timeout(120)
ATOL = 1e-5


@pytest.fixture(scope="module")
def model(model_dir):
    return load_reference(model_dir)


def reference(model, prompt: list[int]) -> np.ndarray:
    """The plain definition: one unpadded forward, full logits, log_softmax, gather; NaN at position 0."""
    with torch.no_grad():
        lp = model(input_ids=torch.tensor([prompt])).logits[0].float().log_softmax(-1)  # (P, V)
    out = lp[:-1].gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1).numpy()
    return np.concatenate([[np.nan], out]).astype(np.float32)


def asking(job, into: list):
    """``job`` asking for its prompt logprobs, collected into ``into``."""
    job.on_prompt_logprobs = into.append
    return job


def assert_matches(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape and np.isnan(got[0])
    np.testing.assert_allclose(got[1:], want[1:], atol=ATOL, rtol=0)


# -- the engine -------------------------------------------------------------------------------------------------


def test_variable_lengths_in_one_batch_equal_plain_forward(model):
    """Prompts of many lengths (two the same, one of a single token), any temperature / filter, in one batch."""
    specs = [(1, dict(temperature=1.0)), (3, dict(temperature=0.0)), (17, dict(temperature=0.7, top_k=5)),
             (17, dict(temperature=1.0, top_p=0.5)), (40, dict(temperature=1.3)), (9, dict(temperature=1.0))]
    prompts = [prompt_of(n, i) for i, (n, _) in enumerate(specs)]
    prompts[3] = prompts[2]  # one prompt, two jobs: prefilled once, both told
    collected: list[list[np.ndarray]] = [[] for _ in specs]
    jobs = [asking(make_job(model, p, 2, 4, seed=i, **params), collected[i])
            for i, (p, (_, params)) in enumerate(zip(prompts, specs, strict=True))]
    jobs.append(make_job(model, prompt_of(12, 99), 2, 4, seed=5))  # an ordinary job beside them
    results = run_jobs(None, jobs, timeout=60)
    assert all(len(r) == 2 for r in results)
    for prompt, got in zip(prompts, collected, strict=True):
        (values,) = got  # exactly once per job
        assert_matches(values, reference(model, prompt))


def test_asking_changes_no_token_and_joins_a_running_batch(model):
    """A prompt-logprob job joining a running decode batch of ordinary rows gives the numbers it gives alone, and
    its sampled tokens are those of the same job not asking."""
    prompt = prompt_of(21, 7)
    alone: list[np.ndarray] = []
    (plain,) = run_jobs(None, [make_job(model, prompt, 3, 6, seed=11)])
    (asked,) = run_jobs(None, [asking(make_job(model, prompt, 3, 6, seed=11), alone)])
    assert [s.tokens for s in asked] == [s.tokens for s in plain]
    np.testing.assert_allclose([s.logprobs for s in asked], [s.logprobs for s in plain], atol=ATOL, rtol=0)

    gate = PausingGate(pause_at=3)  # inside the 2nd decode step of the running rows
    engine = TorchEngine()
    with stepping(engine, model, gate):  # a thread of the test steps the engine; run_jobs below steps it too
        done = threading.Event()
        engine.submit(make_job(model, prompt_of(5, 1), 4, 30, seed=3, on_done=lambda *_: done.set()))
        assert gate.reached.wait(30)
        joined: list[np.ndarray] = []
        late = asking(make_job(model, prompt, 3, 6, seed=11), joined)
        # Another prompt of the same length prefilled with it, not asking.
        other = make_job(model, prompt_of(21, 8), 1, 6, seed=2)
        result: list = []
        thread = threading.Thread(target=lambda: result.append(run_jobs(engine, [late, other], timeout=60)))
        thread.start()
        gate.go.set()
        thread.join(60)
        assert done.wait(30)
    (mixed, _), = result
    assert [s.tokens for s in mixed] == [s.tokens for s in plain]
    assert_matches(joined[0], alone[0])
    assert_matches(joined[0], reference(model, prompt))


def test_model_whose_head_cannot_be_fused_uses_its_own_logits(model):
    """A model that transforms its logits gets them from every position's logits (the fallback path)."""
    odd = copy.deepcopy(model)
    odd.config.final_logit_softcapping = 30.0  # read by fused_head_support (Llama itself ignores it)
    got: list[np.ndarray] = []
    prompt = prompt_of(13, 4)
    run_jobs(None, [asking(make_job(odd, prompt, 1, 2, key="odd"), got), make_job(odd, prompt_of(13, 5), 1, 2,
                                                                                   key="odd")])
    assert_matches(got[0], reference(model, prompt))


def test_lora_adapter_rows_including_the_output_projection(model_dir):
    """Rows of different adapters over one base (one adapting the output projection) each get their adapter's
    numbers: those of the base forward routed to that adapter alone."""
    from tinkerq.worker.lora import routing
    from tinkerq.worker.lora.session import LoraBase, LoraSession
    from tinkerq.worker.training.logprobs import LogprobComputer

    base = load_reference(model_dir)
    lora = LoraBase(base, LogprobComputer(base, "torch"), model_dir=str(model_dir), microbatch_tokens=64)
    adapters = []
    for seed, flags in ((1, {}), (2, dict(train_unembed=False))):
        session = LoraSession(f"s{seed}", lora, types.LoraConfig(rank=4, seed=seed, **flags), base_model="tiny")
        with torch.no_grad():
            for p in session.engine.params:  # B starts at zero: move every matrix so the adapter matters
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + p.numel())), alpha=0.3)
        adapters.append(session.adapter.frozen())
    prompts = [prompt_of(15, 1), prompt_of(15, 1), prompt_of(6, 2)]
    got: list[list[np.ndarray]] = [[], [], []]
    jobs = [asking(make_job(base, prompts[0], 1, 3, seed=1), got[0]),
            asking(make_job(base, prompts[1], 2, 3, seed=2), got[1]),
            asking(make_job(base, prompts[2], 1, 3, seed=3), got[2])]
    jobs[0].adapter, jobs[1].adapter = adapters  # one prompt under two adapters: two prefill rows
    run_jobs(None, jobs, timeout=60)
    for prompt, adapter, values in zip(prompts, [*adapters, None], got, strict=True):
        with routing.routed([(adapter, slice(0, 1))]) if adapter is not None else contextlib.nullcontext():
            want = reference(base, prompt)
        assert_matches(values[0], want)
    assert not np.allclose(got[0][0][1:], got[1][0][1:], atol=1e-3)  # the adapters do differ


def test_nothing_is_computed_unless_asked_and_no_hook_stays(model, monkeypatch):
    from tinkerq.worker.sampling import prompt_logprobs

    calls = []
    monkeypatch.setattr(prompt_logprobs, "from_hidden", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(prompt_logprobs, "from_logits", lambda *a, **k: calls.append(a))
    (seqs,) = run_jobs(None, [make_job(model, prompt_of(8, 3), 1, 3, stop=NO_STOP)])
    assert len(seqs) == 1 and not calls
    monkeypatch.undo()
    got: list[np.ndarray] = []
    run_jobs(None, [asking(make_job(model, prompt_of(8, 3), 1, 3), got)])
    assert len(got) == 1 and not model.base_model._forward_hooks  # the capture hook is gone after the prefill


# -- the wire ---------------------------------------------------------------------------------------------------


def test_wire_request_and_reply():
    prompt = types.ModelInput.from_ints([3, 4, 5])
    params = types.SamplingParams(max_tokens=1)
    plain = codec.unpackb(codec.packb(messages.encode_sample_request({"base": True}, prompt, 1, params)))
    assert "prompt_logprobs" not in plain and messages.decode_sample_request(plain).prompt_logprobs is False
    body = codec.unpackb(codec.packb(messages.encode_sample_request({"base": True}, prompt, 2, params,
                                                                    prompt_logprobs=True)))
    request = messages.decode_sample_request(body)
    assert request.prompt_logprobs is True and request.num_samples == 2 and request.prompt.to_ints() == [3, 4, 5]
    for bad in (1, "yes", None):
        with pytest.raises(errors.MalformedMessageError, match="prompt_logprobs"):
            messages.decode_sample_request({**body, "prompt_logprobs": bad})

    seq = types.SampledSequence(stop_reason="length", tokens=[7], logprobs=[-1.5])
    reply = messages.encode_sample_response(types.SampleResponse([seq], prompt_logprobs=[None, -0.25, -3.0]))
    raw = codec.unpackb(codec.packb(reply))
    assert raw["prompt_logprobs"].dtype == np.float32 and np.isnan(raw["prompt_logprobs"][0])
    decoded = messages.decode_sample_response(raw)
    assert decoded.prompt_logprobs == [None, -0.25, -3.0] and decoded.sequences[0].tokens == [7]
    none = messages.decode_sample_response(codec.unpackb(codec.packb(
        messages.encode_sample_response(types.SampleResponse([seq])))))
    assert none.prompt_logprobs is None
    for bad in (np.zeros((2, 2), np.float32), np.zeros(0, np.float32), [0.0, 1.0]):
        with pytest.raises(errors.MalformedMessageError):
            messages.decode_sample_response({**raw, "prompt_logprobs": bad})


# -- through a worker -------------------------------------------------------------------------------------------


def test_worker_answers_prompt_logprobs_for_snapshot_path_and_base(training_client, model_dir):
    """compute_logprobs as Tinker sends it (max_tokens=1, prompt logprobs) through a real worker: a snapshot, a
    saved path and the base model each give their weights' numbers (the first two equal forward's)."""
    from tests.helpers import make_batch
    from tests.test_sampling import post_sample

    tc = training_client
    tc.forward_backward(make_batch(np.random.default_rng(3), 3))
    tc.optim_step(types.AdamParams(learning_rate=5e-2))
    snapshot = tc.save_weights_and_get_sampling_client().sampler_id
    path = tc.save_weights_for_sampler("prompt-logprobs").result(timeout=60).path
    prompt = types.ModelInput.from_ints(np.random.default_rng(4).integers(0, VOCAB, 23).tolist())
    ids = prompt.to_ints()
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
    trained = tc.forward([datum]).result(timeout=60).loss_fn_outputs[0]["logprobs"].to_numpy()
    base = reference(load_reference(model_dir), ids)[1:]
    params = types.SamplingParams(max_tokens=1, temperature=0.7, seed=1)
    for source, want in (({"snapshot": snapshot}, trained), ({"path": path}, trained), ({"base": True}, base)):
        body = messages.encode_sample_request(source, prompt, 2, params, prompt_logprobs=True)
        out = post_sample(tc.service, tc.info.worker, body).result(timeout=60)
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids), source
        assert out.prompt_logprobs[0] is None and len(out.sequences) == 2
        np.testing.assert_allclose(out.prompt_logprobs[1:], want, atol=1e-4, rtol=0, err_msg=str(source))
    plain = messages.encode_sample_request({"base": True}, prompt, 1, params)
    assert post_sample(tc.service, tc.info.worker, plain).result(timeout=60).prompt_logprobs is None

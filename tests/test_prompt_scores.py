"""Tinker's per-position options in the sampling engine, in process: top-k of prompt and sampled positions, target
ids and alternative tokens equal a plain forward's numbers whatever shares the batch (other options, jobs joining a
running batch, a model whose head cannot be fused, LoRA adapters on the output projection), asking changes no
sampled token, and the wire carries every field. Through a real worker, the gateway and the SDK:
tests/test_sdk_sampling_options.py."""

from __future__ import annotations

import contextlib
import copy
import threading

import numpy as np
import pytest
import torch

from tests.helpers import load_reference
from tests.test_sampling_engine import PausingGate, make_job, prompt_of, stepping
from tinkerq import types
from tinkerq.validation import PromptOptions
from tinkerq.wire import codec, messages
from tinkerq.worker.sampling import TorchEngine, run_jobs

pytestmark = pytest.mark.timeout(120)
ATOL = 1e-4


@pytest.fixture(scope="module")
def model(model_dir):
    return load_reference(model_dir)


def lsm_of(model, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), V): row i is log p(. | tokens[:i + 1]), one plain forward, full float32 logits."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def scoring(job, options: PromptOptions, into: list):
    job.options = options
    if options.asks_prompt():
        job.on_prompt_scores = into.append
    return job


def check_topk(topk: types.TopkLogprobs, lsm: torch.Tensor, k: int) -> None:
    assert topk.token_ids.shape == topk.logprobs.shape == (lsm.shape[0], k)
    values, ids = lsm.topk(k, dim=-1)
    assert (topk.token_ids == ids.numpy()).all()
    np.testing.assert_allclose(topk.logprobs, values.numpy(), atol=ATOL, rtol=0)


def check_prompt(model, prompt: list[int], options: PromptOptions, scores) -> None:
    lsm = lsm_of(model, prompt)[:-1]  # row i predicts prompt[i + 1]
    if options.topk_prompt:
        assert (scores.topk.token_ids[0] == 0).all() and (scores.topk.logprobs[0] == types.TOPK_MASK_LOGPROB).all()
        check_topk(types.TopkLogprobs(scores.topk.token_ids[1:], scores.topk.logprobs[1:]), lsm, options.topk_prompt)
    if options.targets is not None:
        ids = torch.from_numpy(options.targets)
        want = lsm.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, 0.0).numpy()
        np.testing.assert_allclose(scores.targets, want, atol=ATOL, rtol=0)
    if options.alt_k:
        assert scores.alt_tokens.shape == (len(prompt) - 1, options.alt_k)
        np.testing.assert_allclose(scores.alt_logprobs, lsm.gather(-1, torch.from_numpy(scores.alt_tokens)).numpy(),
                                   atol=ATOL, rtol=0)


def check_sampled(model, prompt: list[int], seqs: list[types.SampledSequence], k: int) -> None:
    for seq in seqs:
        check_topk(seq.topk_logprobs, lsm_of(model, prompt + seq.tokens)[len(prompt) - 1:-1], k)


def targets_for(prompt: list[int], width: int, seed: int) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(0, 97, size=(len(prompt) - 1, width))
    ids[::2, -1] = -1
    return ids


def test_every_option_in_one_batch_equals_a_plain_forward(model):
    prompts = [prompt_of(n, i) for i, n in enumerate((2, 9, 9, 23, 14))]
    options = [PromptOptions(topk_prompt=4, topk_sample=2), PromptOptions(topk_sample=5),
               PromptOptions(targets=targets_for(prompts[2], 3, 1), alt_k=6),
               PromptOptions(topk_prompt=1, targets=targets_for(prompts[3], 2, 2), alt_k=2, topk_sample=1),
               PromptOptions()]
    got: list[list] = [[] for _ in prompts]
    jobs = [scoring(make_job(model, p, 2, 5, seed=i, temperature=[1.0, 0.7, 0.0, 1.3, 1.0][i]), o, got[i])
            for i, (p, o) in enumerate(zip(prompts, options, strict=True))]
    results = run_jobs(None, jobs, timeout=60)
    for prompt, option, seqs, scores in zip(prompts, options, results, got, strict=True):
        if option.asks_prompt():
            (one,) = scores  # told exactly once
            check_prompt(model, prompt, option, one)
        else:
            assert not scores
        if option.topk_sample:
            check_sampled(model, prompt, seqs, option.topk_sample)
        else:
            assert all(s.topk_logprobs is None for s in seqs)


def test_asking_changes_no_token_and_a_job_joining_a_running_batch_gets_the_same(model):
    prompt = prompt_of(17, 3)
    option = PromptOptions(topk_prompt=3, topk_sample=4, alt_k=5, targets=targets_for(prompt, 2, 5))
    (plain,) = run_jobs(None, [make_job(model, prompt, 3, 6, seed=11)])
    alone: list = []
    (asked,) = run_jobs(None, [scoring(make_job(model, prompt, 3, 6, seed=11), option, alone)])
    assert [s.tokens for s in asked] == [s.tokens for s in plain]
    check_sampled(model, prompt, asked, 4)
    check_prompt(model, prompt, option, alone[0])

    gate = PausingGate(pause_at=3)
    engine = TorchEngine()
    with stepping(engine, model, gate):
        done = threading.Event()
        engine.submit(make_job(model, prompt_of(5, 1), 4, 30, seed=3, on_done=lambda *_: done.set()))
        assert gate.reached.wait(30)
        joined: list = []
        result: list = []
        late = scoring(make_job(model, prompt, 3, 6, seed=11), option, joined)
        thread = threading.Thread(target=lambda: result.append(run_jobs(engine, [late], timeout=60)))
        thread.start()
        gate.go.set()
        thread.join(60)
        assert done.wait(30)
    ((mixed,),) = result
    assert [s.tokens for s in mixed] == [s.tokens for s in plain]
    check_sampled(model, prompt, mixed, 4)
    check_prompt(model, prompt, option, joined[0])
    # Seeded alternative tokens are the same draws whatever the batch.
    assert (joined[0].alt_tokens == alone[0].alt_tokens).all()


def test_model_whose_head_cannot_be_fused_scores_from_its_own_logits(model):
    odd = copy.deepcopy(model)
    odd.config.final_logit_softcapping = 30.0  # read by fused_head_support (Llama itself ignores it)
    prompt = prompt_of(13, 4)
    option = PromptOptions(topk_prompt=3, targets=targets_for(prompt, 2, 7), alt_k=3)
    got: list = []
    run_jobs(None, [scoring(make_job(odd, prompt, 1, 2, key="odd"), option, got)])
    check_prompt(model, prompt, option, got[0])


def test_lora_adapter_on_the_output_projection(model_dir):
    from tinkerq.worker.lora import routing
    from tinkerq.worker.lora.session import LoraBase, LoraSession
    from tinkerq.worker.training.logprobs import LogprobComputer

    base = load_reference(model_dir)
    lora = LoraBase(base, LogprobComputer(base, "torch"), model_dir=str(model_dir), microbatch_tokens=64)
    session = LoraSession("s1", lora, types.LoraConfig(rank=4, seed=1), base_model="tiny")
    with torch.no_grad():
        for p in session.engine.params:  # B starts at zero: move every matrix so the adapter matters
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())), alpha=0.3)
    adapter = session.adapter.frozen()
    prompt = prompt_of(15, 1)
    option = PromptOptions(topk_prompt=3, targets=targets_for(prompt, 2, 9), alt_k=2, topk_sample=2)
    got: list = []
    job = scoring(make_job(base, prompt, 1, 3, seed=1), option, got)
    job.adapter = adapter
    (seqs,) = run_jobs(None, [job, make_job(base, prompt, 1, 3, seed=2)], timeout=60)[:1]
    with routing.routed([(adapter, slice(0, 1))]):
        check_prompt(base, prompt, option, got[0])
        check_sampled(base, prompt, seqs, 2)
    with contextlib.suppress(AssertionError):  # the adapter does change the numbers
        check_prompt(base, prompt, option, got[0])
        pytest.fail("the adapter's scores equal the base model's")


def test_the_wire_carries_every_option_and_answer():
    prompt = types.ModelInput.from_ints([1, 2, 3, 4])
    ids = np.array([[5, -1], [6, 7], [-1, 8]])
    options = PromptOptions(topk_prompt=2, topk_sample=3, targets=ids, alt_k=4)
    params = types.SamplingParams(max_tokens=2)
    body = codec.unpackb(codec.packb(messages.encode_sample_request({"base": True}, prompt, 1, params,
                                                                    options=options)))
    request = messages.decode_sample_request(body)
    assert (request.options.topk_prompt, request.options.topk_sample, request.options.alt_k) == (2, 3, 4)
    assert (request.options.targets == ids).all()
    plain = messages.decode_sample_request(codec.unpackb(codec.packb(messages.encode_sample_request(
        {"base": True}, prompt, 1, types.SamplingParams(max_tokens=2)))))
    assert plain.options == PromptOptions()
    topk = types.TopkLogprobs(np.array([[0, 0], [3, 9]], dtype=np.int32),
                              np.array([[types.TOPK_MASK_LOGPROB] * 2, [-0.5, -1.5]], dtype=np.float32))
    response = types.SampleResponse(
        sequences=[types.SampledSequence("length", [4, 5], [-1.0, -2.0], topk_logprobs=topk)],
        topk_prompt_logprobs=topk, target_prompt_logprobs=types.TensorData(np.ones((3, 2)), "float32"),
        prompt_alt_tokens=types.PromptAltTokens(types.TensorData(np.ones((3, 4)), "int64"),
                                                types.TensorData(np.zeros((3, 4)), "float32")))
    back = messages.decode_sample_response(codec.unpackb(codec.packb(messages.encode_sample_response(response))))
    assert back.topk_prompt_logprobs.to_lists() == [None, [(3, -0.5), (9, -1.5)]]
    assert back.sequences[0].topk_logprobs.to_lists() == [None, [(3, -0.5), (9, -1.5)]]
    assert (back.target_prompt_logprobs.to_numpy() == 1).all()
    assert back.prompt_alt_tokens.tokens.to_numpy().shape == (3, 4)

"""LoRA sessions through a real worker process: many tenants pipelining at once, checkpoints, sampling, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import requests
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import make_batch, reference_logprobs
from tinkerq import errors, types
from tinkerq.wire import messages

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(300)
ADAM = types.AdamParams(learning_rate=2e-2, weight_decay=0.05, grad_clip_norm=1.0)


def _metric(url: str, name: str) -> float:
    text = requests.get(url, timeout=10).text
    return float(text.split(f"\n{name} ")[1].split()[0])


def _train(tc, batches):
    """fb + optim_step per batch, all submitted before any result is read (pipelined)."""
    futures = [(tc.forward_backward(b, "cross_entropy"), tc.optim_step(ADAM)) for b in batches]
    return [(fb.result(timeout=120), step.result(timeout=120)) for fb, step in futures]


def test_sixteen_tenants_pipelining_at_once_each_equal_to_training_alone(service, worker, model_dir):
    rng = np.random.default_rng(21)
    plans = [[make_batch(rng, int(rng.integers(1, 3)), max_len=24) for _ in range(2)] for _ in range(16)]
    tenants = [service.create_lora_training_client(str(model_dir), rank=4, seed=100 + i) for i in range(16)]
    lora = tenants[0].get_info().extra["lora"]
    assert lora["rank"] == 4 and lora["seed"] == 100 and lora["trainable_parameters"] > 0
    assert lora["state_bytes"] == 16 * lora["trainable_parameters"]
    passes_before = _metric(worker.metrics_url, "tinkerq_lora_passes")
    requests_before = _metric(worker.metrics_url, "tinkerq_lora_pass_requests")
    futures = [[(tc.forward_backward(b, "cross_entropy"), tc.optim_step(ADAM)) for b in plan]
               for tc, plan in zip(tenants, plans, strict=True)]  # every tenant's requests in flight at once
    together = [[(fb.result(timeout=120), st.result(timeout=120)) for fb, st in f] for f in futures]
    passes = _metric(worker.metrics_url, "tinkerq_lora_passes") - passes_before
    held = _metric(worker.metrics_url, "tinkerq_lora_pass_requests") - requests_before
    assert held == 32 and passes < held  # requests of different tenants shared passes
    for i, plan in enumerate(plans):
        alone = service.create_lora_training_client(str(model_dir), rank=4, seed=100 + i)
        for (fb_a, st_a), (fb_b, st_b) in zip(_train(alone, plan), together[i], strict=True):
            assert fb_b.metrics["loss:sum"] == pytest.approx(fb_a.metrics["loss:sum"], rel=1e-6)
            for x, y in zip(fb_a.loss_fn_outputs, fb_b.loss_fn_outputs, strict=True):
                np.testing.assert_allclose(x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), rtol=1e-6, atol=1e-6)
            assert st_b.metrics["grad_norm:mean"] == pytest.approx(st_a.metrics["grad_norm:mean"], rel=1e-5)
        alone.close()
    for tc in tenants:
        tc.close()


def test_state_resumes_on_a_new_client_and_sampling_works(service, model_dir, checkpoint_dir):
    rng = np.random.default_rng(22)
    batches = [make_batch(rng, 2, max_len=24) for _ in range(4)]
    tc = service.create_lora_training_client(str(model_dir), rank=8, seed=5, train_attn=False)
    _train(tc, batches[:2])
    path = tc.save_state("lora-mid").result(timeout=60).path
    resumed = service.create_training_client_from_state_with_optimizer(path)
    assert resumed.get_info().extra["lora"]["rank"] == 8 and resumed.get_info().extra["lora"]["train_attn"] is False
    a, b = _train(tc, batches[2:]), _train(resumed, batches[2:])
    for (fa, sa), (fb, sb) in zip(a, b, strict=True):
        assert fa.metrics["loss:sum"] == fb.metrics["loss:sum"] and sa.metrics == sb.metrics

    # The PEFT adapter on disk gives the session's own logprobs.
    data = make_batch(rng, 2, max_len=24)
    ours = tc.forward(data, "cross_entropy").result(timeout=60)
    saved = tc.save_weights_for_sampler("lora-final", merged=True).result(timeout=60).path
    oracle = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), saved).eval()
    merged = AutoModelForCausalLM.from_pretrained(f"{saved}/merged").eval()
    with torch.no_grad():
        for d, o in zip(data, ours.loss_fn_outputs, strict=True):
            for model in (oracle, merged):
                np.testing.assert_allclose(reference_logprobs(model, d).numpy(), o["logprobs"].to_numpy(),
                                           rtol=1e-5, atol=1e-5)

    # Sampling: a snapshot, the saved adapter directory and the base, side by side; logprobs are the adapter's.
    prompt = types.ModelInput.from_ints([3, 1, 4, 1, 5])
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=9)
    snap = tc.save_weights_and_get_sampling_client()
    from_path = service.create_sampling_client(model_path=saved)
    base = service.create_sampling_client(base_model=str(model_dir))
    s1, s2, s3 = (c.sample(prompt, 2, params) for c in (snap, from_path, base))
    snap_out, path_out, base_out = s1.result(timeout=60), s2.result(timeout=60), s3.result(timeout=60)
    assert [s.tokens for s in snap_out.sequences] == [s.tokens for s in path_out.sequences]
    seq = snap_out.sequences[0]
    full = torch.tensor([prompt.to_ints() + seq.tokens])
    with torch.no_grad():
        expected = torch.log_softmax(merged(input_ids=full).logits[0].float(), -1)
    n = prompt.length
    want = [float(expected[n - 1 + i, t]) for i, t in enumerate(seq.tokens)]
    np.testing.assert_allclose(seq.logprobs, want, rtol=1e-4, atol=1e-4)
    assert len(base_out.sequences) == 2
    for c in (tc, resumed):
        c.close()


def test_lora_refusals_are_clear_user_errors(service, training_client, model_dir):
    with pytest.raises(errors.ValidationError, match="at least one of"):
        service.create_lora_training_client(str(model_dir), train_mlp=False, train_attn=False, train_unembed=False)
    with pytest.raises(errors.ValidationError, match="rank must be an integer from 1"):
        service.create_lora_training_client(str(model_dir), rank=0)
    lora = service.create_lora_training_client(str(model_dir), rank=4)
    full_state = training_client.save_state("full-for-lora").result(timeout=60).path
    lora_state = lora.save_state("lora-for-full").result(timeout=60).path
    with pytest.raises(errors.ValidationError, match="cannot load into a LoRA session"):
        lora.load_state(full_state).result(timeout=60)
    with pytest.raises(errors.ValidationError, match="cannot load into a full-parameter session"):
        training_client.load_state(lora_state).result(timeout=60)
    other_rank = service.create_lora_training_client(str(model_dir), rank=8)
    with pytest.raises(errors.ValidationError, match="rank=4"):
        other_rank.load_state(lora_state).result(timeout=60)
    # A bad batch that skipped the producer's checks is refused by the worker in order, before any pass, and
    # the session's next requests run.
    bad = types.Datum(model_input=types.ModelInput.from_ints([1, 10_000]),
                      loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]})
    body = messages.encode_loss_request([bad], "cross_entropy", None)
    refused = lora._submit("forward_backward", body, messages.decode_forward_backward_output, argsrepr="test")
    with pytest.raises(errors.ValidationError, match="10000"):
        refused.result(timeout=60)
    # Both sessions keep serving.
    data = make_batch(np.random.default_rng(3), 1)
    assert lora.forward_backward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0
    assert training_client.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0
    for c in (lora, other_rank):
        c.close()

"""The fleet's numbers equal a plain-PyTorch reference on the same weights (real Redis, real worker)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import WORKER_MICROBATCH_TOKENS
from tests.helpers import (
    RL_CONFIGS,
    load_reference,
    make_batch,
    max_weight_diff,
    reference_logprobs,
    reference_step,
    rl_batch,
)
from tinkerq import types

pytestmark = pytest.mark.timeout(180)


def test_logprobs_and_loss_match_reference(training_client, model_dir):
    rng = np.random.default_rng(1)
    data = make_batch(rng, 7, min_len=2, max_len=60)
    assert len({d.model_input.length for d in data}) > 3  # really different lengths
    assert sum(d.model_input.length for d in data) > WORKER_MICROBATCH_TOKENS  # several micro-batches

    out = training_client.forward(data, "cross_entropy").result(timeout=60)

    ref = load_reference(model_dir)
    assert out.loss_fn_output_type == "cross_entropy"
    assert len(out.loss_fn_outputs) == len(data)
    expected_total = 0.0
    with torch.no_grad():
        for d, o in zip(data, out.loss_fn_outputs, strict=True):
            expected = reference_logprobs(ref, d).numpy()
            got = o["logprobs"].to_numpy()
            assert got.shape == (d.model_input.length,)
            np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
            weights = d.loss_fn_inputs["weights"].to_numpy()
            np.testing.assert_allclose(o["elementwise_loss"].to_numpy(), -expected * weights, atol=1e-5, rtol=0)
            expected_total += float((-expected * weights).sum())
    assert out.metrics["loss:sum"] == pytest.approx(expected_total, rel=1e-5)
    assert all(k.count(":") == 1 for k in out.metrics)


def test_forward_backward_then_optim_step_matches_adamw(training_client, model_dir):
    rng = np.random.default_rng(2)
    data = make_batch(rng, 6)
    adam = types.AdamParams(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=0.5)

    fb = training_client.forward_backward(data, "cross_entropy")
    opt = training_client.optim_step(adam)
    fb_out, opt_out = fb.result(timeout=60), opt.result(timeout=60)

    ref = load_reference(model_dir)
    ref_opt = torch.optim.AdamW(ref.parameters())
    norm = reference_step(ref, ref_opt, [data], adam)
    assert opt_out.metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-5)
    assert norm > adam.grad_clip_norm  # clipping really happened
    saved = training_client.save_weights_for_sampler("after-one-step").result(timeout=60).path
    assert max_weight_diff(ref, saved) < 1e-6
    assert np.isfinite(fb_out.metrics["loss:sum"])


def test_gradient_accumulation_does_not_depend_on_split(service, model_dir):
    """One forward_backward of a batch == the same batch in three calls (losses are sums)."""
    rng = np.random.default_rng(3)
    data = make_batch(rng, 9)
    adam = types.AdamParams(learning_rate=5e-3)
    whole = service.create_training_client(str(model_dir))
    split = service.create_training_client(str(model_dir))
    try:
        whole.forward_backward(data)
        whole_norm = whole.optim_step(adam).result(timeout=60).metrics["grad_norm:mean"]
        for part in (data[:2], data[2:7], data[7:]):
            split.forward_backward(part)
        split_norm = split.optim_step(adam).result(timeout=60).metrics["grad_norm:mean"]
        assert split_norm == pytest.approx(whole_norm, rel=1e-5)
        a = whole.save_weights_for_sampler("whole").result(timeout=60).path
        b = split.save_weights_for_sampler("split").result(timeout=60).path
        from transformers import AutoModelForCausalLM

        assert max_weight_diff(AutoModelForCausalLM.from_pretrained(a), b) < 1e-6
    finally:
        whole.close()
        split.close()


def test_thirty_pipelined_steps_match_sequential_reference(training_client, model_dir):
    rng = np.random.default_rng(4)
    batches = [make_batch(rng, int(rng.integers(1, 5)), max_len=24) for _ in range(30)]
    adam = types.AdamParams(learning_rate=3e-3, beta2=0.99, eps=1e-8)

    futures = []
    for batch in batches:  # submit everything, wait for nothing
        futures.append((training_client.forward_backward(batch), training_client.optim_step(adam)))
    losses = [fb.result(timeout=120).metrics["loss:sum"] for fb, _ in futures]
    norms = [opt.result(timeout=120).metrics["grad_norm:mean"] for _, opt in futures]

    ref = load_reference(model_dir)
    ref_opt = torch.optim.AdamW(ref.parameters())
    for i, batch in enumerate(batches):
        with torch.no_grad():
            from tests.helpers import reference_loss

            assert losses[i] == pytest.approx(float(reference_loss(ref, batch)), rel=1e-4, abs=1e-4), i
        assert norms[i] == pytest.approx(reference_step(ref, ref_opt, [batch], adam), rel=1e-4), i
    saved = training_client.save_weights_for_sampler("pipelined").result(timeout=60).path
    assert max_weight_diff(ref, saved) < 1e-5


def _reference_rl_loss(loss_fn, config, t, inputs, mask):
    s = torch.from_numpy(np.array(inputs["logprobs"].to_numpy()))
    A = torch.from_numpy(np.array(inputs["advantages"].to_numpy()))
    r = torch.exp(t - s)
    if loss_fn == "importance_sampling":
        return -(r * A)
    if loss_fn in ("ppo", "cispo", "gspo"):
        lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
        if loss_fn == "ppo":
            return -torch.minimum(r * A, torch.clamp(r, lo, hi) * A)
        if loss_fn == "cispo":
            return -(torch.clamp(r, lo, hi).detach() * t * A)
        m = torch.from_numpy(mask)
        seq = torch.exp(((t - s) * m).sum() / m.sum())
        return -torch.minimum(seq * A, torch.clamp(seq, lo, hi) * A)
    return -(t * A - 0.5 * config["beta"] * (t - s) ** 2)


@pytest.mark.parametrize("loss_fn", sorted(RL_CONFIGS))
def test_rl_losses_through_the_fleet_match_reference(training_client, model_dir, loss_fn):
    config = RL_CONFIGS[loss_fn]
    ref = load_reference(model_dir)
    rows = rl_batch(ref, np.random.default_rng(13))
    data = []
    for model_input, inputs, mask in rows:
        if loss_fn == "gspo":
            inputs = {**inputs, "sequence_ratio_mask": mask}
        data.append(types.Datum(model_input=model_input, loss_fn_inputs=inputs))

    scored = training_client.forward(data, loss_fn, config).result(timeout=60)  # forward works for every loss
    fb = training_client.forward_backward(data, loss_fn, config)
    adam = types.AdamParams(learning_rate=1e-2)
    step = training_client.optim_step(adam)
    out = fb.result(timeout=60)
    assert out.metrics["loss:sum"] == pytest.approx(scored.metrics["loss:sum"], rel=1e-6)

    total = torch.zeros(())
    for d, o, (_, _, mask) in zip(data, out.loss_fn_outputs, rows, strict=True):
        t = reference_logprobs(ref, d)
        per_token = _reference_rl_loss(loss_fn, config, t, d.loss_fn_inputs, mask)
        np.testing.assert_allclose(o["logprobs"].to_numpy(), t.detach().numpy(), atol=1e-5)
        np.testing.assert_allclose(o["elementwise_loss"].to_numpy(), per_token.detach().numpy(), atol=1e-5)
        total = total + per_token.sum()
    assert out.metrics["loss:sum"] == pytest.approx(float(total.detach()), rel=1e-5, abs=1e-5)
    assert all(k.count(":") == 1 for k in out.metrics)
    if loss_fn in ("ppo", "cispo"):
        assert 0 < out.metrics["clip_fraction:mean"] < 1

    ref_opt = torch.optim.AdamW(ref.parameters())
    total.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    for group in ref_opt.param_groups:
        group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps, weight_decay=0.0)
    ref_opt.step()
    assert step.result(timeout=60).metrics["grad_norm:mean"] == pytest.approx(float(norm), rel=1e-4)
    saved = training_client.save_weights_for_sampler(f"after-{loss_fn}").result(timeout=60).path
    assert max_weight_diff(ref, saved) < 1e-5


def test_worker_reports_its_loss_head(training_client, service, model_dir):
    assert training_client.info.extra["loss_backend"] == "torch"  # auto on CPU: the chunked torch kernel
    registrations = service.connection.workers_serving(str(model_dir))
    assert registrations and all(r["loss_backend"] == "torch" for r in registrations)


def test_results_carry_timing(training_client):
    data = make_batch(np.random.default_rng(30), 3)
    fb = training_client.forward_backward(data)
    opt = training_client.optim_step(types.AdamParams(learning_rate=1e-3))
    fb.result(timeout=60)
    opt.result(timeout=60)
    tokens = sum(d.model_input.length for d in data)
    assert fb.timing["tokens"] == tokens and fb.timing["compute_s"] > 0
    assert fb.timing["tokens_per_s"] == pytest.approx(tokens / fb.timing["compute_s"], rel=1e-6)
    assert 0 <= fb.timing["queue_wait_s"] < 60
    assert opt.timing["compute_s"] > 0 and "tokens_per_s" not in opt.timing

"""The fleet's numbers equal a plain-PyTorch reference on the same weights (real Redis, real worker)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import WORKER_MICROBATCH_TOKENS
from tests.helpers import load_reference, make_batch, max_weight_diff, reference_logprobs, reference_step
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

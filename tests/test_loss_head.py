"""The fused loss head: the chunked autograd Function against the full-logits reference, gradcheck, the apex
backend through a test double of its documented contract (and the real kernel where CUDA + apex exist),
and the Hugging Face model families users bring."""

from __future__ import annotations

import sys
import types as pytypes

import pytest
import torch

from tinkerq.worker.loss_head import target_logprobs_from_hidden
from tinkerq.worker.loss_head.apex import ApexChunkKernel, load_apex_xentropy
from tinkerq.worker.loss_head.backends import BackendUnavailable, resolve_backend
from tinkerq.worker.loss_head.chunked import chunked_target_logprobs
from tinkerq.worker.loss_head.reference import reference_target_logprobs


def _problem(n=37, h=16, v=53, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[0] = 0  # token 0 is a real token (apex's padding_idx trap)
    return hidden, weight, targets


def test_gradcheck_float64():
    hidden, weight, targets = _problem(n=11, h=5, v=7)
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_target_logprobs(h, w, targets, chunk_tokens=4), (hidden, weight), eps=1e-6, atol=1e-7
    )


def test_gradcheck_with_a_low_rank_term_and_a_frozen_weight():
    """The LoRA output-projection term (worker/training/logprobs.py): gradients reach hidden, low and low_weight; the
    frozen weight gets none (its V x H gradient is never computed)."""
    hidden, weight, targets = _problem(n=11, h=5, v=7)
    weight = weight.detach()
    g = torch.Generator().manual_seed(1)
    low = torch.randn(11, 3, generator=g, dtype=torch.float64, requires_grad=True)
    low_weight = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda h, lo, lw: chunked_target_logprobs(h, weight, targets, chunk_tokens=4, low_rank=(lo, lw)),
        (hidden, low, low_weight), eps=1e-6, atol=1e-7)
    got = chunked_target_logprobs(hidden, weight, targets, chunk_tokens=4, low_rank=(low, low_weight))
    ref = reference_target_logprobs(torch.cat([hidden, low], -1), torch.cat([weight, low_weight], 1), targets)
    torch.testing.assert_close(got.double(), ref.double())


@pytest.mark.parametrize("chunk_tokens", [1, 5, 16, 36, 37, 1000])  # 37 tokens: partial last chunks, one chunk
def test_chunked_equals_reference_values_and_gradients(chunk_tokens):
    hidden, weight, targets = _problem(dtype=torch.float32)
    upstream = torch.randn(hidden.shape[0])  # a non-uniform incoming gradient, e.g. weights / advantages
    ref = reference_target_logprobs(hidden, weight, targets)
    ref_gh, ref_gw = torch.autograd.grad((ref * upstream).sum(), (hidden, weight))
    got = chunked_target_logprobs(hidden, weight, targets, chunk_tokens=chunk_tokens)
    gh, gw = torch.autograd.grad((got * upstream).sum(), (hidden, weight))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gh, ref_gh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw, ref_gw, atol=1e-5, rtol=1e-5)


def test_bfloat16_is_computed_in_float32():
    hidden, weight, targets = _problem(dtype=torch.float32)
    ref = reference_target_logprobs(hidden.bfloat16().float(), weight.bfloat16().float(), targets)
    got = chunked_target_logprobs(hidden.bfloat16(), weight.bfloat16(), targets, chunk_tokens=8)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=3e-2, rtol=1e-2)


def test_only_the_needed_gradient_is_computed():
    hidden, weight, targets = _problem(dtype=torch.float32)
    weight = weight.detach()
    (gh,) = torch.autograd.grad(chunked_target_logprobs(hidden, weight, targets, chunk_tokens=8).sum(), (hidden,))
    assert gh.shape == hidden.shape


class _FakeApexXentropy(torch.autograd.Function):
    """A test double with apex's documented contract: unreduced float32 per-row losses, rows whose label
    equals padding_idx get zero loss and zero gradient, and no bounds checks on labels."""

    @staticmethod
    def forward(ctx, logits, labels, smoothing=0.0, padding_idx=0, half_to_float=False):
        assert smoothing == 0.0
        lse = torch.logsumexp(logits.float(), dim=-1)
        losses = lse - logits.float().gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        pad = labels == padding_idx
        losses = losses.masked_fill(pad, 0.0)
        ctx.save_for_backward(logits, labels, lse, pad)
        return losses

    @staticmethod
    def backward(ctx, grad):
        logits, labels, lse, pad = ctx.saved_tensors
        g = torch.exp(logits.float() - lse.unsqueeze(-1))
        g.scatter_add_(-1, labels.unsqueeze(-1), -torch.ones_like(labels, dtype=g.dtype).unsqueeze(-1))
        g = g * grad.masked_fill(pad, 0.0).unsqueeze(-1)
        return g.to(logits.dtype), None, None, None, None


@pytest.fixture
def fake_apex(monkeypatch):
    module = pytypes.ModuleType("apex.contrib.xentropy")
    module.SoftmaxCrossEntropyLoss = _FakeApexXentropy
    for name in ("apex", "apex.contrib"):
        monkeypatch.setitem(sys.modules, name, pytypes.ModuleType(name))
    monkeypatch.setitem(sys.modules, "apex.contrib.xentropy", module)
    return _FakeApexXentropy


def test_apex_kernel_contract_through_the_double(fake_apex):
    assert load_apex_xentropy() is fake_apex
    hidden, weight, targets = _problem(dtype=torch.float32)
    ref = reference_target_logprobs(hidden, weight, targets)
    ref_gh, ref_gw = torch.autograd.grad(ref.sum(), (hidden, weight))
    got = chunked_target_logprobs(hidden, weight, targets, chunk_tokens=10, kernel=ApexChunkKernel(fake_apex))
    gh, gw = torch.autograd.grad(got.sum(), (hidden, weight))
    # Token 0 is a real token: with apex's default padding_idx=0 its row would read 0 here.
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gh, ref_gh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw, ref_gw, atol=1e-5, rtol=1e-5)


def test_backend_selection(fake_apex):
    assert resolve_backend("auto", "cpu") == "torch"  # apex never runs on CPU, even when importable
    assert resolve_backend("reference", "cpu") == "reference"
    with pytest.raises(BackendUnavailable, match="CUDA"):
        resolve_backend("apex", "cpu")
    with pytest.raises(BackendUnavailable):
        resolve_backend("fastest", "cpu")


def test_apex_missing_is_reported(monkeypatch):
    monkeypatch.setitem(sys.modules, "apex", None)  # import fails
    assert load_apex_xentropy() is None


@pytest.mark.skipif(not torch.cuda.is_available() or load_apex_xentropy() is None,
                    reason="needs CUDA and NVIDIA apex built with xentropy")
def test_real_apex_on_cuda_bf16():  # pragma: no cover - runs on GPU images with apex
    hidden, weight, targets = _problem(n=300, h=64, v=1000, dtype=torch.float32)
    hidden, weight, targets = hidden.detach().cuda(), weight.detach().cuda(), targets.cuda()
    ref = reference_target_logprobs(hidden, weight, targets)
    got = target_logprobs_from_hidden(hidden.bfloat16(), weight.bfloat16(), targets, backend="apex", chunk_tokens=64)
    torch.testing.assert_close(got, ref, atol=5e-2, rtol=2e-2)


# -- the model families users bring --------------------------------------------------------------------------

def _tiny(family: str):
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common, intermediate_size=64, num_key_value_heads=2))
    if family == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, intermediate_size=64, num_key_value_heads=2))
    if family == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**common, intermediate_size=64, num_key_value_heads=2))
    if family == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=4, n_positions=64))
    if family == "gemma2":  # soft-capped logits: the fused head must step aside
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, intermediate_size=64, num_key_value_heads=2,
                                                    head_dim=8, final_logit_softcapping=30.0))
    raise AssertionError(family)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2", "gemma2"])
def test_model_families_match_their_own_logits(family, tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    from tinkerq.worker.training.logprobs import LogprobComputer

    _tiny(family).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    computer = LogprobComputer(model, "auto")
    assert computer.backend == ("model-logits" if family == "gemma2" else "torch")
    if family == "gemma2":
        assert "soft" in computer.fallback_reason or "logit" in computer.fallback_reason
    tokens = torch.randint(0, 101, (3, 12))
    targets = torch.randint(0, 101, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    got = computer(model, tokens, mask, targets)
    for row, n in enumerate((12, 7, 3)):
        logits = model(input_ids=tokens[row:row + 1, :n]).logits[0].float()
        ref = torch.log_softmax(logits, -1).gather(-1, targets[row, :n].unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(got[row, :n], ref, atol=1e-5, rtol=1e-5)
        assert torch.all(got[row, n:] == 0)

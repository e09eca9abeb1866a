"""Each loss against a plain-PyTorch reference written from Tinker's table, on value AND gradient,
with variable-length datums, zero advantages (masks) and clipping actually triggered."""

from __future__ import annotations

import pytest
import torch

from tinkerq.errors import ValidationError
from tinkerq.validation import resolve_loss_config
from tinkerq.worker.training.losses import LOSSES, MetricTotals


def _datums(n: int = 5, *, spread: float = 0.6, seed: int = 0):
    """Per-datum tensors of different lengths: t (trainer logprobs), s, A (zeros on the prompt), mask."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 3 + 4 * i
        prompt = 1 + i % 3
        s = -torch.rand(length, dtype=torch.float64, generator=g) * 3
        t = (s + spread * torch.randn(length, dtype=torch.float64, generator=g)).clamp(max=-1e-3)
        s[:prompt] = 0.0
        adv = torch.zeros(length, dtype=torch.float64)
        adv[prompt:] = torch.randn(1, dtype=torch.float64, generator=g).item()  # one advantage per sequence
        if i == 2:
            adv[:] = 0.0  # a fully masked datum
        seq_mask = (torch.arange(length) >= prompt).double()
        out.append({"t": t, "logprobs": s, "advantages": adv, "sequence_ratio_mask": seq_mask})
    return out


def _padded(datums):
    B, T = len(datums), max(len(d["t"]) for d in datums)
    leaves = [d["t"].clone().requires_grad_(True) for d in datums]
    t = torch.zeros(B, T, dtype=torch.float64)
    mask = torch.zeros(B, T, dtype=torch.float64)
    inputs = {k: torch.zeros(B, T, dtype=torch.float64) for k in ("logprobs", "advantages", "sequence_ratio_mask")}
    rows = []
    for b, d in enumerate(datums):
        n = len(d["t"])
        rows.append((b, n))
        mask[b, :n] = 1
        for k in inputs:
            inputs[k][b, :n] = d[k]
    t = torch.stack([torch.cat([leaf, torch.zeros(T - len(leaf), dtype=torch.float64)]) for leaf in leaves])
    return t, inputs, mask, leaves, rows


def _reference(loss_fn, d, t, config):
    """The formula of ../shared/reference/tinker-api.md §2, one datum, no padding."""
    s, A = d["logprobs"], d["advantages"]
    r = torch.exp(t - s)
    if loss_fn == "importance_sampling":
        return -(r * A)
    if loss_fn == "ppo":
        lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
        return -torch.minimum(r * A, torch.clamp(r, lo, hi) * A)
    if loss_fn == "cispo":
        lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
        return -(torch.clamp(r, lo, hi).detach() * t * A)
    if loss_fn == "dro":
        return -(t * A - 0.5 * config["beta"] * (t - s) ** 2)
    if loss_fn == "gspo":
        lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
        m = d["sequence_ratio_mask"]
        seq_ratio = torch.exp(((t - s) * m).sum() / m.sum())  # the sequence-level ratio, with its gradient
        # Every token carries the sequence objective with its own advantage (losses are sums over tokens).
        return -torch.minimum(seq_ratio * A, torch.clamp(seq_ratio, lo, hi) * A)
    raise AssertionError(loss_fn)


CONFIGS = {
    "importance_sampling": None,
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
}


@pytest.mark.parametrize("loss_fn", sorted(CONFIGS))
def test_loss_value_and_gradient_match_reference(loss_fn):
    datums = _datums()
    config = resolve_loss_config(loss_fn, CONFIGS[loss_fn])
    t, inputs, mask, leaves, rows = _padded(datums)
    per_token, metrics = LOSSES[loss_fn](t, inputs, mask, config)
    per_token = torch.where(mask > 0, per_token, 0.0)
    per_token.sum().backward()

    ref_total = 0.0
    for (b, n), d in zip(rows, datums, strict=True):
        ref_t = d["t"].clone().requires_grad_(True)
        ref = _reference(loss_fn, d, ref_t, config)
        torch.testing.assert_close(per_token[b, :n].detach(), ref.detach())
        ref.sum().backward()
        ref_total += float(ref.detach().sum())
        torch.testing.assert_close(leaves[b].grad, ref_t.grad, msg=f"{loss_fn} datum {b} gradient")
    assert float(per_token.detach().sum()) == pytest.approx(ref_total, rel=1e-9, abs=1e-12)

    totals = MetricTotals()
    totals.add(metrics)
    result = totals.result()
    assert all(k.count(":") == 1 for k in result)
    if "clip_fraction:mean" in result:
        assert 0.0 < result["clip_fraction:mean"] < 1.0  # clipping really happened, on some tokens only


def test_clipping_zeroes_the_gradient_where_the_ratio_is_clipped():
    d = _datums(1, spread=1.5)[0]
    config = resolve_loss_config("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    t, inputs, mask, leaves, _ = _padded([d])
    LOSSES["ppo"](t, inputs, mask, config)[0].sum().backward()
    r = torch.exp(d["t"] - d["logprobs"])
    A = d["advantages"]
    clipped = ((A > 0) & (r > 1.1)) | ((A < 0) & (r < 0.9))
    assert clipped.any()
    assert torch.all(leaves[0].grad[clipped] == 0)


def test_wild_log_ratio_stays_finite():
    t = torch.tensor([[0.0, -0.01]], dtype=torch.float64, requires_grad=True)
    inputs = {"logprobs": torch.tensor([[-500.0, -1.0]], dtype=torch.float64),
              "advantages": torch.tensor([[1.0, 1.0]], dtype=torch.float64)}
    loss, _ = LOSSES["importance_sampling"](t, inputs, torch.ones(1, 2, dtype=torch.float64), {})
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(t.grad).all()


def test_cross_entropy_is_weighted_nll():
    t = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    w = torch.tensor([[0.0, 1.0, 0.5]])
    loss, metrics = LOSSES["cross_entropy"](t, {"weights": w}, torch.ones(1, 3), {})
    assert loss.tolist() == [[0.0, 2.0, 1.5]] and metrics == {}


@pytest.mark.parametrize(
    ("loss_fn", "config", "words"),
    [
        ("ppo", {"clip_low": 0.8}, "clip_low"),
        ("ppo", {"clip_low_threshold": 1.2, "clip_high_threshold": 0.8}, "clip_low_threshold <= 1"),
        ("dro", None, "beta"),
        ("dro", {"beta": "big"}, "finite number"),
        ("cross_entropy", {"beta": 0.1}, "beta"),
        ("importance_sampling", {"clip_low_threshold": 0.8}, "clip_low_threshold"),
    ],
)
def test_bad_loss_config_is_a_named_user_error(loss_fn, config, words):
    with pytest.raises(ValidationError, match=words):
        resolve_loss_config(loss_fn, config)


def test_ppo_defaults():
    assert resolve_loss_config("ppo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}

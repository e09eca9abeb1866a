"""Tinker's losses as small functions over per-token tensors. Every loss is a SUM over tokens and datums.

Each function takes the model's per-token target logprobs ``t`` (B, T), the batch's loss inputs padded to
(B, T) with zeros, the padding ``mask`` (B, T) and the validated ``loss_fn_config``, and returns the
per-token loss (B, T) plus metrics. The caller masks, sums and reduces them across micro-batches.

Notation (``../shared/reference/tinker-api.md`` §2): ``s`` = the sampler's logprobs
(``loss_fn_inputs["logprobs"]``), ``A`` = advantages, ``r = exp(t - s)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# exp(20) ~ 4.9e8: one wild token cannot produce inf, and the clamp is far outside any useful ratio.
LOG_RATIO_CLAMP = 20.0


@dataclass
class Metric:
    """Per-token values to reduce over the tokens where ``where`` is true (across all micro-batches)."""

    reduction: str  # "sum" | "mean" | "min" | "max"
    values: torch.Tensor  # (B, T)
    where: torch.Tensor  # (B, T) bool


class MetricTotals:
    """Reduces :class:`Metric` values over every micro-batch of a request into ``name:reduction`` floats."""

    def __init__(self) -> None:
        self._totals: dict[str, list[float]] = {}  # name -> [accumulated value, token count]

    def add(self, metrics: dict[str, Metric]) -> None:
        for name, m in metrics.items():
            values = m.values[m.where]
            if values.numel() == 0:
                continue
            if m.reduction in ("sum", "mean"):
                value = float(values.double().sum())
            elif m.reduction == "min":
                value = float(values.min())
            else:
                value = float(values.max())
            if name not in self._totals:
                self._totals[name] = [value, values.numel()]
                continue
            total = self._totals[name]
            if m.reduction in ("sum", "mean"):
                total[0] += value
            else:
                total[0] = min(total[0], value) if m.reduction == "min" else max(total[0], value)
            total[1] += values.numel()

    def raw(self) -> dict[str, list[float]]:
        """Running totals (name -> [value, token count]), to merge with another rank's."""
        return {name: list(v) for name, v in self._totals.items()}

    def merge(self, raw: dict[str, list[float]]) -> None:
        """Fold in another :meth:`raw` (the reduction is the name's suffix: sum, mean, min or max)."""
        for name, (value, count) in raw.items():
            if name not in self._totals:
                self._totals[name] = [float(value), int(count)]
                continue
            total = self._totals[name]
            reduction = name.rsplit(":", 1)[-1]
            if reduction == "min":
                total[0] = min(total[0], value)
            elif reduction == "max":
                total[0] = max(total[0], value)
            else:
                total[0] += value
            total[1] += int(count)

    def result(self) -> dict[str, float]:
        return {name: (v / n if name.endswith(":mean") else v) for name, (v, n) in self._totals.items()}


LossOutput = tuple[torch.Tensor, dict[str, Metric]]
LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, dict[str, Any]], LossOutput]


def cross_entropy(t: torch.Tensor, inputs: dict[str, torch.Tensor], mask: torch.Tensor,
                  config: dict[str, Any]) -> LossOutput:
    """Weighted negative log-likelihood: ``-t * weights``."""
    return -t * inputs["weights"], {}


def _log_ratio(t: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.clamp(t - inputs["logprobs"], -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _active(inputs: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Sampled tokens: those with a sampler logprob or an advantage (prompt positions carry zeros of both)."""
    return (mask > 0) & ((inputs["advantages"] != 0) | (inputs["logprobs"] != 0))


def _ratio_metrics(log_ratio: torch.Tensor, ratio: torch.Tensor, active: torch.Tensor) -> dict[str, Metric]:
    lr, r = log_ratio.detach(), ratio.detach()
    return {
        "ratio:mean": Metric("mean", r, active),
        "log_ratio:min": Metric("min", lr, active),
        "log_ratio:max": Metric("max", lr, active),
        # k1 estimate of KL(sampler || trainer) on the sampled tokens: drift between the two policies.
        "kl_sample_train:mean": Metric("mean", -lr, active),
    }


def _clip_metric(ratio: torch.Tensor, low: float, high: float, active: torch.Tensor) -> Metric:
    r = ratio.detach()
    return Metric("mean", ((r < low) | (r > high)).float(), active)


def importance_sampling(t: torch.Tensor, inputs: dict[str, torch.Tensor], mask: torch.Tensor,
                        config: dict[str, Any]) -> LossOutput:
    """``-exp(t - s) * A``: the policy gradient corrected for sampling from an older policy."""
    log_ratio = _log_ratio(t, inputs)
    ratio = torch.exp(log_ratio)
    return -ratio * inputs["advantages"], _ratio_metrics(log_ratio, ratio, _active(inputs, mask))


def ppo(t: torch.Tensor, inputs: dict[str, torch.Tensor], mask: torch.Tensor, config: dict[str, Any]) -> LossOutput:
    """``-min(r * A, clamp(r, low, high) * A)``: the clipped surrogate objective."""
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    log_ratio = _log_ratio(t, inputs)
    ratio = torch.exp(log_ratio)
    advantages = inputs["advantages"]
    loss = -torch.minimum(ratio * advantages, torch.clamp(ratio, low, high) * advantages)
    active = _active(inputs, mask)
    metrics = _ratio_metrics(log_ratio, ratio, active)
    metrics["clip_fraction:mean"] = _clip_metric(ratio, low, high, active)
    return loss, metrics


def cispo(t: torch.Tensor, inputs: dict[str, torch.Tensor], mask: torch.Tensor,
          config: dict[str, Any]) -> LossOutput:
    """``-stopgrad(clamp(r, low, high)) * t * A``: clipped importance weights on the log-likelihood."""
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    log_ratio = _log_ratio(t, inputs)
    ratio = torch.exp(log_ratio)
    loss = -torch.clamp(ratio, low, high).detach() * t * inputs["advantages"]
    active = _active(inputs, mask)
    metrics = _ratio_metrics(log_ratio, ratio, active)
    metrics["clip_fraction:mean"] = _clip_metric(ratio, low, high, active)
    return loss, metrics


def dro(t: torch.Tensor, inputs: dict[str, torch.Tensor], mask: torch.Tensor, config: dict[str, Any]) -> LossOutput:
    """``-(t * A - 0.5 * beta * (t - s)^2)``: advantage-weighted likelihood with a quadratic penalty."""
    beta = config["beta"]
    diff = t - inputs["logprobs"]
    loss = -(t * inputs["advantages"] - 0.5 * beta * diff**2)
    active = _active(inputs, mask)
    d = diff.detach()
    return loss, {
        "log_ratio:min": Metric("min", d, active),
        "log_ratio:max": Metric("max", d, active),
        "squared_log_ratio:mean": Metric("mean", d**2, active),
    }


def gspo(t: torch.Tensor, inputs: dict[str, torch.Tensor], mask: torch.Tensor, config: dict[str, Any]) -> LossOutput:
    """Sequence-level ratios (GSPO-token form), clipped PPO-style.

    Per datum, ``s_seq = exp(mean over sequence_ratio_mask of (t - s))``, a constant within the step. Each
    token uses ``r_tok = s_seq * exp(t - stopgrad(t))``: its value is the sequence ratio, its gradient
    flows through the token's own logprob. Then ``-min(r_tok * A, clamp(r_tok, low, high) * A)``, so a
    whole sequence is clipped or not together.
    """
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    seq_mask = inputs["sequence_ratio_mask"] * mask  # (B, T)
    counts = seq_mask.sum(dim=1, keepdim=True).clamp_min(1.0)  # (B, 1)
    log_ratio = _log_ratio(t, inputs)
    seq_log_ratio = (log_ratio * seq_mask).sum(dim=1, keepdim=True) / counts  # (B, 1)
    # Value s_seq, gradient s_seq * dt per token. Summed over a sequence's tokens with a shared advantage
    # this is exactly the sequence-level GSPO gradient times the token count (losses here are sums).
    token_ratio = torch.exp(seq_log_ratio.detach() + t - t.detach())
    advantages = inputs["advantages"]
    loss = -torch.minimum(token_ratio * advantages, torch.clamp(token_ratio, low, high) * advantages)
    active = _active(inputs, mask)
    seq_ratio = torch.exp(seq_log_ratio.detach()).expand_as(t)
    metrics = _ratio_metrics(log_ratio, seq_ratio, active)
    metrics["clip_fraction:mean"] = _clip_metric(seq_ratio, low, high, active)
    return loss, metrics


LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
}


@dataclass
class ScoredBatch:
    """A padded micro-batch after the loss: what a session returns and sums from it."""

    logprobs: torch.Tensor  # (B, T), exact zeros at padding
    elementwise: torch.Tensor  # (B, T), exact zeros at padding
    loss: torch.Tensor  # () the sum, differentiable
    metrics: dict[str, Metric]

    def rows(self, lengths: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per datum, its unpadded (logprobs, elementwise loss), float32 on the CPU."""
        lp = self.logprobs.detach().float().cpu().numpy()
        el = self.elementwise.detach().float().cpu().numpy()
        return [(lp[i, :n].copy(), el[i, :n].copy()) for i, n in enumerate(lengths)]


def score(logprobs: torch.Tensor, batch: dict[str, Any], loss_fn: LossFn, config: dict[str, Any]) -> ScoredBatch:
    """Apply ``loss_fn`` to target logprobs (B, T) of a padded batch
    (:func:`tinkerq.worker.training.batching.pad_batch`)."""
    real = batch["mask"] > 0
    logprobs = torch.where(real, logprobs, 0.0)  # padding positions carry exact zeros
    elementwise, metrics = loss_fn(logprobs, batch, batch["mask"], config)
    elementwise = torch.where(real, elementwise, 0.0)
    return ScoredBatch(logprobs, elementwise, elementwise.sum(), metrics)

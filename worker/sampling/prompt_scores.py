"""Tinker's per-position sampling options, computed by the sampling engine: ``topk_prompt_logprobs``,
``target_prompt_logprobs`` and ``prompt_alt_tokens_k`` from the prefill that serves the request, and
``topk_sample_logprobs`` at every decode step (:func:`sample_topk`).

Prompt positions are scored chunk by chunk (:func:`position_logits`): from the final hidden states the prefill kept
and the output embedding (plus a LoRA head's low-rank term), or, for a model whose logits are not just
``hidden @ W.T``, from the prefill's own every-position logits, so a long prompt's (P, V) float32 logits never exist
at once. Every logprob is log_softmax of the raw logits (temperature 1), as the sampled tokens' are: the numbers
``forward`` computes. The alternative tokens are drawn at the request's temperature (no top-k / top-p: the SDK names
only the temperature), by inverse CDF with uniforms from a CPU generator seeded with ``alt_seed(seed)``, so a seeded
request draws the same tokens on any worker and device.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tinkerq import types
from tinkerq.validation import PromptOptions
from tinkerq.worker.loss_head.chunked import chunk_logits
from tinkerq.worker.sampling.prompt_logprobs import head_inputs
from tinkerq.worker.training.logprobs import chunk_tokens

ALT_STREAM = 2**32  # the row index of the alternative tokens' generator (sample rows use 0 .. num_samples - 1)


def alt_seed(seed: int) -> int:
    """The alternative-token generator's seed for a request seeded with ``seed`` (forwards.row_seed's stream)."""
    return (seed * 1_000_003 + ALT_STREAM) % 2**64


@dataclass
class PromptScores:
    """One request's answers over its prompt (P tokens); None: not asked."""

    topk: types.TopkLogprobs | None = None  # (P, k); row 0 is empty (nothing predicts the first token)
    targets: np.ndarray | None = None  # (P - 1, K) float32; 0.0 where the request's id is -1
    alt_tokens: np.ndarray | None = None  # (P - 1, k) int64
    alt_logprobs: np.ndarray | None = None  # (P - 1, k) float32


def position_logits(model: Any, *, hidden: torch.Tensor | None = None, logits: torch.Tensor | None = None,
                    adapter: Any = None) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, logits (C, V) float32) of the prompt positions that predict tokens start + 1 .. start + C, from one
    prompt's final hidden states (P, H) or its every-position logits (P, V)."""
    if hidden is not None:
        h, weight, low_rank = head_inputs(model, hidden, adapter)
        low, low_weight = low_rank if low_rank is not None else (None, None)
        step = chunk_tokens(weight.shape[0])
        for start in range(0, h.shape[0], step):
            yield start, chunk_logits(h, weight, low, low_weight, start, min(start + step, h.shape[0])).float()
        return
    assert logits is not None
    step = chunk_tokens(logits.shape[-1])
    for start in range(0, logits.shape[0] - 1, step):
        yield start, logits[start:min(start + step, logits.shape[0] - 1)].float()


def score_prompt(chunks: Iterator[tuple[int, torch.Tensor]], prompt_length: int, options: PromptOptions,
                 params: types.SamplingParams) -> PromptScores:
    """The prompt answers ``options`` asks for, from :func:`position_logits`' chunks."""
    n = prompt_length - 1
    k, alt_k = options.topk_prompt, options.alt_k
    out = PromptScores()
    if k:
        out.topk = types.TopkLogprobs(token_ids=np.zeros((prompt_length, k), dtype=np.int32),
                                      logprobs=np.full((prompt_length, k), types.TOPK_MASK_LOGPROB, dtype=np.float32))
    targets = None
    if options.targets is not None:
        targets = torch.from_numpy(np.array(options.targets, dtype=np.int64))  # (P - 1, K), a writable copy
        out.targets = np.zeros(targets.shape, dtype=np.float32)
    uniforms = None
    if alt_k:
        out.alt_tokens = np.zeros((n, alt_k), dtype=np.int64)
        out.alt_logprobs = np.zeros((n, alt_k), dtype=np.float32)
        if params.temperature != 0:  # greedy draws need no randomness
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            uniforms = torch.rand((n, alt_k), generator=torch.Generator().manual_seed(alt_seed(seed)))
    for start, logits in chunks:
        stop = start + logits.shape[0]
        lsm = logits.log_softmax(-1)  # (C, V)
        if out.topk is not None:
            values, ids = lsm.topk(k, dim=-1)
            out.topk.token_ids[start + 1:stop + 1] = ids.cpu().numpy()
            out.topk.logprobs[start + 1:stop + 1] = values.cpu().numpy()
        if targets is not None and out.targets is not None:
            ids = targets[start:stop].to(lsm.device)
            got = lsm.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, 0.0)
            out.targets[start:stop] = got.cpu().numpy()
        if out.alt_tokens is not None and out.alt_logprobs is not None:
            drawn = _draw(logits, params.temperature, None if uniforms is None else uniforms[start:stop], alt_k)
            out.alt_tokens[start:stop] = drawn.cpu().numpy()
            out.alt_logprobs[start:stop] = lsm.gather(-1, drawn).cpu().numpy()
    return out


def _draw(logits: torch.Tensor, temperature: float, uniforms: torch.Tensor | None, k: int) -> torch.Tensor:
    """k tokens per row of ``logits`` (C, V) at ``temperature``: the argmax at 0, else by inverse CDF of the
    uniforms (C, k)."""
    if temperature == 0 or uniforms is None:
        return logits.argmax(-1, keepdim=True).expand(-1, k)
    scaled = logits / temperature
    cdf = (scaled - scaled.amax(-1, keepdim=True)).exp().cumsum(-1)  # (C, V), unnormalised
    target = uniforms.to(logits.device) * cdf[:, -1:]  # (C, k)
    return torch.searchsorted(cdf, target, right=True).clamp_(max=logits.shape[-1] - 1)


def sample_topk(logits: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely tokens (ids (R, k) int32, log p (R, k) float32, temperature 1) of ``rows`` of a decode
    step's logits (B, V), whose log-normaliser per row is ``lse`` (B,)."""
    values, ids = (logits.index_select(0, rows) - lse.index_select(0, rows)[:, None]).topk(k, dim=-1)
    return ids.to(torch.int32).cpu().numpy(), values.cpu().numpy()

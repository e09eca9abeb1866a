"""Sampling from a causal LM with a KV cache: temperature, top-k, top-p, stop tokens and strings, seeds.

All ``num_samples`` sequences of one request share the prompt, so they decode as one batch with no
padding. The logprob reported for each token is log p(token) at temperature 1 under the same weights: the
number ``forward`` computes for that token, which importance-sampling losses compare against.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import PreTrainedModel

from tinkerq import types


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (with -inf) the tokens outside top-k and outside the top-p nucleus; logits (B, V)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens ranked before it already cover top_p (the first one always stays).
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class StopRule:
    """When a sequence is finished: a stop token, or a stop string appearing in the decoded completion."""

    def __init__(self, stop: Any, default_stop_ids: list[int], tokenizer: Any | None) -> None:
        self.ids: set[int] = set()
        self.strings: list[str] = []
        self.tokenizer = tokenizer
        if stop is None:
            self.ids = set(default_stop_ids)
        elif isinstance(stop, str):
            self.strings = [stop]
        elif all(isinstance(x, str) for x in stop):
            self.strings = list(stop)
        else:
            self.ids = {int(x) for x in stop}

    def done(self, tokens: list[int]) -> bool:
        if tokens[-1] in self.ids:
            return True
        if self.strings:
            text = self.tokenizer.decode(tokens[-64:], skip_special_tokens=False)
            return any(s in text for s in self.strings)
        return False


def _cache_kwarg(model: PreTrainedModel) -> str:
    """transformers 5 names the KV cache argument ``cache``; older releases ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _returned_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.no_grad()
def sample(model: PreTrainedModel, prompt: list[int], num_samples: int, params: types.SamplingParams,
           stop: StopRule, max_tokens: int) -> list[types.SampledSequence]:
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()
    input_ids = torch.tensor([prompt] * num_samples, dtype=torch.long, device=device)  # (S, P)
    cache_arg = _cache_kwarg(model)
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)  # no (S, P, V) prompt logits
    cache = _returned_cache(out)
    logits = out.logits[:, -1].float()  # (S, V)
    tokens: list[list[int]] = [[] for _ in range(num_samples)]
    logprobs: list[list[float]] = [[] for _ in range(num_samples)]
    reasons: list[str | None] = [None] * num_samples
    for _ in range(max_tokens):
        logprobs_all = torch.log_softmax(logits, dim=-1)  # (S, V), temperature 1
        if params.temperature == 0:
            chosen = logits.argmax(dim=-1)  # greedy
        else:
            scaled = filter_logits(logits / params.temperature, params.top_k, params.top_p)
            chosen = torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator).squeeze(-1)  # (S,)
        picked = logprobs_all.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
        for i in range(num_samples):
            if reasons[i] is not None:
                continue
            tokens[i].append(int(chosen[i]))
            logprobs[i].append(float(picked[i]))
            if stop.done(tokens[i]):
                reasons[i] = "stop"
        if all(r is not None for r in reasons):
            break
        # Finished rows keep decoding in the batch (cheaper than reshaping the cache); their output is ignored.
        out = model(input_ids=chosen.unsqueeze(-1), use_cache=True, **{cache_arg: cache})
        cache = _returned_cache(out)
        logits = out.logits[:, -1].float()
    return [
        types.SampledSequence(stop_reason=reason or "length", tokens=toks, logprobs=lps)  # type: ignore[arg-type]
        for reason, toks, lps in zip(reasons, tokens, logprobs, strict=True)
    ]

"""log p(prompt[i] | prompt[:i]) from the engine's prefill: Tinker's include_prompt_logprobs and compute_logprobs.

The engine prefills each distinct prompt once. When a job asks for its prompt's logprobs, the backbone's final
hidden states of that same forward are kept (:func:`final_hidden`, a hook on ``model.base_model``) and turned
into target logprobs with the output embedding chunk by chunk (worker/loss_head), so a long prompt's (P, V)
logits never exist; a LoRA adapter on the output projection adds its low-rank term there, as the routing hook
does for the sampled tokens. Models whose logits are not just ``hidden @ W.T`` (soft-capping, scaling, a bias:
:func:`tinkerq.worker.training.logprobs.fused_head_support`) prefill such prompts with every position's logits instead.

The numbers are float32 at temperature 1, whatever the job's temperature, top-k or top-p: the same ones
``forward`` computes for these tokens.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tinkerq.worker.loss_head import target_logprobs_from_hidden
from tinkerq.worker.training.logprobs import chunk_tokens


@contextlib.contextmanager
def final_hidden(model: Any, enabled: bool = True) -> Iterator[list[torch.Tensor]]:
    """Collect the final hidden states (N, P, H) of ``model``'s forwards run by this thread inside the block.

    Other threads may run the same model meanwhile (a shared base under LoRA training): their forwards are not
    collected.
    """
    kept: list[torch.Tensor] = []
    if not enabled:
        yield kept
        return
    thread = threading.get_ident()

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() == thread:
            hidden = getattr(output, "last_hidden_state", None)
            kept.append(hidden if hidden is not None else output[0])

    handle = model.base_model.register_forward_hook(hook)
    try:
        yield kept
    finally:
        handle.remove()


def head_inputs(model: Any, hidden: torch.Tensor, adapter: Any = None) -> tuple[
        torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """What the output head needs for one prompt's final hidden states (P, H): the P - 1 states that predict
    tokens 1.., the output weight (V, H), and ``adapter``'s low-rank term (LoRA on the head) or None."""
    head = model.get_output_embeddings()
    weight = head.weight  # (V, H)
    h = hidden[:-1]  # (P-1, H): position i - 1 predicts token i
    low_rank = None
    pair = adapter.pair(_module_name(model, head)) if adapter is not None else None
    if pair is not None:  # logits h W^T + (s h A^T) B^T, as the routing hook adds to the sampled tokens'
        a, b = pair
        low_rank = (F.linear(h, a.to(h.dtype)) * adapter.scaling, b.to(weight.dtype))  # (P-1, r), (V, r)
    return h, weight, low_rank


def from_hidden(model: Any, hidden: torch.Tensor, prompt: torch.Tensor, adapter: Any = None) -> np.ndarray:
    """(P,) float32 for one prompt (P,) and its final hidden states (P, H): NaN at 0 (nothing predicts the
    first token), then log p(prompt[i] | prompt[:i]). ``adapter``: the LoRA snapshot the prompt ran under."""
    h, weight, low_rank = head_inputs(model, hidden, adapter)
    logprobs = target_logprobs_from_hidden(h, weight, prompt[1:], backend="torch",
                                           chunk_tokens=chunk_tokens(weight.shape[0]), low_rank=low_rank)
    return _with_first(logprobs)


def from_logits(logits: torch.Tensor, prompt: torch.Tensor) -> np.ndarray:
    """As :func:`from_hidden`, from the model's own logits (P, V) of the prompt (models with a transformed head)."""
    lp = logits[:-1].float().log_softmax(-1)  # (P-1, V)
    return _with_first(lp.gather(-1, prompt[1:, None]).squeeze(-1))


def _with_first(logprobs: torch.Tensor) -> np.ndarray:
    """NaN, then ``logprobs`` (P-1,), as float32 on the CPU."""
    out = np.full(logprobs.shape[0] + 1, np.nan, dtype=np.float32)
    out[1:] = logprobs.detach().float().cpu().numpy()
    return out


def _module_name(model: torch.nn.Module, module: torch.nn.Module) -> str:
    """The name the routing (and an adapter's pairs) use for ``module``."""
    return next(name for name, m in model.named_modules() if m is module)

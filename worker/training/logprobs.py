"""Per-token target logprobs of a causal LM over a right-padded batch.

The model's backbone gives the final hidden states; the loss head (:mod:`tinkerq.worker.loss_head`) turns them
into target logprobs with the output embedding weight, chunk by chunk, so the (B, T, V) logits tensor
never exists. Models whose logits are not exactly ``hidden @ W.T`` (soft-capping, scaling, a bias) use the
model's own forward instead, with a warning.
"""

from __future__ import annotations

import logging

import torch
from transformers import PreTrainedModel

from tinkerq.worker.loading.quantized_base import recomputed
from tinkerq.worker.lora import head as lora_head
from tinkerq.worker.lora import routing as lora_routing
from tinkerq.worker.loss_head import resolve_backend, target_logprobs_from_hidden

log = logging.getLogger("tinkerq.worker")

# Config fields that mean "logits are not just hidden @ W.T" (Gemma 2/3, Cohere, Granite, Inkling's muP width
# multiplier that divides the hidden states, ...). tests/test_moe_classes.py checks this verdict against each proven
# class's own forward.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale",
                     "logits_mup_width_multiplier")
# Bytes of float32 logits one chunk may hold (sets the chunk length from the vocabulary size).
CHUNK_LOGITS_BYTES = 128 * 1024 * 1024


def fused_head_support(model: PreTrainedModel) -> str | None:
    """None when hidden states + output weight reproduce the model's logits, else the reason why not."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return f"output embedding is a {type(head).__name__}, not a Linear layer"
    if head.bias is not None:
        return "output embedding has a bias"
    for name in _LOGIT_TRANSFORMS:
        value = getattr(model.config, name, None)
        if value not in (None, 0, 0.0, 1, 1.0):
            return f"the model transforms its logits ({name}={value})"
    unpadded = getattr(model.config, "unpadded_vocab_size", None)
    if isinstance(unpadded, int) and unpadded < head.out_features:
        return f"the model drops its padded vocabulary rows (unpadded_vocab_size={unpadded})"
    if model.base_model is model:
        return "the model exposes no backbone (base_model)"
    return None


def chunk_tokens(vocab: int) -> int:
    """Tokens per loss-head chunk for this vocabulary size: CHUNK_LOGITS_BYTES of float32 logits."""
    return max(16, min(8192, CHUNK_LOGITS_BYTES // (4 * vocab)))


class LogprobComputer:
    """Target logprobs for one worker: the backend is chosen once, and reported."""

    def __init__(self, model: PreTrainedModel, requested_backend: str = "auto",
                 device: torch.device | str | None = None) -> None:
        # A sharded worker keeps its base model on the CPU; its shards compute on ``device``.
        device = device if device is not None else next(model.parameters()).device
        self.backend = resolve_backend(requested_backend, device)
        self.fallback_reason = fused_head_support(model)
        if self.fallback_reason is not None:
            log.warning("loss head: %s; computing full logits with the model's own forward", self.fallback_reason)
            self.backend = "model-logits"
        self.chunk_tokens = chunk_tokens(model.get_output_embeddings().weight.shape[0])

    def __call__(self, model: PreTrainedModel, tokens: torch.Tensor, attention_mask: torch.Tensor,
                 targets: torch.Tensor) -> torch.Tensor:
        """log p(targets[b, t] | tokens[b, :t+1]) for every position, (B, T); zeros at padding.

        Rows are right-padded, so a row's real tokens keep positions 0..n-1 and causal attention never sees
        the padding after them. Every training forward of a base goes through here: a base kept quantized has its
        weights saved as recipes and rebuilt in the backward (worker/loading/quantized_base.py).
        """
        with recomputed():
            return self._logprobs(model, tokens, attention_mask, targets)

    def _logprobs(self, model: PreTrainedModel, tokens: torch.Tensor, attention_mask: torch.Tensor,
                  targets: torch.Tensor) -> torch.Tensor:
        if self.backend == "model-logits":
            logits = model(input_ids=tokens, attention_mask=attention_mask, use_cache=False).logits.float()
            picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)
            return torch.where(attention_mask > 0, picked - torch.logsumexp(logits, dim=-1), 0.0)
        hidden = model.base_model(input_ids=tokens, attention_mask=attention_mask, use_cache=False)
        hidden = hidden.last_hidden_state  # (B, T, H)
        real = attention_mask > 0  # (B, T)
        weight = model.get_output_embeddings().weight  # (V, H)
        routing = lora_routing.current()
        if routing is not None and routing.tiled_head() and self.backend in lora_head.BACKENDS:
            return lora_head.routed_logprobs(routing, hidden, weight, targets, real, backend=self.backend,
                                             chunk_tokens=self.chunk_tokens)
        groups = routing.head_groups() if routing is not None else None
        if groups is not None and routing is not None:  # LoRA on the output projection: each adapter's own head
            parts = zip(routing.split(hidden), routing.split(targets), routing.split(real), groups, strict=True)
            return torch.cat([self._head(h, weight, t, r, scaling, pair) for h, t, r, (scaling, pair) in parts])
        return self._head(hidden, weight, targets, real)

    def _head(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, real: torch.Tensor,
              scaling: float = 0.0, pair: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        h = hidden[real]  # (N, H)
        low_rank = None
        if pair is not None:  # logits h W^T + (s h A^T) B^T, chunk by chunk; only B (and A) get gradients
            a, b = pair
            low_rank = (torch.nn.functional.linear(h, a.to(h.dtype)) * scaling, b.to(weight.dtype))  # (N, r), (V, r)
        logprobs = target_logprobs_from_hidden(h, weight, targets[real], backend=self.backend,
                                               chunk_tokens=self.chunk_tokens, low_rank=low_rank)  # (N,)
        out = torch.zeros(real.shape, dtype=logprobs.dtype, device=logprobs.device)
        return out.index_put((real,), logprobs)  # (B, T), differentiable

"""Chunked target logprobs: a custom autograd Function that never holds more than one chunk of logits.

Forward, per chunk of C tokens: ``logits = h_c @ W.T`` (C, V) -> keep only ``logsumexp`` (C,) and the
target's logit. Backward, per chunk: recompute the logits, turn them into softmax in place, and form
``d logprob / d logits = onehot(target) - softmax`` scaled by the incoming gradient, then
``dh_c = g @ W`` and ``dW += g.T @ h_c``. Peak memory is O(N*H + V*H + C*V) instead of O(N*V); the price
is one extra (C, V) matmul per chunk (8*N*H*V FLOPs instead of 6).

The per-chunk kernel is pluggable (:class:`ChunkKernel`) so the apex backend reuses this Function.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types (bf16/fp16 logits are upcast), else unchanged (float64 stays exact)."""
    return torch.promote_types(dtype, torch.float32)


class ChunkKernel(Protocol):
    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(C, V) logits -> (target logprobs (C,) float32, state needed by ``grad_logits``)."""

    def grad_logits(self, logits: torch.Tensor, targets: torch.Tensor, state: Any,
                    grad: torch.Tensor) -> torch.Tensor:
        """d(sum(grad * logprobs)) / d logits, (C, V); may reuse ``logits``'s storage."""


class TorchChunkKernel:
    """Plain torch per chunk: logsumexp forward, in-place softmax backward. Any device, any float dtype."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.to(compute_dtype(logits.dtype))  # the chunk's own buffer: safe to overwrite
        picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (C,)
        # logsumexp in place (no second (C, V) buffer): max, subtract, exp, sum, log.
        top = logits.amax(dim=-1, keepdim=True)  # (C, 1)
        lse = logits.sub_(top).exp_().sum(dim=-1).log_() + top.squeeze(-1)  # (C,)
        return picked - lse, lse

    def grad_logits(self, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                    grad: torch.Tensor) -> torch.Tensor:
        g = logits.to(compute_dtype(logits.dtype))  # a copy for half dtypes; float32 logits are reused in place
        g.sub_(lse.unsqueeze(-1)).exp_()  # softmax (C, V)
        g.mul_(-grad.unsqueeze(-1))  # -grad * softmax
        g.scatter_add_(-1, targets.unsqueeze(-1), grad.unsqueeze(-1).to(g.dtype))  # + grad * onehot
        return g


class ChunkedTargetLogprobs(torch.autograd.Function):
    """Logits ``hidden @ weight.T (+ low @ low_weight.T)`` one chunk of tokens at a time, never all at once.

    The optional low-rank term is a LoRA adapter on the output projection (worker/training/logprobs.py): ``low`` (N, r)
    is ``scaling * hidden @ A.T`` and ``low_weight`` (V, r) is B. Its gradient costs V x r per token, not the
    V x H of the frozen ``weight``, which gets no gradient when it does not require one.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                kernel: ChunkKernel, low: torch.Tensor | None, low_weight: torch.Tensor | None) -> torch.Tensor:
        n = hidden.shape[0]
        out = torch.empty(n, dtype=compute_dtype(hidden.dtype), device=hidden.device)  # (N,)
        states = []
        for start in range(0, n, chunk_tokens):
            stop = min(start + chunk_tokens, n)
            logits = chunk_logits(hidden, weight, low, low_weight, start, stop)  # (C, V)
            out[start:stop], state = kernel.forward(logits, targets[start:stop])
            states.append(state)
            del logits
        ctx.save_for_backward(hidden, weight, targets, low, low_weight)
        ctx.states = states
        ctx.chunk_tokens = chunk_tokens
        ctx.kernel = kernel
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, targets, low, low_weight = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_low, need_lw = ctx.needs_input_grad[5], ctx.needs_input_grad[6]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_low = torch.empty_like(low) if need_low else None
        # Accumulate dW in float32: thousands of chunk contributions must not round away in bf16.
        acc = compute_dtype(weight.dtype)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_lw = torch.zeros(low_weight.shape, dtype=acc, device=low_weight.device) if need_lw else None
        grad_out = grad_out.to(acc)
        for i, start in enumerate(range(0, hidden.shape[0], ctx.chunk_tokens)):
            stop = min(start + ctx.chunk_tokens, hidden.shape[0])
            h = hidden[start:stop]
            logits = chunk_logits(hidden, weight, low, low_weight, start, stop)  # (C, V), recomputed
            g = ctx.kernel.grad_logits(logits, targets[start:stop], ctx.states[i], grad_out[start:stop])
            del logits
            if grad_h is not None:
                grad_h[start:stop] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w.addmm_(g.t().to(acc), h.to(acc))
            if grad_low is not None:
                grad_low[start:stop] = (g.to(low_weight.dtype) @ low_weight).to(low.dtype)
            if grad_lw is not None:
                grad_lw.addmm_(g.t().to(acc), low[start:stop].to(acc))
            del g
        return (grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None, None,
                grad_low, (grad_lw.to(low_weight.dtype) if grad_lw is not None else None))


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, low: torch.Tensor | None, low_weight: torch.Tensor | None,
            start: int, stop: int) -> torch.Tensor:
    logits = hidden[start:stop] @ weight.t()  # (C, V)
    if low is not None and low_weight is not None:
        logits.addmm_(low[start:stop], low_weight.t())  # the LoRA term, added in place (no second (C, V))
    return logits


def chunked_target_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                            chunk_tokens: int = 1024, kernel: ChunkKernel | None = None,
                            low_rank: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Target logprobs (N,) for hidden (N, H), weight (V, H), targets (N,), chunk by chunk over tokens;
    ``low_rank`` = (low (N, r), low_weight (V, r)) adds ``low @ low_weight.T`` to the logits."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    low, low_weight = low_rank if low_rank is not None else (None, None)
    return ChunkedTargetLogprobs.apply(hidden, weight, targets, chunk_tokens, kernel or TorchChunkKernel(), low,
                                       low_weight)

"""The loss head of a routed LoRA pass, over every group's tokens at once, in fixed-shape tiles.

The output projection is the largest product of a pass (V x H per token, three times: the forward's logits, the
backward's recomputed logits and the hidden states' gradient). Batch invariance (worker/lora/routing.py) needs each
request's tokens to get the bits they get alone; rather than a head per request, this head cuts each group's
tokens into tiles (:data:`routing.TILE_ROWS` tokens, then one shorter tile) and computes the frozen weight's
product for each tile on its own, with the shape it has alone. Everything else a tile needs runs per tile, on the
tile's own rows: its adapter's low-rank term ``(s h A^T) B^T``, the per-token kernel (log-sum-exp, its gradient),
and the adapter's gradient, accumulated tile after tile in the group's order. A tile's numbers then depend on its
own tokens only, wherever it sits, and with whom.

Chunks of consecutive tiles (at most ``chunk_tokens`` tokens, as :mod:`tinkerq.worker.loss_head.chunked`) bound the
logits held at once; the backward recomputes each chunk's logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tinkerq.worker.lora import routing as lora_routing
from tinkerq.worker.loss_head.apex import ApexChunkKernel, load_apex_xentropy
from tinkerq.worker.loss_head.chunked import ChunkKernel, TorchChunkKernel, compute_dtype

BACKENDS = ("torch", "apex")  # the chunked loss backends, whose per-token kernel a tile runs


@dataclass(frozen=True)
class Tile:
    start: int  # first token (of the head's (N, H) tokens)
    rows: int
    group: int
    offset: int  # first token within its group


def tiles(counts: list[int], tile_rows: int) -> list[Tile]:
    """Each group's ``counts[g]`` tokens, in order, as whole tiles of ``tile_rows`` then one shorter one: a function
    of the group's own count only."""
    out: list[Tile] = []
    at = 0
    for g, n in enumerate(counts):
        for offset in range(0, n, tile_rows):
            out.append(Tile(at + offset, min(tile_rows, n - offset), g, offset))
        at += n
    return out


def chunks(cut: list[Tile], chunk_tokens: int) -> list[list[Tile]]:
    """Consecutive tiles, at most ``chunk_tokens`` tokens each (one tile at least)."""
    out: list[list[Tile]] = []
    rows = 0
    for t in cut:
        if out and rows + t.rows <= chunk_tokens:
            out[-1].append(t)
            rows += t.rows
        else:
            out.append([t])
            rows = t.rows
    return out


def tiled_products(x: torch.Tensor, w: torch.Tensor, chunk: list[Tile], x_start: int) -> torch.Tensor:
    """``x[rows] @ w`` for the chunk's rows -> (C, M); x (rows, K) holds tokens from ``x_start`` on, w (K, M). Each
    tile is its own product, of the shape it has wherever it sits: its rows get the bits they get alone."""
    lo, hi = chunk[0].start - x_start, chunk[-1].start + chunk[-1].rows - x_start
    out = torch.empty(hi - lo, w.shape[1], dtype=x.dtype, device=x.device)
    for t in chunk:
        at = t.start - x_start
        torch.mm(x[at:at + t.rows], w, out=out[at - lo:at - lo + t.rows])
    return out


class TiledHeadLogprobs(torch.autograd.Function):
    """Target logprobs (N,) of hidden (N, H), weight (V, H) and targets (N,), the logits of group g's tokens plus
    ``lows[g] @ low_weights[g].T`` when the group adapts the output projection (lows[g]: (N_g, r) = ``s h A^T``,
    low_weights[g]: (V, r) = B; None otherwise)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, cut: list[Tile],
                chunk_tokens: int, kernel: ChunkKernel, n_groups: int, *factors: torch.Tensor | None) -> torch.Tensor:
        lows, low_weights = factors[:n_groups], factors[n_groups:]
        out = torch.empty(hidden.shape[0], dtype=compute_dtype(hidden.dtype), device=hidden.device)  # (N,)
        states = []
        for chunk in chunks(cut, chunk_tokens):
            logits = _logits(hidden, weight, chunk, lows, low_weights)  # (C, V)
            at = chunk[0].start
            for t in chunk:
                rows = slice(t.start, t.start + t.rows)
                out[rows], state = kernel.forward(logits[t.start - at:t.start - at + t.rows], targets[rows])
                states.append(state)
            del logits
        ctx.save_for_backward(hidden, weight, targets, *factors)
        ctx.cut, ctx.chunk_tokens, ctx.kernel, ctx.n_groups, ctx.states = cut, chunk_tokens, kernel, n_groups, states
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, targets, *factors = ctx.saved_tensors
        n_groups = ctx.n_groups
        lows, low_weights = factors[:n_groups], factors[n_groups:]
        needs = ctx.needs_input_grad
        acc = compute_dtype(weight.dtype)  # dW and dB accumulate in float32 (thousands of tiles)
        grad_h = torch.empty_like(hidden) if needs[0] else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if needs[1] else None
        grad_lows = [torch.empty_like(low) if low is not None and needs[7 + g] else None for g, low in enumerate(lows)]
        grad_lws = [torch.zeros(lw.shape, dtype=acc, device=lw.device) if lw is not None and needs[7 + n_groups + g]
                    else None for g, lw in enumerate(low_weights)]
        grad_out = grad_out.to(acc)
        state = iter(ctx.states)
        for chunk in chunks(ctx.cut, ctx.chunk_tokens):
            at = chunk[0].start
            logits = _logits(hidden, weight, chunk, lows, low_weights)  # (C, V), recomputed
            # d logprob / d logits (C, V), in the logits' buffer where the kernel works in place (float32)
            g = logits if logits.dtype == acc else torch.empty(logits.shape, dtype=acc, device=logits.device)
            for t in chunk:
                rows, local = slice(t.start, t.start + t.rows), slice(t.start - at, t.start - at + t.rows)
                piece = ctx.kernel.grad_logits(logits[local], targets[rows], next(state), grad_out[rows])
                if piece.data_ptr() != g[local].data_ptr():  # the torch kernel works in place (float32)
                    g[local] = piece
            if grad_h is not None:
                grad_h[at:at + g.shape[0]] = tiled_products(g.to(weight.dtype), weight, chunk, at).to(hidden.dtype)
            for t in chunk:
                gt = g[t.start - at:t.start - at + t.rows]  # (rows, V)
                mine = slice(t.offset, t.offset + t.rows)
                if grad_w is not None:
                    grad_w.addmm_(gt.t().to(acc), hidden[t.start:t.start + t.rows].to(acc))
                low, lw = lows[t.group], low_weights[t.group]
                grad_low, grad_lw = grad_lows[t.group], grad_lws[t.group]
                if grad_low is not None:
                    grad_low[mine] = (gt.to(lw.dtype) @ lw).to(low.dtype)
                if grad_lw is not None:
                    grad_lw.addmm_(gt.t().to(acc), low[mine].to(acc))
            del g, logits
        return (grad_h, grad_w.to(weight.dtype) if grad_w is not None else None, None, None, None, None, None,
                *grad_lows, *(gw.to(lw.dtype) if gw is not None else None
                              for gw, lw in zip(grad_lws, low_weights, strict=True)))


def _logits(hidden: torch.Tensor, weight: torch.Tensor, chunk: list[Tile], lows: Any, low_weights: Any) -> torch.Tensor:
    """The chunk's logits (C, V): the frozen weight's in tiles, then each tile's own low-rank term in place."""
    at = chunk[0].start
    logits = tiled_products(hidden, weight.t(), chunk, 0)
    for t in chunk:
        low, lw = lows[t.group], low_weights[t.group]
        if low is not None:
            logits[t.start - at:t.start - at + t.rows].addmm_(low[t.offset:t.offset + t.rows], lw.t())
    return logits


def tiled_target_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, counts: list[int],
                          low_rank: list[tuple[torch.Tensor, torch.Tensor] | None], *, tile_rows: int,
                          chunk_tokens: int, kernel: ChunkKernel) -> torch.Tensor:
    """Target logprobs (N,) for hidden (N, H) (group g's ``counts[g]`` tokens after those of the groups before it),
    weight (V, H), targets (N,); ``low_rank[g]`` = (low (N_g, r), low_weight (V, r)) adds group g's adapter term."""
    tile_rows = max(1, min(tile_rows, chunk_tokens))
    lows = [p[0] if p is not None else None for p in low_rank]
    low_weights = [p[1] if p is not None else None for p in low_rank]
    return TiledHeadLogprobs.apply(hidden, weight, targets, tiles(counts, tile_rows), chunk_tokens, kernel,
                                   len(counts), *lows, *low_weights)


def routed_logprobs(routing: lora_routing.Routing, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    real: torch.Tensor, *, backend: str, chunk_tokens: int) -> torch.Tensor:
    """Target logprobs (B, T) (zeros at padding) of a routed pass's final hidden states (B, T, H), each group's real
    tokens (``real`` (B, T)) in tiles, with its adapter's output-projection term (worker/training/logprobs.py calls this
    when :meth:`Routing.tiled_head`)."""
    if backend == "apex":
        xentropy = load_apex_xentropy()
        kernel: ChunkKernel = ApexChunkKernel(xentropy) if xentropy is not None else TorchChunkKernel()
    else:
        kernel = TorchChunkKernel()
    h = hidden[real]  # (N, H): the groups' real tokens, group after group
    per_row = real.sum(1).tolist()  # (B,) real tokens per row
    counts, at = [], 0
    for n in routing.sizes:
        counts.append(int(sum(per_row[at:at + n])))
        at += n
    low_rank: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    with routing.whole():  # a group's own tokens: never taken for the batch's rows
        for h_g, (adapter, _) in zip(torch.split(h, counts), routing.groups, strict=True):
            pair = adapter.pair(routing.head) if adapter is not None and routing.head is not None else None
            if adapter is None or pair is None:
                low_rank.append(None)
                continue
            a, b = pair
            low_rank.append((F.linear(h_g, a.to(h.dtype)) * adapter.scaling, b.to(weight.dtype)))  # (N_g, r), (V, r)
    logprobs = tiled_target_logprobs(h, weight, targets[real], counts, low_rank, tile_rows=lora_routing.TILE_ROWS,
                                     chunk_tokens=chunk_tokens, kernel=kernel)  # (N,)
    out = torch.zeros(real.shape, dtype=logprobs.dtype, device=logprobs.device)
    return out.index_put((real,), logprobs)  # (B, T), differentiable

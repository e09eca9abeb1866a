"""The sampling engine's forwards: a decode step of a group's rows, and the prefill that makes new rows.

Numerics: rows of one group are left-padded to a common cache length, with an attention mask and explicit
position ids, so a row's logits are those of its own unpadded sequence (padded keys get exactly zero
attention weight); prompts are prefilled without padding (each distinct prompt once, batched with prompts of
the same length). A job that asks for its prompt's logprobs gets them from that same prefill
(worker/sampling/prompt_logprobs.py), as does one that asks for its prompt's top-k, target-token or alternative-token
answers (worker/sampling/prompt_scores.py).

Seeds: row ``r`` (sample index) of a job with seed ``s`` uses ``torch.Generator().manual_seed(row_seed(s, r))``
with ``row_seed(s, r) = (s * 1_000_003 + r) mod 2**64`` (unseeded jobs draw ``s`` at random). Its k-th token
is picked by inverse CDF with the k-th uniform of that generator over the temperature-scaled, top-k/top-p
filtered distribution; greedy rows (temperature 0) draw nothing. So a seed gives the same tokens whatever
other rows share the batch. The uniforms are drawn up front here (``torch.rand(max_tokens)`` on the CPU: the
same values as one draw per step, and the same on every device).
"""

from __future__ import annotations

import contextlib
import secrets
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tinkerq.worker.lora import routing
from tinkerq.worker.sampling import prompt_logprobs, prompt_scores
from tinkerq.worker.sampling.cache_rows import Group, KeyValues, Rows, kind_of, vectorised_stop
from tinkerq.worker.sampling.dense_decode import DenseDecode

if TYPE_CHECKING:
    from tinkerq.worker.sampling.torch_engine import Job

ROW_SEED_STRIDE = 1_000_003
PREFILL_TOKENS = 8192  # prompt tokens per prefill forward (bounds its activations)
# Decode and prefill plain dense decoders with worker/sampling/dense_decode.py (bitwise the model's own forward, less
# Python). Only tests and benchmarks turn it off, to compare the two.
DENSE_DECODE = True


def row_seed(seed: int, row: int) -> int:
    return (seed * ROW_SEED_STRIDE + row) % 2**64


def returned_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def prompt_key(job: Job) -> tuple[Any, ...]:
    """Rows prefilled together: one prompt under one adapter (None: the model itself)."""
    return (tuple(job.job.prompt), id(job.job.adapter) if job.job.adapter is not None else None)


def routed(adapters: list[Any], *, device: torch.device) -> contextlib.AbstractContextManager:
    """Route each row (of ``adapters``: one per row of the forward) to its adapter (LoRA snapshots over a shared
    base), or nothing when no row has one. The batch size lets modules that see the batch flattened to tokens
    (MoE experts: (B * T, H)) find each token's row."""
    return routing.restored(_routing(adapters, device))


def _routing(adapters: list[Any], device: torch.device) -> routing.Routing | None:
    if all(a is None for a in adapters):
        return None
    rows: dict[int, list[int]] = {}
    by_id = {}
    for r, a in enumerate(adapters):
        if a is not None:
            rows.setdefault(id(a), []).append(r)
            by_id[id(a)] = a
    return routing.Routing([(by_id[k], torch.tensor(v, device=device)) for k, v in rows.items()],
                           batch=len(adapters))


def _decode_routing(group: Group, device: torch.device) -> contextlib.AbstractContextManager:
    """:func:`routed` for the group's running rows, the same Routing from step to step while they stay the same
    rows (it holds each Linear's delta: built once, not at every step). The Routing holds its adapters, so the ids
    of the key cannot be reused while it is kept."""
    assert group.rows is not None
    adapters = [j.job.adapter for j in group.rows.jobs]
    key = tuple(id(a) for a in adapters)
    if group.route is None or group.route[0] != key:
        group.route = (key, _routing(adapters, device))
    return routing.restored(group.route[1])


def decode(group: Group) -> torch.Tensor:
    """Feed each row of ``group`` its last token; returns the next-token logits (B, V) float32."""
    rows = group.rows
    assert rows is not None
    t = rows.t
    width = t["mask"].shape[1]  # T
    mask = torch.cat([t["mask"], t["mask"].new_ones(len(rows.jobs), 1)], 1)  # (B, T+1)
    dense = _dense(group)
    if dense is not None and all(type(kind) is KeyValues for kind in group.kinds):
        with _decode_routing(group, mask.device):
            logits, rows.state = dense(t["last"], t["pos"], mask, rows.state)
        t["mask"] = mask
        t["pos"] += 1
        return logits
    for layer, kind, state in zip(group.cache.layers, group.kinds, rows.state, strict=True):
        kind.put(layer, state, width)
    with _decode_routing(group, mask.device):
        out = group.model(input_ids=t["last"][:, None], attention_mask=mask, position_ids=t["pos"][:, None],
                          use_cache=True, logits_to_keep=1, **{group.cache_kwarg: group.cache})
    group.cache = returned_cache(out)
    rows.state = [kind.read(layer) for layer, kind in zip(group.cache.layers, group.kinds, strict=True)]
    t["mask"] = mask
    t["pos"] += 1
    return out.logits[:, -1].float()


def _dense(group: Group) -> DenseDecode | None:
    """The group's fast forwards where they apply now (a hook on the model makes its own forward run)."""
    return group.dense if DENSE_DECODE and group.dense is not None and group.dense.applies() else None


def prefill_chunks(newcomers: list[Job]) -> list[list[Job]]:
    """Jobs grouped so that each chunk's distinct prompts have one length and fit PREFILL_TOKENS."""
    by_len: dict[int, dict[tuple[int, ...], list[Job]]] = {}
    for job in newcomers:
        by_len.setdefault(len(job.job.prompt), {}).setdefault(prompt_key(job), []).append(job)
    chunks = []
    for length, prompts in by_len.items():
        per_chunk = max(1, PREFILL_TOKENS // length)
        groups = list(prompts.values())
        chunks += [[j for g in groups[i:i + per_chunk] for j in g] for i in range(0, len(groups), per_chunk)]
    return chunks


def prefill(group: Group, jobs: list[Job]) -> tuple[Rows, torch.Tensor]:
    """Prefill the distinct prompts of ``jobs`` (all one length) in one unpadded forward; returns their rows
    (num_samples per job, the prompt's cache repeated) and the logits after the prompt (R, V)."""
    device = group.device
    index: dict[tuple[Any, ...], int] = {}  # (prompt, adapter) -> its row in the prefill
    adapters = []
    for job in jobs:
        if prompt_key(job) not in index:
            index[prompt_key(job)] = len(index)
            adapters.append(job.job.adapter)
    ids = torch.tensor([key[0] for key in index], dtype=torch.long, device=device)  # (N, P)
    asked = {prompt_key(j) for j in jobs if j.job.on_prompt_logprobs is not None}
    scored = [j for j in jobs if j.job.options is not None and j.job.options.asks_prompt()]
    looked_at = bool(asked or scored)  # the prefill's every position is needed
    # Every position's logits only for a model whose head cannot be applied to hidden states chunk by chunk.
    keep = 0 if looked_at and not group.fused_head else 1
    dense = _dense(group)
    if dense is not None and not looked_at:  # the same logits and cache, less Python (worker/sampling/dense_decode.py)
        with routed(adapters, device=device):
            last, cache = dense.prefill(ids)  # (N, V)
    else:
        with (routed(adapters, device=device),
              prompt_logprobs.final_hidden(group.model, looked_at and group.fused_head) as hidden):
            out = group.model(input_ids=ids, use_cache=True, logits_to_keep=keep)  # (N, keep or P, V) logits
            by_prompt = {key: _prompt_logprobs(group, ids, index[key], adapters, hidden, out.logits) for key in asked}
            for job in scored:  # each job its own: options and seeds differ between jobs of one prompt
                row = index[prompt_key(job)]
                chunks = prompt_scores.position_logits(
                    group.model, hidden=hidden[-1][row] if hidden else None,
                    logits=None if hidden else out.logits[row], adapter=adapters[row])
                assert job.job.options is not None
                job.prompt_scores = prompt_scores.score_prompt(chunks, ids.shape[1], job.job.options, job.job.params)
        for job in jobs:
            if job.job.on_prompt_logprobs is not None:
                job.prompt_logprobs = by_prompt[prompt_key(job)]
        cache, last = returned_cache(out), out.logits[:, -1].float()
    kinds = [kind_of(layer) for layer in cache.layers]  # raises for a layer it cannot batch
    if group.cache is None:
        group.cache, group.kinds = cache, kinds
    src = torch.tensor([index[prompt_key(j)] for j in jobs for _ in range(j.job.num_samples)],
                       device=device)  # (R,) the prompt of each row
    rows_n, length = len(src), ids.shape[1]
    # Copies (index_select): a decode updates some states in place (conv / recurrent states).
    state = [kind.select(kind.read(layer), src, length) for layer, kind in zip(cache.layers, kinds, strict=True)]
    logits = last.index_select(0, src)  # (R, V)

    width = max(j.job.max_tokens for j in jobs) + 1  # + a scratch column written by finished rows
    uniforms = torch.zeros(rows_n, width)
    stops = [sorted(j.job.stop.ids) if vectorised_stop(j.job.stop) else [] for j in jobs]
    stop_ids = torch.full((rows_n, max(map(len, stops))), -1, dtype=torch.long)
    temp, maxtok, samples, row_jobs = [], [], [], []
    r = 0
    for job, stop in zip(jobs, stops, strict=True):
        p, n = job.job.params, job.job.num_samples
        seed = p.seed if p.seed is not None else secrets.randbits(63)
        for s in range(n):
            if p.temperature != 0:  # greedy rows draw nothing
                gen = torch.Generator().manual_seed(row_seed(seed, s))
                uniforms[r, :job.job.max_tokens] = torch.rand(job.job.max_tokens, generator=gen)
            stop_ids[r, :len(stop)] = torch.tensor(stop, dtype=torch.long)
            temp.append(p.temperature or 1.0)
            maxtok.append(job.job.max_tokens)
            samples.append(s)
            row_jobs.append(job)
            r += 1
    t = {
        "mask": torch.ones(rows_n, length, dtype=torch.long, device=device),
        "uniforms": uniforms.to(device),
        "out_tok": torch.zeros(rows_n, width, dtype=torch.long, device=device),
        "out_lp": torch.zeros(rows_n, width, dtype=torch.float32, device=device),
        "stop_ids": stop_ids.to(device),
        "pos": torch.full((rows_n,), length, dtype=torch.long, device=device),
        "last": torch.zeros(rows_n, dtype=torch.long, device=device),
        "gen": torch.zeros(rows_n, dtype=torch.long, device=device),
        "maxtok": torch.tensor(maxtok, dtype=torch.long, device=device),
        "active": torch.ones(rows_n, dtype=torch.bool, device=device),
        "temp": torch.tensor(temp, dtype=torch.float32, device=device),
        "greedy": torch.tensor([j.job.params.temperature == 0 for j in row_jobs], device=device),
    }
    return Rows(group.kinds, state, t, row_jobs, samples), logits


def _prompt_logprobs(group: Group, ids: torch.Tensor, row: int, adapters: list[Any], hidden: list[torch.Tensor],
                     logits: torch.Tensor) -> np.ndarray:
    """The prompt logprobs (P,) of prefill row ``row`` of ``ids`` (N, P): from the final hidden states
    (N, P, H) the prefill kept, or from its logits (N, P, V) when they are every position's."""
    if hidden:
        return prompt_logprobs.from_hidden(group.model, hidden[-1][row], ids[row], adapters[row])
    return prompt_logprobs.from_logits(logits[row], ids[row])

"""Continuous batching on Hugging Face causal LMs with a KV cache, in one background thread (torch only).

Each loop iteration admits waiting jobs, then for every group of rows sharing weights (``model_key``) runs
one decode forward for its running rows and prefills its newcomers, samples one token per row, applies the
per-row stop rules and reports finished jobs. A job submitted while others run joins them at the next
iteration instead of waiting for the batch to drain.

Numerics: rows of one group are left-padded to a common cache length, with an attention mask and explicit
position ids, so a row's logits are those of its own unpadded sequence (padded keys get exactly zero
attention weight); prompts are prefilled without padding (each distinct prompt once, batched with prompts of
the same length). Each token's logprob is log_softmax of the raw logits (temperature 1); so are a prompt's
own logprobs when a job asks for them, computed from that same prefill (worker/sampling/prompt_logprobs.py).

Cache: the prefill lets the model build its own cache (one layer class per layer kind); the engine keeps the
rows' tensors of every cache layer itself (``_Rows.state``) and re-points the group's cache layers at them
before each decode forward, so rows can join and leave between steps. How a layer holds rows (``_kind``):
attention keys/values (B, H, T, D) are left-padded along T like the mask. A sliding-window layer keeps only
its last min(T, W-1) columns (all a next token can see: memory stays O(W)) and is told the column count T,
so the model's own mask puts the window at columns T-W+1..T; a left-padded row's columns are its positions
plus a constant, so that is its own last W positions. Linear-attention and Mamba layers hold a conv and a
recurrent state per row (no sequence dim, nothing to pad), flagged as past state so rows prefilled this step
continue theirs at their first decode. MoE / MLP blocks (DummyLayer) hold nothing. DeepSeek-V3's MLA caches
its compressed latent as keys (B, 1, T, kv_lora_rank) and the rope key as values (B, 1, T, rope_dim), and
re-expands them through ``kv_b_proj`` at every forward (so a hook on that projection applies at every step).
Any other layer class is refused at prefill rather than batched wrongly.

Seeds: row ``r`` (sample index) of a job with seed ``s`` uses ``torch.Generator().manual_seed(row_seed(s, r))``
with ``row_seed(s, r) = (s * 1_000_003 + r) mod 2**64`` (unseeded jobs draw ``s`` at random). Its k-th token
is picked by inverse CDF with the k-th uniform of that generator over the temperature-scaled, top-k/top-p
filtered distribution; greedy rows (temperature 0) draw nothing. So a seed gives the same tokens whatever
other rows share the batch. The uniforms are drawn up front (``torch.rand(max_tokens)`` on the CPU: the same
values as one draw per step, and the same on every device).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import secrets
import threading
from collections import deque
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionLayer,
)

from tinkerq import types
from tinkerq.worker.logprobs import fused_head_support
from tinkerq.worker.lora import routing
from tinkerq.worker.sampling import prompt_logprobs
from tinkerq.worker.sampling.engine import EngineClosed, SampleJob
from tinkerq.worker.sampling.rules import StopRule, filter_logits

log = logging.getLogger(__name__)

ROW_SEED_STRIDE = 1_000_003
PREFILL_TOKENS = 8192  # prompt tokens per prefill forward (bounds its activations)


def row_seed(seed: int, row: int) -> int:
    return (seed * ROW_SEED_STRIDE + row) % 2**64


def _cache_kwarg(model: Any) -> str:
    """transformers 5 names the KV cache argument ``cache``; older releases ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _returned_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _pad_cat(parts: list[torch.Tensor], dim: int, left: bool, fill: float) -> torch.Tensor:
    """Concatenate along dim 0, padding ``dim`` to the widest part (on the left or the right) with ``fill``."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.shape[dim] for p in parts)
    shape = list(parts[0].shape)
    shape[0], shape[dim] = sum(p.shape[0] for p in parts), width
    out = parts[0].new_full(shape, fill)
    row = 0
    for p in parts:
        start = width - p.shape[dim] if left else 0
        out[row:row + p.shape[0]].narrow(dim, start, p.shape[dim]).copy_(p)
        row += p.shape[0]
    return out


# -- the cache layers' per-row state -------------------------------------------------------------------------

State = list[torch.Tensor | None]  # one cache layer's tensors for a set of rows, each with the row dim first


class _Kind:
    """How one kind of cache layer holds rows: re-pointed at the rows' tensors before a decode forward
    (``width``: the group's cache columns T, before the fed token), read back after it, and how rows are
    selected (dropping leading columns that are padding in all of them) or concatenated."""

    size = 0  # tensors per layer

    def put(self, layer: Any, state: State, width: int) -> None:
        pass

    def read(self, layer: Any) -> State:
        return []

    def select(self, state: State, idx: torch.Tensor, width: int) -> State:
        return []

    def cat(self, states: list[State]) -> State:
        return []


class _NoState(_Kind):
    """A block without a cache (MoE / MLP layers of hybrid models: DummyLayer)."""


class _KeyValues(_Kind):
    """Attention keys and values (B, H, T, D), left-padded along T like the mask. Also MLA's latent cache:
    keys (B, 1, T, kv_lora_rank), values (B, 1, T, qk_rope_head_dim)."""

    size = 2

    def put(self, layer: Any, state: State, width: int) -> None:
        layer.keys, layer.values = state

    def read(self, layer: Any) -> State:
        return [layer.keys, layer.values]

    def select(self, state: State, idx: torch.Tensor, width: int) -> State:
        return [None if x is None else _last_columns(x.index_select(0, idx), width) for x in state]

    def cat(self, states: list[State]) -> State:
        return [None if (xs := _present(parts)) is None else _pad_cat(xs, 2, True, 0.0)
                for parts in zip(*states, strict=True)]


class _Window(_KeyValues):
    """A sliding-window layer: keys/values (B, H, min(T, W-1), D), the last columns, all a next token sees.

    The layer sizes the mask from ``cumulative_length`` (columns T-W+1..T when T >= W), so it is told T. The
    window is in column space; a left-padded row's columns are its positions plus a constant, so it is the
    row's own last W positions. Rows concatenated from shorter groups are padded on the left like the mask.
    """

    def put(self, layer: Any, state: State, width: int) -> None:
        super().put(layer, state, width)
        layer.cumulative_length = width


class _Recurrent(_Kind):
    """Linear attention / Mamba: per state index a conv state and a recurrent state, one per row (no sequence
    dim, so no padding); ``state`` is [conv_0, recurrent_0, conv_1, ...], None where the layer has none."""

    def __init__(self, states: int) -> None:
        self.states = states
        self.size = 2 * states

    def put(self, layer: Any, state: State, width: int) -> None:
        for i in range(self.states):
            conv, recurrent = state[2 * i], state[2 * i + 1]
            layer.conv_states[i], layer.recurrent_states[i] = conv, recurrent
            # Past state for every row, rows prefilled this step included: the decode continues it (a False
            # flag would make the model start from zeros).
            layer.has_previous_state[i] = conv is not None or recurrent is not None

    def read(self, layer: Any) -> State:
        return [x for i in range(self.states) for x in (layer.conv_states[i], layer.recurrent_states[i])]

    def select(self, state: State, idx: torch.Tensor, width: int) -> State:
        return [None if x is None else x.index_select(0, idx) for x in state]

    def cat(self, states: list[State]) -> State:
        return [None if (xs := _present(parts)) is None else torch.cat(xs) for parts in zip(*states, strict=True)]


class _Both(_Kind):
    """A layer with linear-attention state and attention keys/values (LinearAttentionAnd*Layer)."""

    def __init__(self, first: _Kind, second: _Kind) -> None:
        self.first, self.second = first, second
        self.size = first.size + second.size

    def put(self, layer: Any, state: State, width: int) -> None:
        self.first.put(layer, state[:self.first.size], width)
        self.second.put(layer, state[self.first.size:], width)

    def read(self, layer: Any) -> State:
        return self.first.read(layer) + self.second.read(layer)

    def select(self, state: State, idx: torch.Tensor, width: int) -> State:
        n = self.first.size
        return self.first.select(state[:n], idx, width) + self.second.select(state[n:], idx, width)

    def cat(self, states: list[State]) -> State:
        n = self.first.size
        return self.first.cat([s[:n] for s in states]) + self.second.cat([s[n:] for s in states])


def _present(parts: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor] | None:
    """One tensor of a layer from several sets of rows, or None where the layer holds none (a state the model
    never wrote: None for every set of rows, as all come from the same model)."""
    xs = [x for x in parts if x is not None]
    if not xs:
        return None
    assert len(xs) == len(parts), "rows of one cache layer hold different tensors"
    return xs


def _last_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    """The last min(width, C) of the C columns of ``x`` (B, H, C, D): rows selected from a group whose cache
    now has ``width`` columns; for full attention (C = T) this drops the leading all-padding columns."""
    keep = min(width, x.shape[2])
    return x.narrow(2, x.shape[2] - keep, keep)


def _kind(layer: Any) -> _Kind:
    """The kind of a cache layer the model built. Exact classes: a subclass may hold more (an indexer's keys,
    quantised or offloaded tensors), which these kinds would silently drop."""
    cls = type(layer)
    if cls is DummyLayer:
        return _NoState()
    if cls is DynamicLayer:
        return _KeyValues()
    if cls is DynamicSlidingWindowLayer and not layer.record_past:
        return _Window()
    if cls is LinearAttentionLayer and not layer.record_past:
        return _Recurrent(layer.number_of_states)
    if cls is LinearAttentionAndFullAttentionLayer and not layer.record_past:
        return _Both(_Recurrent(layer.number_of_states), _KeyValues())
    if cls is LinearAttentionAndSlidingWindowAttentionLayer and not layer.record_past:
        return _Both(_Recurrent(layer.number_of_states), _Window())
    raise NotImplementedError(f"the sampling engine cannot batch rows of a {cls.__name__} cache layer")


# The 2-D per-row tensors: (pad on the left?, fill) when rows of different widths are concatenated.
_PAD2D = {
    "mask": (True, 0),  # (B, T) 1 where the cache column holds a real token; left-padded like the cache
    "uniforms": (False, 0.0),  # (B, W) column k: the uniform that picks the row's k-th token
    "out_tok": (False, 0),  # (B, W) tokens sampled so far (column gen is scratch)
    "out_lp": (False, 0.0),  # (B, W) their logprobs
    "stop_ids": (False, -1),  # (B, S) the row's stop token ids, -1 = none
}
# The 1-D ones, all (B,): pos (position of the next fed token), last (token to feed next), gen (tokens
# sampled), maxtok, active (not finished), temp (1 for greedy rows), greedy.


class _Job:
    """A submitted job's progress: its sequences as rows finish."""

    def __init__(self, job: SampleJob, on_report: Callable[[_Job], None]) -> None:
        self.job = job
        self._on_report = on_report
        self.results: list[types.SampledSequence | None] = [None] * job.num_samples
        self.left = job.num_samples
        self.reported = False
        self.prompt_logprobs: np.ndarray | None = None  # (P,), set at prefill when the job asks

    def report(self, sequences: list[types.SampledSequence] | None, error: BaseException | None) -> None:
        if self.reported:
            return
        self.reported = True
        self._on_report(self)  # before the answer: whoever hears it sees the rows gone
        try:
            if sequences is not None and self.job.on_prompt_logprobs is not None:
                assert self.prompt_logprobs is not None  # computed at prefill, before any row could finish
                self.job.on_prompt_logprobs(self.prompt_logprobs)
            self.job.on_done(sequences, error)
        except Exception:  # a caller's bug must not stop the engine
            log.exception("sampling on_done callback raised; ignored")


class _Rows:
    """Rows sharing one cache. Every tensor has the row (batch) dim first; ``state`` is per cache layer."""

    def __init__(self, kinds: list[_Kind], state: list[State], t: dict[str, torch.Tensor],
                 jobs: list[_Job], samples: list[int]) -> None:
        self.kinds = kinds  # per layer, how its state is selected / concatenated (the group's)
        self.state = state  # per layer, the rows' tensors in that cache layer (see _Kind)
        self.t = t
        self.jobs = jobs  # (B,) the job of each row
        self.samples = samples  # (B,) the row's sample index in its job

    def select(self, idx: torch.Tensor) -> _Rows:
        """The rows ``idx`` (B',), with the leading cache columns that are padding in all of them dropped."""
        t = {name: x.index_select(0, idx) for name, x in self.t.items()}
        first = int(t["mask"].any(0).int().argmax())  # every row holds its prompt, so some column is real
        t["mask"] = t["mask"][:, first:]
        width = t["mask"].shape[1]
        state = [kind.select(s, idx, width) for kind, s in zip(self.kinds, self.state, strict=True)]
        keep = idx.tolist()
        return _Rows(self.kinds, state, t, [self.jobs[i] for i in keep], [self.samples[i] for i in keep])

    @staticmethod
    def cat(parts: list[_Rows]) -> _Rows:
        if len(parts) == 1:
            return parts[0]
        t = {}
        for name in parts[0].t:
            left, fill = _PAD2D.get(name, (False, 0))
            xs = [p.t[name] for p in parts]
            t[name] = _pad_cat(xs, 1, left, fill) if name in _PAD2D else torch.cat(xs)
        kinds = parts[0].kinds
        state = [kind.cat([p.state[i] for p in parts]) for i, kind in enumerate(kinds)]
        return _Rows(kinds, state, t, [j for p in parts for j in p.jobs], [s for p in parts for s in p.samples])


class _Group:
    """The running rows of one model_key: one cache, one forward per step."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache_kwarg = _cache_kwarg(model)
        self.device = next(model.parameters()).device
        # Prompt logprobs from hidden states and the output embedding (else from every position's logits).
        self.fused_head = fused_head_support(model) is None
        self.cache: Any = None  # the cache the model made at the first prefill; its layers are re-pointed at rows
        self.kinds: list[_Kind] = []  # per cache layer (set with ``cache``)
        self.rows: _Rows | None = None
        self.finished = 0  # rows finished but not yet dropped (compaction is amortised)
        self.refresh()

    @property
    def size(self) -> int:
        return 0 if self.rows is None else len(self.rows.jobs)

    def refresh(self) -> None:
        """Per-row facts that change only when rows join or leave."""
        self.filters: list[tuple[int, float, torch.Tensor]] = []  # (top_k, top_p, rows)
        self.py_stop: list[int] = []  # rows whose stop rule needs Python (stop strings)
        self.all_greedy = self.any_greedy = False
        self.plain = False  # every row samples at temperature 1 with no filter (the common RL case)
        if self.rows is None:
            return
        by_filter: dict[tuple[int, float], list[int]] = {}
        greedy = []
        for r, job in enumerate(self.rows.jobs):
            p = job.job.params
            greedy.append(p.temperature == 0)
            if p.temperature != 0 and (p.top_k > 0 or p.top_p < 1.0):
                by_filter.setdefault((p.top_k, p.top_p), []).append(r)
            if not _vectorised_stop(job.job.stop):
                self.py_stop.append(r)
        self.filters = [(k, p, torch.tensor(rows, device=self.device)) for (k, p), rows in by_filter.items()]
        self.all_greedy, self.any_greedy = all(greedy), any(greedy)
        self.plain = not by_filter and all(j.job.params.temperature == 1.0 for j in self.rows.jobs)


def _vectorised_stop(stop: StopRule) -> bool:
    """A plain StopRule with ids only: checked on tensors (its ``done`` is ``tokens[-1] in ids``)."""
    return type(stop) is StopRule and not stop.strings


def _prompt_key(job: _Job) -> tuple[Any, ...]:
    """Rows prefilled together: one prompt under one adapter (None: the model itself)."""
    return (tuple(job.job.prompt), id(job.job.adapter) if job.job.adapter is not None else None)


def _routed(adapters: list[Any], *, device: torch.device) -> contextlib.AbstractContextManager:
    """Route each row (of ``adapters``: one per row of the forward) to its adapter (LoRA snapshots over a shared
    base), or nothing when no row has one. The batch size lets modules that see the batch flattened to tokens
    (MoE experts: (B * T, H)) find each token's row."""
    if all(a is None for a in adapters):
        return contextlib.nullcontext()
    rows: dict[int, list[int]] = {}
    by_id = {}
    for r, a in enumerate(adapters):
        if a is not None:
            rows.setdefault(id(a), []).append(r)
            by_id[id(a)] = a
    return routing.routed([(by_id[k], torch.tensor(v, device=device)) for k, v in rows.items()], batch=len(adapters))


class TorchEngine:
    """Continuous batching for Hugging Face causal LMs. ``gate`` wraps every forward (to share compute)."""

    def __init__(self, max_rows: int = 256, gate: Callable[[], AbstractContextManager] | None = None) -> None:
        self.max_rows = max_rows
        self._gate = gate or contextlib.nullcontext
        self._cond = threading.Condition()
        self._waiting: deque[_Job] = deque()
        self._open_rows = 0  # rows of jobs submitted and not answered yet
        self._groups: dict[Hashable, _Group] = {}  # engine thread only
        self._closed = False
        self._thread: threading.Thread | None = None
        self.steps = 0  # loop iterations done: lets tests (and metrics) observe progress

    # -- the interface ---------------------------------------------------------------------------------

    def submit(self, job: SampleJob) -> None:
        if job.num_samples < 1 or job.max_tokens < 1 or not job.prompt:
            raise ValueError("a sample job needs a prompt, num_samples >= 1 and max_tokens >= 1")
        with self._cond:
            if self._closed:
                raise EngineClosed("the sampling engine is closed")
            self._waiting.append(_Job(job, self._answered))
            self._open_rows += job.num_samples
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sampling-engine", daemon=True)
                self._thread.start()
            self._cond.notify()

    def load(self) -> int:
        return self._open_rows

    def _answered(self, job: _Job) -> None:
        with self._cond:
            self._open_rows -= job.job.num_samples

    def close(self, timeout: float | None = None) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # -- the loop --------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with torch.no_grad():  # not inference_mode: a model's lazily built buffers must stay usable in training
                while self._iteration():
                    self.steps += 1
        except BaseException:
            log.exception("sampling engine thread died")
        finally:
            with self._cond:
                self._closed = True
                waiting, self._waiting = list(self._waiting), deque()
            error = EngineClosed("the sampling engine closed before the job finished")
            for group in self._groups.values():
                for job in group.rows.jobs if group.rows else []:
                    job.report(None, error)
            self._groups.clear()
            for job in waiting:
                job.report(None, error)

    def _iteration(self) -> bool:
        with self._cond:
            while not self._closed and not self._waiting and not self._groups:
                self._cond.wait()
            if self._closed:
                return False
            # Admit in FIFO order while the rows fit (a job larger than max_rows alone still runs).
            running = sum(g.size - g.finished for g in self._groups.values())
            admitted: dict[Hashable, list[_Job]] = {}
            while self._waiting and (running == 0 or running + self._waiting[0].job.num_samples <= self.max_rows):
                job = self._waiting.popleft()
                running += job.job.num_samples
                admitted.setdefault(job.job.model_key, []).append(job)
        for key, newcomers in admitted.items():
            if key not in self._groups:
                try:
                    self._groups[key] = _Group(newcomers[0].job.model)
                except Exception as exc:
                    for job in newcomers:
                        job.report(None, exc)
        for key in list(self._groups):
            group = self._groups[key]
            self._step(group, admitted.get(key, []))
            if group.rows is None:
                del self._groups[key]
        return True

    def _step(self, group: _Group, newcomers: list[_Job]) -> None:
        """One token for every row of ``group``; an error fails this group's jobs only."""
        logits = None
        if group.rows is not None:
            try:
                logits = self._decode(group)  # (B, V)
            except Exception as exc:
                self._fail(group, exc)
        parts, new_logits = [], []
        for chunk in self._prefill_chunks(newcomers):
            try:
                rows, chunk_logits = self._prefill(group, chunk)
                parts.append(rows)
                new_logits.append(chunk_logits)
            except Exception as exc:
                for job in chunk:
                    job.report(None, exc)
        if group.rows is None and not parts:
            return
        try:
            if group.rows is None and len(parts) == 1:  # nothing to merge with
                group.rows, parts = parts[0], []
                logits = new_logits[0]
                group.refresh()
            if parts:  # merge the newcomers in; the finished rows go at the same time
                if group.rows is not None and group.finished == 0:
                    parts.insert(0, group.rows)
                    new_logits.insert(0, logits)
                elif group.rows is not None:
                    keep = group.rows.t["active"].nonzero().squeeze(1)  # (B',)
                    parts.insert(0, group.rows.select(keep))
                    new_logits.insert(0, logits.index_select(0, keep))
                group.rows, group.finished = _Rows.cat(parts), 0
                logits = torch.cat(new_logits)
                group.refresh()
            self._sample(group, logits)
        except Exception as exc:
            for rows in parts:  # newcomers not merged yet
                for job in rows.jobs:
                    job.report(None, exc)
            self._fail(group, exc)

    def _fail(self, group: _Group, exc: BaseException) -> None:
        log.exception("sampling step failed for %d rows", group.size, exc_info=exc)
        for job in group.rows.jobs if group.rows else []:
            job.report(None, exc)
        group.rows, group.finished = None, 0
        group.refresh()

    # -- forwards --------------------------------------------------------------------------------------

    def _decode(self, group: _Group) -> torch.Tensor:
        """Feed each row's last token; returns the next-token logits (B, V) float32."""
        rows = group.rows
        t = rows.t
        width = t["mask"].shape[1]  # T
        mask = torch.cat([t["mask"], t["mask"].new_ones(len(rows.jobs), 1)], 1)  # (B, T+1)
        for layer, kind, state in zip(group.cache.layers, group.kinds, rows.state, strict=True):
            kind.put(layer, state, width)
        with self._gate(), _routed([j.job.adapter for j in rows.jobs], device=mask.device):
            out = group.model(input_ids=t["last"][:, None], attention_mask=mask, position_ids=t["pos"][:, None],
                              use_cache=True, logits_to_keep=1, **{group.cache_kwarg: group.cache})
        group.cache = _returned_cache(out)
        rows.state = [kind.read(layer) for layer, kind in zip(group.cache.layers, group.kinds, strict=True)]
        t["mask"] = mask
        t["pos"] += 1
        return out.logits[:, -1].float()

    @staticmethod
    def _prefill_chunks(newcomers: list[_Job]) -> list[list[_Job]]:
        """Jobs grouped so that each chunk's distinct prompts have one length and fit PREFILL_TOKENS."""
        by_len: dict[int, dict[tuple[int, ...], list[_Job]]] = {}
        for job in newcomers:
            by_len.setdefault(len(job.job.prompt), {}).setdefault(_prompt_key(job), []).append(job)
        chunks = []
        for length, prompts in by_len.items():
            per_chunk = max(1, PREFILL_TOKENS // length)
            groups = list(prompts.values())
            chunks += [[j for g in groups[i:i + per_chunk] for j in g] for i in range(0, len(groups), per_chunk)]
        return chunks

    def _prefill(self, group: _Group, jobs: list[_Job]) -> tuple[_Rows, torch.Tensor]:
        """Prefill the distinct prompts of ``jobs`` (all one length) in one unpadded forward; returns their
        rows (num_samples per job, the prompt's cache repeated) and the logits after the prompt (R, V)."""
        device = group.device
        index: dict[tuple[Any, ...], int] = {}  # (prompt, adapter) -> its row in the prefill
        adapters = []
        for job in jobs:
            if _prompt_key(job) not in index:
                index[_prompt_key(job)] = len(index)
                adapters.append(job.job.adapter)
        ids = torch.tensor([key[0] for key in index], dtype=torch.long, device=device)  # (N, P)
        asked = {_prompt_key(j) for j in jobs if j.job.on_prompt_logprobs is not None}
        # Every position's logits only for a model whose head cannot be applied to hidden states chunk by chunk.
        keep = 0 if asked and not group.fused_head else 1
        with (self._gate(), _routed(adapters, device=device),
              prompt_logprobs.final_hidden(group.model, bool(asked) and group.fused_head) as hidden):
            out = group.model(input_ids=ids, use_cache=True, logits_to_keep=keep)  # (N, keep or P, V) logits
            by_prompt = {key: self._prompt_logprobs(group, ids, index[key], adapters, hidden, out.logits)
                         for key in asked}
        for job in jobs:
            if job.job.on_prompt_logprobs is not None:
                job.prompt_logprobs = by_prompt[_prompt_key(job)]
        cache = _returned_cache(out)
        kinds = [_kind(layer) for layer in cache.layers]  # raises for a layer it cannot batch
        if group.cache is None:
            group.cache, group.kinds = cache, kinds
        src = torch.tensor([index[_prompt_key(j)] for j in jobs for _ in range(j.job.num_samples)],
                           device=device)  # (R,) the prompt of each row
        rows_n, length = len(src), ids.shape[1]
        # Copies (index_select): a decode updates some states in place (conv / recurrent states).
        state = [kind.select(kind.read(layer), src, length) for layer, kind in zip(cache.layers, kinds, strict=True)]
        logits = out.logits[:, -1].float().index_select(0, src)  # (R, V)

        width = max(j.job.max_tokens for j in jobs) + 1  # + a scratch column written by finished rows
        uniforms = torch.zeros(rows_n, width)
        stops = [sorted(j.job.stop.ids) if _vectorised_stop(j.job.stop) else [] for j in jobs]
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
        temp_t = torch.tensor(temp, dtype=torch.float32, device=device)
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
            "temp": temp_t,
            "greedy": torch.tensor([j.job.params.temperature == 0 for j in row_jobs], device=device),
        }
        return _Rows(group.kinds, state, t, row_jobs, samples), logits

    @staticmethod
    def _prompt_logprobs(group: _Group, ids: torch.Tensor, row: int, adapters: list[Any], hidden: list[torch.Tensor],
                         logits: torch.Tensor) -> np.ndarray:
        """The prompt logprobs (P,) of prefill row ``row`` of ``ids`` (N, P): from the final hidden states
        (N, P, H) the prefill kept, or from its logits (N, P, V) when they are every position's."""
        if hidden:
            return prompt_logprobs.from_hidden(group.model, hidden[-1][row], ids[row], adapters[row])
        return prompt_logprobs.from_logits(logits[row], ids[row])

    # -- sampling --------------------------------------------------------------------------------------

    def _sample(self, group: _Group, logits: torch.Tensor) -> None:
        """Pick one token per row from ``logits`` (B, V), record it, finish rows, report finished jobs."""
        rows = group.rows
        t = rows.t
        gen = t["gen"]
        greedy_tok = logits.argmax(-1) if group.any_greedy else None  # (B,)
        lse = None
        if group.all_greedy:
            tok = greedy_tok
        else:
            scaled = logits if group.plain else logits / t["temp"][:, None]  # (B, V)
            for top_k, top_p, idx in group.filters:  # one call per distinct (top_k, top_p)
                scaled[idx] = filter_logits(scaled[idx], top_k, top_p)
            # Inverse CDF over the unnormalised probabilities: the first token whose cumulative mass exceeds
            # u * total (filtered tokens add nothing, so they are never picked).
            peak = scaled.amax(-1, keepdim=True)  # (B, 1)
            cdf = (scaled - peak).exp_().cumsum_(-1)  # (B, V)
            target = t["uniforms"].gather(1, gen[:, None]) * cdf[:, -1:]  # (B, 1)
            tok = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=logits.shape[1] - 1)
            if greedy_tok is not None:
                tok = torch.where(t["greedy"], greedy_tok, tok)
            if group.plain:  # the sampling distribution is the temperature-1 one: reuse its normaliser
                lse = peak.squeeze(1) + cdf[:, -1].log()
        if lse is None:
            lse = torch.logsumexp(logits, -1)
        lp = logits.gather(1, tok[:, None]).squeeze(1) - lse  # (B,) log p at temperature 1

        active = t["active"]
        t["out_tok"].scatter_(1, gen[:, None], tok[:, None])  # finished rows write their scratch column
        t["out_lp"].scatter_(1, gen[:, None], lp[:, None])
        t["last"] = tok
        gen += active
        stopped = (tok[:, None] == t["stop_ids"]).any(1)  # (B,)
        if group.py_stop:  # stop strings: the rule decodes the row's tokens
            idx = torch.tensor(group.py_stop, device=gen.device)
            for r, alive, n in zip(group.py_stop, active[idx].tolist(), gen[idx].tolist(), strict=True):
                if alive and rows.jobs[r].job.stop.done(t["out_tok"][r, :n].tolist()):
                    stopped[r] = True
        done = active & (stopped | (gen >= t["maxtok"]))
        finished = done.nonzero().squeeze(1)
        if len(finished) == 0:
            return
        active &= ~done
        group.finished += len(finished)
        toks, lps = t["out_tok"][finished], t["out_lp"][finished]  # (F, W)
        for i, (r, n, stop) in enumerate(zip(finished.tolist(), gen[finished].tolist(),
                                             stopped[finished].tolist(), strict=True)):
            job = rows.jobs[r]
            job.results[rows.samples[r]] = types.SampledSequence(
                stop_reason="stop" if stop else "length", tokens=toks[i, :n].tolist(), logprobs=lps[i, :n].tolist())
            job.left -= 1
            if job.left == 0:
                job.report(job.results, None)  # type: ignore[arg-type]
        # Drop finished rows once they are >= 1/8 of the batch (each drop copies the cache).
        if group.finished == group.size:
            group.rows, group.finished = None, 0
            group.refresh()
        elif group.finished * 8 >= group.size:
            group.rows, group.finished = rows.select(active.nonzero().squeeze(1)), 0
            group.refresh()

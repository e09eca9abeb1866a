"""The sampling engine's running rows: how each kind of cache layer holds them, and the rows of one weights.

The prefill lets the model build its own cache (one layer class per layer kind); the engine keeps the rows'
tensors of every cache layer itself (``Rows.state``) and re-points the group's cache layers at them before
each decode forward, so rows can join and leave between steps. How a layer holds rows (:func:`kind_of`):
attention keys/values (B, H, T, D) are left-padded along T like the mask. A sliding-window layer keeps only
its last min(T, W-1) columns (all a next token can see: memory stays O(W)) and is told the column count T,
so the model's own mask puts the window at columns T-W+1..T; a left-padded row's columns are its positions
plus a constant, so that is its own last W positions. Linear-attention and Mamba layers hold a conv and a
recurrent state per row (no sequence dim, nothing to pad), flagged as past state so rows prefilled this step
continue theirs at their first decode. MoE / MLP blocks (DummyLayer) hold nothing. DeepSeek-V3's MLA caches
its compressed latent as keys (B, 1, T, kv_lora_rank) and the rope key as values (B, 1, T, rope_dim), and
re-expands them through ``kv_b_proj`` at every forward (so a hook on that projection applies at every step).
A sparse-attention layer (DeepSeek-V3.2's and GLM-5's DSA) adds its indexer's keys (B, T, D), padded like the keys.
DeepSeek-V4's compressed-attention layers keep their rows themselves (:class:`InLayer`): their groups run one
prefill's rows in lockstep.
Any other layer class is refused at prefill rather than batched wrongly (and the classes whose caches are known not
to batch are refused when their sampler is made: worker/loading/support.py).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import (
    DummyLayer,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionLayer,
)

from tinkerq.worker.sampling.dense_decode import DenseDecode, dense_decode
from tinkerq.worker.sampling.rules import StopRule
from tinkerq.worker.training.logprobs import fused_head_support

if TYPE_CHECKING:
    from tinkerq.worker.sampling.torch_engine import Job

State = list[torch.Tensor | None]  # one cache layer's tensors for a set of rows, each with the row dim first


def pad_cat(parts: list[torch.Tensor], dim: int, left: bool, fill: float) -> torch.Tensor:
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


class Kind:
    """How one kind of cache layer holds rows: re-pointed at the rows' tensors before a decode forward
    (``width``: the group's cache columns T, before the fed token), read back after it, and how rows are
    selected (dropping leading columns that are padding in all of them) or concatenated."""

    size = 0  # tensors per layer
    lockstep = False  # rows of different lengths cannot share the layer (InLayer)

    def put(self, layer: Any, state: State, width: int) -> None:
        pass

    def read(self, layer: Any) -> State:
        return []

    def select(self, state: State, idx: torch.Tensor, width: int) -> State:
        return []

    def cat(self, states: list[State]) -> State:
        return []


class NoState(Kind):
    """A block without a cache (MoE / MLP layers of hybrid models: DummyLayer)."""


class KeyValues(Kind):
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
        return [None if (xs := _present(parts)) is None else pad_cat(xs, 2, True, 0.0)
                for parts in zip(*states, strict=True)]


class Window(KeyValues):
    """A sliding-window layer: keys/values (B, H, min(T, W-1), D), the last columns, all a next token sees.

    The layer sizes the mask from ``cumulative_length`` (columns T-W+1..T when T >= W), so it is told T. The
    window is in column space; a left-padded row's columns are its positions plus a constant, so it is the
    row's own last W positions. Rows concatenated from shorter groups are padded on the left like the mask.
    """

    def put(self, layer: Any, state: State, width: int) -> None:
        super().put(layer, state, width)
        layer.cumulative_length = width


class Indexed(KeyValues):
    """A sparse-attention layer (DeepSeek-V3.2's and GLM-5's DSA): keys and values as :class:`KeyValues`, plus the
    indexer's own keys (B, T, D), one head, left-padded along T like the mask. The indexer scores every cached
    column with the attention mask added before its top-k, so a padding column is never chosen over a real one."""

    size = 3

    def put(self, layer: Any, state: State, width: int) -> None:
        layer.keys, layer.values, layer.indexer_keys = state
        layer.is_indexer_initialized = state[2] is not None

    def read(self, layer: Any) -> State:
        return [layer.keys, layer.values, layer.indexer_keys if layer.is_indexer_initialized else None]

    def select(self, state: State, idx: torch.Tensor, width: int) -> State:
        keys, values, index = state
        if index is not None:  # (B, T, D) as (B, 1, T, D): the same columns as the keys'
            index = _last_columns(index.index_select(0, idx).unsqueeze(1), width).squeeze(1)
        return [*super().select([keys, values], idx, width), index]

    def cat(self, states: list[State]) -> State:
        index = _present(tuple(s[2] for s in states))
        return [*super().cat([s[:2] for s in states]), None if index is None else pad_cat(index, 1, True, 0.0)]


class InLayer(Kind):
    """A cache layer whose rows only it can hold (DeepSeek-V4's compressed-attention layers: a sliding window plus
    compressor buffers, overlap state and emitted entries counted once per layer, not per row). Its rows stay in the
    layer itself, which selects them (``reorder_cache``); rows of different lengths cannot share it, so its group holds
    one prefill's rows in lockstep and never takes newcomers (:attr:`Group.lockstep`)."""

    size = 1
    lockstep = True

    def read(self, layer: Any) -> State:
        return [layer]  # the layer itself stands for its rows

    def select(self, state: State, idx: torch.Tensor, width: int) -> State:
        layer: Any = state[0]
        layer.reorder_cache(idx)  # every tensor of its rows, index_select'ed along the batch
        return [layer]

    def cat(self, states: list[State]) -> State:
        raise AssertionError("rows of a lockstep cache are never concatenated")


class Recurrent(Kind):
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


class Both(Kind):
    """A layer with linear-attention state and attention keys/values (LinearAttentionAnd*Layer)."""

    def __init__(self, first: Kind, second: Kind) -> None:
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


# Cache layer classes whose rows stay in the layer (InLayer), by name: importing their modeling module to compare
# classes would load it for every model.
_IN_LAYER = frozenset({"DeepseekV4HCACache", "DeepseekV4CSACache"})


def lockstep(model: Any) -> bool:
    """Whether ``model``'s cache holds rows only in lockstep (an InLayer kind): read from the cache layers its config
    makes (transformers' DynamicCache(config=...)), without a forward; cached on the model."""
    known = getattr(model, "_tinkerq_lockstep", None)
    if isinstance(known, bool):
        return known
    from transformers import DynamicCache

    try:
        layers = DynamicCache(config=model.config).layers
    except Exception:  # a model whose cache is its own class (MiniMax's): the prefill's layers decide, as before
        layers = []
    found = any(type(layer).__name__ in _IN_LAYER for layer in layers)
    model._tinkerq_lockstep = found
    return found


def kind_of(layer: Any) -> Kind:
    """The kind of a cache layer the model built. Exact classes: a subclass may hold more (an indexer's keys,
    quantised or offloaded tensors), which these kinds would silently drop."""
    cls = type(layer)
    if cls is DummyLayer:
        return NoState()
    if cls is DynamicLayer:
        return KeyValues()
    if cls is DynamicIndexedLayer and layer.indexer_position_ids is None:
        return Indexed()
    if cls.__name__ in _IN_LAYER:
        return InLayer()
    if cls is DynamicSlidingWindowLayer and not layer.record_past:
        return Window()
    if cls is LinearAttentionLayer and not layer.record_past:
        return Recurrent(layer.number_of_states)
    if cls is LinearAttentionAndFullAttentionLayer and not layer.record_past:
        return Both(Recurrent(layer.number_of_states), KeyValues())
    if cls is LinearAttentionAndSlidingWindowAttentionLayer and not layer.record_past:
        return Both(Recurrent(layer.number_of_states), Window())
    raise NotImplementedError(f"the sampling engine cannot batch rows of a {cls.__name__} cache layer")


# -- rows ------------------------------------------------------------------------------------------------------

# The 2-D per-row tensors: (pad on the left?, fill) when rows of different widths are concatenated.
PAD2D = {
    "mask": (True, 0),  # (B, T) 1 where the cache column holds a real token; left-padded like the cache
    "uniforms": (False, 0.0),  # (B, W) column k: the uniform that picks the row's k-th token
    "out_tok": (False, 0),  # (B, W) tokens sampled so far (column gen is scratch)
    "out_lp": (False, 0.0),  # (B, W) their logprobs
    "stop_ids": (False, -1),  # (B, S) the row's stop token ids, -1 = none
}
# The 1-D ones, all (B,): pos (position of the next fed token), last (token to feed next), gen (tokens
# sampled), maxtok, active (not finished), temp (1 for greedy rows), greedy.


class Rows:
    """Rows sharing one cache. Every tensor has the row (batch) dim first; ``state`` is per cache layer."""

    def __init__(self, kinds: list[Kind], state: list[State], t: dict[str, torch.Tensor],
                 jobs: list[Job], samples: list[int]) -> None:
        self.kinds = kinds  # per layer, how its state is selected / concatenated (the group's)
        self.state = state  # per layer, the rows' tensors in that cache layer (see Kind)
        self.t = t
        self.jobs = jobs  # (B,) the job of each row
        self.samples = samples  # (B,) the row's sample index in its job

    def select(self, idx: torch.Tensor) -> Rows:
        """The rows ``idx`` (B',), with the leading cache columns that are padding in all of them dropped."""
        t = {name: x.index_select(0, idx) for name, x in self.t.items()}
        first = int(t["mask"].any(0).int().argmax())  # every row holds its prompt, so some column is real
        t["mask"] = t["mask"][:, first:]
        width = t["mask"].shape[1]
        state = [kind.select(s, idx, width) for kind, s in zip(self.kinds, self.state, strict=True)]
        keep = idx.tolist()
        return Rows(self.kinds, state, t, [self.jobs[i] for i in keep], [self.samples[i] for i in keep])

    @staticmethod
    def cat(parts: list[Rows]) -> Rows:
        if len(parts) == 1:
            return parts[0]
        t = {}
        for name in parts[0].t:
            left, fill = PAD2D.get(name, (False, 0))
            xs = [p.t[name] for p in parts]
            t[name] = pad_cat(xs, 1, left, fill) if name in PAD2D else torch.cat(xs)
        kinds = parts[0].kinds
        state = [kind.cat([p.state[i] for p in parts]) for i, kind in enumerate(kinds)]
        return Rows(kinds, state, t, [j for p in parts for j in p.jobs], [s for p in parts for s in p.samples])


def cache_kwarg(model: Any) -> str:
    """transformers 5 names the KV cache argument ``cache``; older releases ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Group:
    """The running rows of one model_key: one cache, one forward per step."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache_kwarg = cache_kwarg(model)
        self.device = next(model.parameters()).device
        # Prompt logprobs from hidden states and the output embedding (else from every position's logits).
        self.fused_head = getattr(model, "fused_head", True) and fused_head_support(model) is None
        self.dense: DenseDecode | None = dense_decode(model)  # its decode step without the model's wrapping
        # Its steps run under torch.inference_mode (no autograd or version-counter bookkeeping per operator: ~10% of a
        # small model's decode step) where nothing a step makes can reach training: the dense classes with a fixed
        # rotary table (a "dynamic" one re-registers its buffer in the forward). Every tensor of the group's rows is
        # then an inference tensor, made and updated only inside its steps.
        self.inference_mode = self.dense is not None and getattr(model.model.rotary_emb, "rope_type", None) == "default"
        self.cache: Any = None  # the cache the model made at the first prefill; its layers are re-pointed at rows
        self.kinds: list[Kind] = []  # per cache layer (set with ``cache``)
        self.rows: Rows | None = None
        self.finished = 0  # rows finished but not yet dropped (compaction is amortised)
        # (the adapter ids of the running rows, their Routing): reused by decode steps while the rows stay the same
        self.route: tuple[tuple[int, ...], Any] | None = None
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
        self.topk_rows: tuple[torch.Tensor, int] | None = None  # see below
        if self.rows is None:
            return
        by_filter: dict[tuple[int, float], list[int]] = {}
        greedy = []
        for r, job in enumerate(self.rows.jobs):
            p = job.job.params
            greedy.append(p.temperature == 0)
            if p.temperature != 0 and (p.top_k > 0 or p.top_p < 1.0):
                by_filter.setdefault((p.top_k, p.top_p), []).append(r)
            if not vectorised_stop(job.job.stop):
                self.py_stop.append(r)
        self.filters = [(k, p, torch.tensor(rows, device=self.device)) for (k, p), rows in by_filter.items()]
        # Rows whose job asks for topk_sample_logprobs, and the largest k among them.
        topk = [(r, job.job.options.topk_sample) for r, job in enumerate(self.rows.jobs)
                if job.job.options is not None and job.job.options.topk_sample]
        if topk:
            self.topk_rows = (torch.tensor([r for r, _ in topk], device=self.device), max(k for _, k in topk))
        self.all_greedy, self.any_greedy = all(greedy), any(greedy)
        self.plain = not by_filter and all(j.job.params.temperature == 1.0 for j in self.rows.jobs)


def vectorised_stop(stop: StopRule) -> bool:
    """A plain StopRule with ids only: checked on tensors (its ``done`` is ``tokens[-1] in ids``)."""
    return type(stop) is StopRule and not stop.strings

"""Routing rows of one forward pass to their adapters, over a base model shared by every LoRA session.

The base model gets a forward hook on each module an adapter may target (:func:`install`). A hook does
nothing unless the *current thread* has a routing set (:func:`routed`): then the rows of each group get
their own adapter's ``scaling * (x A^T) B^T`` added, computed on those rows only. Rows never mix, so a
row's outputs, and its adapter's gradients, do not depend on the other rows in the pass; other threads
(full sessions, sampling from the base) and copies of the model (the hooks check the module) see the
plain base.

Groups are contiguous row ranges in training passes (slices are views: no gather) and row index tensors
in the sampling engine, whose rows of many snapshots interleave (one snapshot holding every row adds its delta to
the whole output: the same bits as gathering and scattering them). A module that sees the batch flattened to
(B * T) tokens (a MoE block's experts and shared experts) is routed by token (:meth:`Routing.token_groups`).
A hooked Linear may carry several adapters on parts of its output rows (a fused q/k/v projection: Tinker adapts
its parts separately; worker/lora/adapter.py); fused experts add their deltas in worker/lora/experts.py.

Batch invariance (worker/lora/batch.py): while contiguous groups of several requests share a forward, every
``torch.nn.functional.linear`` over the batch's rows (B, ...) or tokens (B * T, ...) runs once per group, on that
group's rows (:class:`_PerGroupProducts`), the experts dispatch per group, and the loss head runs per group
(:meth:`Routing.head_groups`). A BLAS chooses its kernel, and on several threads how it splits a sum, by the shape of
a product (measured with MKL on 2 threads: a 128-row product's rows differ in the last bits from the same rows
inside a 2,048-row one, and on 2026-12-03's CPU a 128-row tile's inside a ``torch.bmm`` of 7 tiles from the same tile
alone), so a request's products must have the shapes they have alone. ``PRODUCTS = "tiles"`` cuts each group's rows
into fixed-shape tiles instead (:func:`tiled_linear`, one product per tile, and the loss head in tiles,
worker/lora/head.py), bitwise too, and measured slower.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tinkerq.worker.lora import experts
from tinkerq.worker.lora.adapter import Part, adaptable
from tinkerq.worker.training import checkpointing

_local = threading.local()

# How a routed pass's products over the rows of several contiguous groups run: "groups" (one product per group,
# each of the shape it has alone; a request alone runs whole), "tiles" (fixed-shape row tiles, one product each,
# :func:`tiled_linear`, and the loss head in tiles, worker/lora/head.py; a request alone takes the same path) or
# "stacked" (one product over every row: not bitwise). "groups" and "tiles" are both bitwise each group alone;
# "groups" is the default because it measured faster, at 1 and 2 threads (docs/benchmarks.md §22). Only
# benchmarks/lora.py and the tests change it.
PRODUCTS = "groups"
# Rows of one tile of a frozen weight's product (a group's rows: whole tiles, then one shorter tile). Every group of
# one 128-token row is one tile; bucketed lengths are multiples of 16, so the last tiles of a step's groups (one
# length) share a size.
TILE_ROWS = 128


class AdapterWeights(Protocol):
    scaling: float

    def pair(self, target: str) -> tuple[torch.Tensor, torch.Tensor] | None: ...


Rows = slice | torch.Tensor  # a contiguous range, or row indices (B',)


class Routing:
    def __init__(self, groups: list[tuple[AdapterWeights | None, Rows]], head: str | None = None,
                 batch: int | None = None, length: int | None = None,
                 passing: Sequence[AdapterWeights] | None = None) -> None:
        self.groups = groups
        # Every adapter of the pass, in an order every rank of a shard group shares (a pass's requests): on an
        # expert-parallel group a token's rows reach other ranks' experts carrying the index of their adapter here
        # (:meth:`token_ids`, worker/sharding/experts.py). None: this forward's own groups' adapters.
        self.passing = list(passing) if passing is not None else [a for a, _ in groups if a is not None]
        self.head = head  # the output projection's name: the fused loss head asks for its pairs
        self.batch = batch  # rows in the forward (row-index groups need it; contiguous groups cover the batch)
        self.length = length  # tokens per row, when known: products over (B * T) flattened tokens run per group
        self.suspended = 0  # inside :meth:`whole`
        self._token_groups: tuple[int, tuple[list[AdapterWeights | None], torch.Tensor]] | None = None
        self.contiguous = all(isinstance(rows, slice) for _, rows in groups)
        # Row-index groups where one adapter holds every row, in order (a sampling batch of one snapshot): its delta
        # then adds to the whole output, the bits the gather and scatter give, without them.
        self.one_adapter = (not self.contiguous and len(groups) == 1 and batch is not None
                            and _is_every_row(groups[0][1], batch))
        # id(parts) -> each group's delta on those parts, or None where no group's adapter touches them
        self._deltas: dict[int, list[_Delta | None] | None] = {}
        if self.contiguous:  # then the groups must cover the batch, in order
            starts = [rows.start or 0 for _, rows in groups]  # type: ignore[union-attr]
            stops = [rows.stop for _, rows in groups]  # type: ignore[union-attr]
            if groups and starts != [0, *stops[:-1]]:
                raise ValueError("contiguous routing groups must cover the batch in order")
            self.sizes = [b - a for a, b in zip(starts, stops, strict=True)]

    def head_groups(self) -> list[tuple[float, tuple[torch.Tensor, torch.Tensor] | None]] | None:
        """For the fused loss head (worker/training/logprobs.py): each contiguous group's scaling and output projection
        pair (rows: :meth:`split`); None when one group holds the batch and does not adapt the output projection
        (the head then runs once over the batch). Several groups always get one head each: its chunks' products
        then have the shapes they have alone."""
        if self.head is None or not self.contiguous:
            return None
        out = [(adapter.scaling if adapter else 0.0, adapter.pair(self.head) if adapter else None)
               for adapter, _ in self.groups]
        if len(out) > 1 and PRODUCTS != "stacked":
            return out
        return out if any(pair is not None for _, pair in out) else None

    def tiled_head(self) -> bool:
        """Whether the loss head runs over every group's tokens in tiles (worker/lora/head.py): contiguous groups,
        one group too (alone as among others), products in tiles."""
        return self.head is not None and self.contiguous and bool(self.groups) and PRODUCTS == "tiles"

    def per_group(self) -> bool:
        """Whether products over the batch run per group or in tiles: contiguous groups (in tiles, one group too:
        a request alone then computes its products as it does among others)."""
        if not self.contiguous or PRODUCTS == "stacked":
            return False
        return PRODUCTS == "tiles" or len(self.groups) > 1

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """Products in this block run as called (a group's own work on its own tensors: the experts' dispatch,
        whose slot tensors could have as many rows as the batch by chance)."""
        self.suspended += 1
        try:
            yield
        finally:
            self.suspended -= 1

    def row_sizes(self, t: torch.Tensor) -> list[int] | None:
        """The groups' shares of ``t``'s first dimension when it runs over the batch's rows (B, ...) or, the row
        length known, its flattened tokens (B * T, ...); None otherwise (a group's own tensor, expert slots)."""
        if t.dim() == 0 or self.suspended:
            return None
        rows = sum(self.sizes)
        if t.shape[0] == rows and t.dim() >= 2:
            return self.sizes
        if self.length is not None and t.dim() == 2 and t.shape[0] == rows * self.length:
            return [n * self.length for n in self.sizes]
        return None

    def apply(self, parts: list[tuple[str, tuple[int, int] | None]], x: torch.Tensor,
              out: torch.Tensor) -> torch.Tensor | None:
        """``out`` (B, ..., out) of a Linear on input ``x`` (B, ..., in), with each group's delta on the Linear's
        ``parts`` ((adapter name, output rows or None for all)).

        Some modules see the batch flattened to tokens (N = B * T, in) (a MoE block's shared expert): their rows are
        then tokens, row-major over (B, T)."""
        key = id(parts)
        if key not in self._deltas:  # once per Linear and routing (a pass, or the decode steps of the same rows)
            made = [_Delta(parts, adapter, out.shape[-1]) if adapter is not None else None
                    for adapter, _ in self.groups]
            self._deltas[key] = made if any(d is not None and d.active for d in made) else None
        deltas = self._deltas[key]
        if deltas is None:
            return None
        if self.one_adapter:  # sampling, every row (or token) one adapter's: no gradients needed
            delta = deltas[0]
            assert delta is not None
            # contiguous as the gather's copy would be: a product's last bits can depend on its input's strides
            # (the head's input after the prefill is the last position of each row, a strided view)
            return out + delta(x.contiguous())
        if not self.contiguous:  # sampling: no gradients needed
            result = out.clone()
            index = [rows for _, rows in self.groups]
            if self.batch is not None and x.shape[0] != self.batch:  # flattened tokens
                _, token_group = self.token_groups(x.shape[0], x.device)
                index = [(token_group == g).nonzero().squeeze(1) for g in range(len(self.groups))]
            for rows, delta in zip(index, deltas, strict=True):
                if delta is not None and delta.active:
                    assert isinstance(rows, torch.Tensor)  # sampling routes by row index
                    result.index_add_(0, rows, delta(x.index_select(0, rows)))
            return result
        sizes = self.sizes
        if x.shape[0] != sum(sizes):  # flattened tokens: each row's T tokens are contiguous
            per_row = x.shape[0] // sum(sizes)
            sizes = [n * per_row for n in sizes]
        # Contiguous groups covering the batch in order: split into views. torch.split's backward concatenates
        # the pieces' gradients once; indexing each slice would fill a whole-batch zero gradient per group.
        pieces = [oi if delta is None or not delta.active else delta.added_to(oi, xi)
                  for delta, xi, oi in zip(deltas, torch.split(x, sizes), torch.split(out, sizes), strict=True)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def token_groups(self, n_tokens: int, device: torch.device) -> tuple[list[AdapterWeights | None], torch.Tensor]:
        """For modules that see the batch flattened to (N, H) tokens, row-major over (B, T) (MoE experts): the
        groups' adapters (a last None group for rows no group holds) and each token's group (N,)."""
        if self._token_groups is not None and self._token_groups[0] == n_tokens:
            return self._token_groups[1]
        adapters: list[AdapterWeights | None] = [adapter for adapter, _ in self.groups]
        if self.contiguous:
            rows = sum(self.sizes)
            row_group = torch.repeat_interleave(torch.arange(len(self.sizes)), torch.tensor(self.sizes))
        else:
            if self.batch is None:
                raise ValueError("row-index routing groups need the batch size (routed(..., batch=B))")
            rows = self.batch
            row_group = torch.full((rows,), len(adapters), dtype=torch.long)
            for g, (_, index) in enumerate(self.groups):
                row_group[index.cpu()] = g  # type: ignore[union-attr]
            adapters.append(None)
        if rows == 0 or n_tokens % rows:
            raise ValueError(f"{n_tokens} tokens do not split into {rows} rows")
        token_group = row_group.repeat_interleave(n_tokens // rows).to(device)
        self._token_groups = (n_tokens, (adapters, token_group))
        return adapters, token_group

    def token_ids(self, n_tokens: int, device: torch.device) -> torch.Tensor:
        """Each of the (N,) flattened tokens' adapter as its index in :attr:`passing`, -1 for none (N,) long. A
        forward of no group (a shard group's idle step) has no adapter on any token."""
        if not self.groups:
            return torch.full((n_tokens,), -1, dtype=torch.long, device=device)
        adapters, token_group = self.token_groups(n_tokens, device)
        index = {id(a): i for i, a in enumerate(self.passing)}
        lookup = torch.tensor([index[id(a)] if a is not None else -1 for a in adapters], dtype=torch.long)
        return lookup.to(device)[token_group]

    def token_sizes(self, n_tokens: int) -> list[int] | None:
        """Each group's count of the (N,) flattened tokens when groups are contiguous (they then are in order);
        None for row-index groups."""
        if not self.contiguous:
            return None
        return [n * (n_tokens // sum(self.sizes)) for n in self.sizes]

    def split(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``t`` (B, ...) cut into the groups' rows (contiguous routings only)."""
        return torch.split(t, self.sizes)


def _is_every_row(rows: Rows, batch: int) -> bool:
    """Whether ``rows`` are 0 .. batch - 1 in order."""
    if not isinstance(rows, torch.Tensor) or rows.numel() != batch:
        return False
    return bool(torch.equal(rows.cpu(), torch.arange(batch)))


def _delta(x: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor], scaling: float) -> torch.Tensor:
    """``scaling * (x A^T) B^T`` in ``x``'s dtype (the masters stay float32); scaled at rank width, where the
    multiply is r / out of the cost of scaling the output."""
    a, b = pair
    if a.dtype != x.dtype:  # (a no-op ``to`` still costs a dispatch per Linear per decode step)
        a, b = a.to(x.dtype), b.to(x.dtype)
    return F.linear(F.linear(x, a) * scaling, b)


class _Delta:
    """One adapter's change to one Linear's output: whole, or per part of its rows (zeros elsewhere)."""

    def __init__(self, parts: list[tuple[str, tuple[int, int] | None]], adapter: AdapterWeights, width: int) -> None:
        self.pairs = [(rows, adapter.pair(name)) for name, rows in parts]
        self.scaling = adapter.scaling
        self.width = width
        self.active = any(pair is not None for _, pair in self.pairs)

    def added_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out + self(x)``; for a whole-Linear adapter one ``addmm`` (no (.., out) intermediate to add)."""
        if len(self.pairs) != 1 or self.pairs[0][0] is not None:
            return out + self(x)
        a, b = self.pairs[0][1]  # type: ignore[misc]
        xa = F.linear(x, a.to(x.dtype)) * self.scaling  # (.., r)
        flat = torch.addmm(out.reshape(-1, out.shape[-1]), xa.reshape(-1, xa.shape[-1]), b.to(x.dtype).t())
        return flat.view(out.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.pairs) == 1 and self.pairs[0][0] is None:
            return _delta(x, self.pairs[0][1], self.scaling)  # type: ignore[arg-type]
        pieces, at = [], 0
        for rows, pair in self.pairs:
            if pair is None:
                continue
            start, stop = rows if rows is not None else (0, self.width)
            if start > at:
                pieces.append(x.new_zeros(*x.shape[:-1], start - at))
            pieces.append(_delta(x, pair, self.scaling))
            at = stop
        if at < self.width:
            pieces.append(x.new_zeros(*x.shape[:-1], self.width - at))
        return torch.cat(pieces, -1)


def current() -> Routing | None:
    return getattr(_local, "routing", None)


@contextlib.contextmanager
def routed(groups: list[tuple[AdapterWeights | None, Rows]], head: str | None = None,
           batch: int | None = None, length: int | None = None,
           passing: Sequence[AdapterWeights] | None = None) -> Iterator[Routing]:
    """Route this thread's forwards through ``groups`` (adapter, rows) until the block ends; ``batch``: the rows
    in the forward, needed when groups are row indices; ``length``: tokens per row (B, T), so that products over
    the flattened tokens of several contiguous groups run per group too; ``passing``: every adapter of the pass
    (:attr:`Routing.passing`)."""
    previous = current()
    _local.routing = routing = Routing(groups, head, batch, length, passing)
    try:
        with _PerGroupProducts(routing) if routing.per_group() else contextlib.nullcontext():
            yield routing
    finally:
        _local.routing = previous


@contextlib.contextmanager
def restored(route: Routing | None) -> Iterator[None]:
    """``route`` this thread's routing again for the block (a checkpointed layer's recomputation in the backward,
    worker/training/checkpointing.py, runs after :func:`routed` has ended; a sampling group's decode steps keep one
    Routing while their rows stay the same, worker/sampling/forwards.py); nothing when it still is, or is None."""
    if route is None or current() is route:
        yield
        return
    previous = current()
    _local.routing = route
    try:
        with _PerGroupProducts(route) if route.per_group() else contextlib.nullcontext():
            yield
    finally:
        _local.routing = previous


checkpointing.carry(lambda: restored(current()))


# Elementwise functions whose CPU kernels give an element's last bits by its place in the tensor. ATen's CPU loops
# run 2 * Vec::size() elements at a time with the SIMD function (32 float32 on AVX-512, 16 on AVX2) and the rest of
# the tensor, and of each thread's share, with the scalar one; for these two differ in the last bits (measured with
# torch 2.13 on AVX-512: 16 elements alone, scalar, against the same 16 inside 48, vectorized; not for exp, tanh,
# erf, log, exact gelu or plain arithmetic, whose two paths agree). A request's (N, 1) shared-expert gate (Qwen3.5-MoE,
# T tokens a row: T elements) is then computed otherwise in a stack of requests than alone; on CUDA an element is
# computed by one function wherever it sits, so only CPU tensors are split.
_ELEMENTWISE = frozenset({torch.sigmoid, torch.Tensor.sigmoid, torch.special.expit, F.silu, F.softplus, F.gelu,
                          F.elu, F.selu, F.celu, F.mish, torch.exp2, torch.Tensor.exp2})


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with ``x`` (S, ..., in) in groups of ``sizes`` rows along its first dimension,
    computed in tiles: each group's (rows x ..., in) tokens cut into tiles of ``TILE_ROWS`` and one shorter last
    tile, each tile its own product. A tile's product has the same shape wherever the tile sits and whoever shares
    the pass, so its tokens get the same bits (batch invariance, above); the backward's product for ``x`` runs on
    the same tiles. ``weight`` must take no gradient (its gradient would be summed over the tiles)."""
    k = x.shape[-1]
    flat = x.reshape(-1, k)  # (M, in): every group's tokens, in order
    per_row = flat.shape[0] // sum(sizes)
    pieces: list[torch.Tensor] = []
    at = 0
    for n in sizes:
        end = at + n * per_row
        pieces += [F.linear(flat[lo:min(lo + TILE_ROWS, end)], weight) for lo in range(at, end, TILE_ROWS)]
        at = end
    out = torch.cat(pieces).view(*x.shape[:-1], weight.shape[0])
    return out + bias if bias is not None else out


class _PerGroupProducts(TorchFunctionMode):
    """``F.linear`` over the batch's rows or tokens: a frozen weight's in tiles (:func:`tiled_linear`, when
    ``PRODUCTS`` is "tiles"), others one call per contiguous group, concatenated: each group's product has the
    shape it has alone (its gradient too: the backward runs per piece). So do the elementwise functions of
    ``_ELEMENTWISE`` on CPU tensors (not in place), whose elements' last bits depend on where in the tensor they
    sit: a group's piece is computed as the whole tensor is alone."""

    def __init__(self, routing: Routing) -> None:
        super().__init__()
        self.routing = routing

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _ELEMENTWISE and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu" \
                and not kwargs.get("inplace") and not any(a is True for a in args[1:]):
            sizes = self.routing.row_sizes(args[0])
            if sizes is not None and len(sizes) > 1:
                return torch.cat([func(x, *args[1:], **kwargs) for x in torch.split(args[0], sizes)])
        if func is F.linear and args and isinstance(args[0], torch.Tensor):
            sizes = self.routing.row_sizes(args[0])
            if sizes is not None:
                weight = args[1] if len(args) > 1 else kwargs["weight"]
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                if PRODUCTS == "tiles" and not weight.requires_grad:
                    return tiled_linear(args[0], weight, bias, sizes)
                if len(sizes) > 1:
                    return torch.cat([func(x, *args[1:], **kwargs) for x in torch.split(args[0], sizes)])
        return func(*args, **kwargs)


def install(model: torch.nn.Module) -> str:
    """Hook every module an adapter may target (once); returns the output projection's name.

    Linear modules get a forward hook (carrying the module's parts); fused-experts modules are registered with
    worker/lora/experts.py, whose forward adds the deltas inside the experts' own dispatch."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    head_name = next(name for name, module in model.named_modules() if module is head)
    if getattr(model, "_tinkerq_lora_hooks", False):
        return head_name
    linears: dict[str, list[Part]] = {}
    for part in adaptable(model):
        if isinstance(part.module, torch.nn.Linear):
            linears.setdefault(part.module_name, []).append(part)
        elif part.module_name not in linears and part.name != part.module_name:  # (not: a layout never adapted)
            linears[part.module_name] = []
            experts.register(part.module, part.module_name)
    modules = dict(model.named_modules())
    for name, parts in linears.items():
        if parts:
            modules[name].register_forward_hook(_hook(parts, modules[name]))
    model._tinkerq_lora_hooks = True  # type: ignore[assignment]
    return head_name


def _hook(parts: list[Part], original: torch.nn.Module) -> Any:
    spec = [(p.name, p.rows) for p in parts]

    def hook(module: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
        routing = current()
        if routing is None or module is not original:  # a deep copy of the base keeps the hook: inert
            return None
        return routing.apply(spec, args[0], out)

    return hook

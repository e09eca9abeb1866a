"""LoRA on fused MoE experts: Tinker's "shared-outer" adapters, riding the experts' own grouped dispatch.

transformers 5 keeps a MoE layer's routed experts as 3-D parameters in one module (``gate_up_proj`` (E, 2I, H) or,
transposed, (E, H, 2I); ``down_proj`` (E, H, I); gpt-oss adds biases and interleaves gate/up; Nemotron-H has an
ungated ``up_proj``), marked by ``use_experts_implementation`` (attributes ``has_gate``, ``has_bias``,
``is_transposed``, ``is_concatenated``). :func:`layout` reads that structure; nothing here names a model family.
An unmarked module (Llama-4's ``gate_up_proj`` (E, H, 2I), ``down_proj`` (E, I, H), whose forward takes the
(E * N, H) hidden states alone: every expert on every token, pre-scaled by its router score) is read from its shapes
and signature and checked against its own forward on a probe; its deltas ride that dense dispatch
(:func:`lora_dense_experts_forward`). Stacked shared experts (Inkling's: ``gate_proj``, ``up_proj`` (E, I, H) and
``down_proj`` (E, H, I), a forward taking the hidden states and per-token coefficients ``gammas`` (N, E) that scale
each expert's activation, the experts' outputs summed) are read and probed the same way
(:func:`lora_gammas_experts_forward`); Tinker's per-rank counts for Inkling count them shared-outer like routed
experts (H + E x I per projection: tests/test_planner.py).

Tinker's layout (../shared/reference/model-families.md): one adapter per projection, ``w1`` (gate), ``w3`` (up),
``w2`` (down). The factor that touches the hidden size is shared by all experts, the inner one is per expert:

    w1, w3: A (1, r, H)   B (E, I, r)          delta_e(x) = s * (x A^T) B_e^T
    w2:     A (E, r, I)   B (1, H, r)          delta_e(h) = s * (h A_e^T) B^T

with s = 32 / r. An ungated expert's single input projection is ``w1``.

The forward (:func:`lora_experts_forward`) sorts the (token, expert) slots by expert and, within an expert, by
adapter group, so the base weights run as one grouped matmul per projection (each expert's slots contiguous) and
each adapter's per-expert factor as one more over (expert, group) segments; the shared factors are one dense
matmul per group (x A^T before the dispatch; for w2, B after the routing weights are applied, since
sum_k w_k (h_k A_k^T) B^T = (sum_k w_k h_k A_k^T) B^T). No capacity limit, no auxiliary loss: a token's output
depends on its own routing only, so tenants sharing a pass never change each other's numbers.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tinkerq.errors import ValidationError

# Tinker's archive names for an expert module's projections.
GATE, UP, DOWN = "w1", "w3", "w2"

_lock = threading.Lock()
_registered: dict[int, tuple[torch.nn.Module, str]] = {}  # id(experts module) -> (module, its name)


@dataclass(frozen=True)
class ExpertsLayout:
    """The structure of one fused-experts module (shapes are the math view: W_e is (out, in))."""

    num_experts: int
    hidden: int  # H
    intermediate: int  # I
    gated: bool  # gate_up_proj (gate and up) or up_proj alone
    concatenated: bool  # [gate | up] rather than interleaved [g0, u0, g1, u1, ...]
    transposed: bool  # weights stored (E, in, out)
    has_bias: bool
    dense: bool = False  # forward(hidden (E * N, H)): every expert on every token, pre-scaled (Llama-4)
    # forward(hidden (..., H), gammas (..., E)): every expert on every token, its activation scaled by its gamma, the
    # outputs summed; gate_proj and up_proj separate (E, I, H), down_proj (E, H, I) (Inkling's shared experts)
    gammas: bool = False

    def projections(self) -> dict[str, tuple[int, int]]:
        """Tinker name -> (in_features, out_features) of each projection an adapter may target."""
        inner = {GATE: (self.hidden, self.intermediate), UP: (self.hidden, self.intermediate)} if self.gated else \
            {GATE: (self.hidden, self.intermediate)}
        return {**inner, DOWN: (self.intermediate, self.hidden)}


def is_fused_experts(module: torch.nn.Module) -> bool:
    """A module holding experts as 3-D parameters (whatever its family; a convolution's 3-D kernel is not)."""
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        return False
    # A base kept quantized (worker/loading/quantized_base.py) has them as properties of the module's class instead.
    return any(p.dim() == 3 for p in module.parameters(recurse=False)) or getattr(module, "_tinkerq_experts", False)


def layout(module: torch.nn.Module, name: str) -> ExpertsLayout:
    """``module``'s layout, or a user error saying what was found when tinkerq cannot adapt it.

    transformers' marked layouts (``use_experts_implementation``) are read from their markers. An unmarked module
    (Llama-4's) is recognised from its structure: a 3-D ``gate_up_proj`` and ``down_proj`` whose shapes say which
    way they are stored, and a forward taking the hidden states alone, laid out (E * N, H): every expert runs every
    token, already scaled by its router score (zero where not routed). That reading is then checked once by running
    the module's own forward on a small probe (:func:`_probe_dense`)."""
    cached = getattr(module, "_tinkerq_layout", None)
    if isinstance(cached, ExpertsLayout):
        return cached
    found = ", ".join(f"{n} {tuple(p.shape)}" for n, p in module.named_parameters(recurse=False))
    refusal = ValidationError(
        f"{name} ({type(module).__name__}) holds fused expert parameters tinkerq cannot adapt ({found}): set "
        f"train_mlp=False to adapt attention and the output projection only (these routed experts then stay "
        f"frozen), or serve a model whose experts use transformers' standard expert layouts")
    marked = all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "is_concatenated"))
    if not marked:
        lay = _dense_layout(module) or _gammas_layout(module)
        if lay is None:
            raise refusal
        module._tinkerq_layout = lay  # type: ignore[assignment]  # a plain attribute: probed once
        return lay
    up = getattr(module, "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj", None)
    down = getattr(module, "down_proj", None)
    if not isinstance(up, torch.Tensor) or not isinstance(down, torch.Tensor) or up.dim() != 3 \
            or getattr(module, "has_post_expert_norm", False):
        raise refusal
    transposed = bool(module.is_transposed)
    num_experts, up_in, up_out = up.shape[0], *(up.shape[1:] if transposed else up.shape[:0:-1])
    inter = up_out // 2 if module.has_gate else up_out
    return ExpertsLayout(num_experts, up_in, inter, bool(module.has_gate), bool(module.is_concatenated), transposed,
                         bool(module.has_bias))


def _dense_layout(module: torch.nn.Module) -> ExpertsLayout | None:
    """An unmarked experts module's layout, read from its structure and checked on a probe; None if it is not one
    tinkerq knows: a gated, [gate | up] concatenated, bias-free pair of 3-D projections whose forward takes the
    (E * N, H) hidden states alone (the dense dispatch)."""
    up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(up, torch.Tensor) or not isinstance(down, torch.Tensor) or up.dim() != 3 or down.dim() != 3 \
            or up.shape[0] != down.shape[0] or not callable(getattr(module, "act_fn", None)):
        return None
    forward = getattr(type(module), "_tinkerq_original_forward", type(module).forward)
    if len(inspect.signature(forward).parameters) != 2:  # (self, hidden_states)
        return None
    num_experts = up.shape[0]
    if up.shape[1] == down.shape[2] and up.shape[2] == 2 * down.shape[1]:  # (E, H, 2I), (E, I, H): (E, in, out)
        lay = ExpertsLayout(num_experts, up.shape[1], down.shape[1], True, True, True, False, dense=True)
    elif up.shape[2] == down.shape[1] and up.shape[1] == 2 * down.shape[2]:  # (E, 2I, H), (E, H, I): (E, out, in)
        lay = ExpertsLayout(num_experts, up.shape[2], down.shape[2], True, True, False, False, dense=True)
    else:
        return None
    return lay if _probe_dense(module, forward, lay) else None


def _probe_dense(module: torch.nn.Module, forward: Any, lay: ExpertsLayout) -> bool:
    """Whether the module's own forward equals :func:`_dense_experts` (no adapter) on 2 random tokens per expert.
    A model on the meta device (parameter counts) has no values to probe, nor does an FSDP-sharded one a plain
    forward (its parameters are DTensor shards outside its forward): their structure is taken as is."""
    from torch.distributed.tensor import DTensor

    weight = module.gate_up_proj
    assert isinstance(weight, torch.Tensor)  # checked by _dense_layout
    if weight.device.type == "meta" or isinstance(weight, DTensor):
        return True
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(lay.num_experts * 2, lay.hidden, generator=generator).to(weight.device, weight.dtype)
    with torch.no_grad():
        try:
            theirs = forward(module, x)
        except (RuntimeError, ValueError, TypeError):
            return False
        ours = _dense_experts(module, lay, x.view(lay.num_experts, 2, lay.hidden), None, None, 0.0)
    tolerance = 1e-4 if weight.dtype == torch.float32 else 2e-2
    return theirs.shape == (x.shape[0], lay.hidden) and \
        bool(torch.allclose(theirs.float(), ours.reshape(theirs.shape).float(), rtol=tolerance,
                            atol=tolerance * max(1.0, float(theirs.abs().max()))))


def _dense_experts(module: Any, lay: ExpertsLayout, x: torch.Tensor, inputs: tuple[torch.Tensor, torch.Tensor] | None,
                   down: tuple[torch.Tensor, torch.Tensor] | None, scaling: float) -> torch.Tensor:
    """The dense dispatch: ``x`` (E, n, H), every expert on its own n rows (inputs already scaled by the routing),
    returns (E, n, H). ``inputs``: one adapter's w1/w3 factors over the whole input projection (A (R, H),
    B (E, 2I, R): :func:`_input_factors`); ``down``: its w2 pair (A (E, r, I), B (1, H, r))."""
    dtype = x.dtype
    up_weight = module.gate_up_proj if lay.transposed else module.gate_up_proj.transpose(1, 2)  # (E, H, 2I)
    h = torch.bmm(x, up_weight)  # (E, n, 2I)
    if inputs is not None:
        a, b = inputs
        h = h + torch.bmm(F.linear(x, a) * scaling, b.transpose(1, 2))  # (E, n, R) @ (E, R, 2I)
    gate, up = h.chunk(2, dim=-1)
    h = module.act_fn(gate) * up  # (E, n, I)
    down_weight = module.down_proj if lay.transposed else module.down_proj.transpose(1, 2)  # (E, I, H)
    out = torch.bmm(h, down_weight)  # (E, n, H)
    if down is not None:
        a_down, b_down = down
        out = out + F.linear(torch.bmm(h, a_down.to(dtype).transpose(1, 2)) * scaling, b_down[0].to(dtype))
    return out


def _gammas_layout(module: torch.nn.Module) -> ExpertsLayout | None:
    """Stacked shared experts (Inkling's), read from their structure and checked on a probe; None if ``module`` is
    not one: 3-D ``gate_proj`` and ``up_proj`` (E, I, H) and ``down_proj`` (E, H, I), an ``act_fn``, and a forward
    taking (hidden_states, gammas)."""
    gate, up, down = (getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (gate, up, down)) \
            or not callable(getattr(module, "act_fn", None)):
        return None
    assert isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor) and isinstance(down, torch.Tensor)
    num_experts, inter, hidden = gate.shape
    if up.shape != gate.shape or down.shape != (num_experts, hidden, inter):
        return None
    forward = getattr(type(module), "_tinkerq_original_forward", type(module).forward)
    if list(inspect.signature(forward).parameters)[1:] != ["hidden_states", "gammas"]:
        return None
    lay = ExpertsLayout(num_experts, hidden, inter, True, True, False, False, dense=True, gammas=True)
    return lay if _probe_gammas(module, forward, lay) else None


def _probe_gammas(module: torch.nn.Module, forward: Any, lay: ExpertsLayout) -> bool:
    """Whether the module's own forward equals :func:`_gammas_experts` (no adapter) on 3 random tokens (taken as is
    on the meta device or FSDP shards, as :func:`_probe_dense`)."""
    from torch.distributed.tensor import DTensor

    weight = module.gate_proj
    assert isinstance(weight, torch.Tensor)  # checked by _gammas_layout
    if weight.device.type == "meta" or isinstance(weight, DTensor):
        return True
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, lay.hidden, generator=generator).to(weight.device, weight.dtype)
    gammas = torch.rand(3, lay.num_experts, generator=generator).to(weight.device, weight.dtype)
    with torch.no_grad():
        try:
            theirs = forward(module, x, gammas)
        except (RuntimeError, ValueError, TypeError):
            return False
        ours = _gammas_experts(module, lay, x, gammas, None, None, 0.0)
    tolerance = 1e-4 if weight.dtype == torch.float32 else 2e-2
    return theirs.shape == x.shape and bool(torch.allclose(
        theirs.float(), ours.float(), rtol=tolerance, atol=tolerance * max(1.0, float(theirs.abs().max()))))


def _gammas_experts(module: Any, lay: ExpertsLayout, x: torch.Tensor, gammas: torch.Tensor,
                    inputs: tuple[torch.Tensor, torch.Tensor] | None, down: tuple[torch.Tensor, torch.Tensor] | None,
                    scaling: float) -> torch.Tensor:
    """Stacked shared experts on ``x`` (n, H) with ``gammas`` (n, E): sum_e (act(x G_e^T) * (x U_e^T) * gamma_e)
    D_e^T, returns (n, H). ``inputs``, ``down``: one adapter's factors, as :func:`_dense_experts` takes them."""
    dtype = x.dtype
    xe = x.unsqueeze(0).expand(lay.num_experts, -1, -1)  # (E, n, H)
    gate = torch.bmm(xe, module.gate_proj.transpose(1, 2))  # (E, n, I)
    up = torch.bmm(xe, module.up_proj.transpose(1, 2))  # (E, n, I)
    if inputs is not None:  # A (R, H), B (E, 2I, R) over [gate | up]
        a, b = inputs
        delta = torch.bmm((F.linear(x, a) * scaling).unsqueeze(0).expand(lay.num_experts, -1, -1),
                          b.transpose(1, 2))  # (E, n, 2I)
        gate = gate + delta[..., :lay.intermediate]
        up = up + delta[..., lay.intermediate:]
    h = module.act_fn(gate) * up * gammas.t().unsqueeze(-1)  # (E, n, I)
    out = torch.bmm(h, module.down_proj.transpose(1, 2))  # (E, n, H)
    if down is not None:
        a_down, b_down = down
        out = out + F.linear(torch.bmm(h, a_down.to(dtype).transpose(1, 2)) * scaling, b_down[0].to(dtype))
    return out.float().sum(dim=0).to(dtype)


def register(module: torch.nn.Module, name: str) -> None:
    """Route ``module``'s forwards through adapters (once per module; its class's forward is wrapped once).

    Copies of the module (a full session's deep copy of the base) are not registered: they run the original."""
    cls = type(module)
    lay = layout(module, name)  # read (and probed) before the class's forward is wrapped
    with _lock:
        _registered[id(module)] = (module, name)
        if getattr(cls, "_tinkerq_lora", False):
            return
        original = cls.forward

        def forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
            entry = _registered.get(id(self))
            if entry is not None and entry[0] is self:
                out = lora_experts_forward(self, entry[1], hidden_states, top_k_index, top_k_weights)
                if out is not None:
                    return out
            return original(self, hidden_states, top_k_index, top_k_weights)

        def dense_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
            entry = _registered.get(id(self))
            if entry is not None and entry[0] is self:
                out = lora_dense_experts_forward(self, entry[1], hidden_states)
                if out is not None:
                    return out
            return original(self, hidden_states)

        def gammas_forward(self: torch.nn.Module, hidden_states: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
            entry = _registered.get(id(self))
            if entry is not None and entry[0] is self:
                out = lora_gammas_experts_forward(self, entry[1], hidden_states, gammas)
                if out is not None:
                    return out
            return original(self, hidden_states, gammas)

        cls.forward = gammas_forward if lay.gammas else dense_forward if lay.dense else forward  # type: ignore[method-assign]
        cls._tinkerq_lora = True  # type: ignore[attr-defined]
        cls._tinkerq_original_forward = original  # type: ignore[attr-defined]


def registered_name(module: torch.nn.Module) -> str | None:
    """The name ``module`` was registered under (:func:`register`), or None: not a LoRA base's experts."""
    entry = _registered.get(id(module))
    return entry[1] if entry is not None and entry[0] is module else None


def rows_forward(module: Any, name: str, rows: torch.Tensor, expert: torch.Tensor, adapters: list[Any],
                 group: torch.Tensor) -> torch.Tensor | None:
    """Expert outputs (M, H), unweighted, for ``rows`` (M, H): row i through expert ``expert[i]`` of ``module``
    with the deltas of ``adapters[group[i]]`` (None: no adapter); None when no adapter targets ``name``. An
    expert-parallel rank computes the rows other ranks sent to its experts this way (worker/sharding/experts.py):
    ``module`` then sees only its own experts, and each adapter's factors are its slices of them."""
    ones = torch.ones((rows.shape[0], 1), dtype=rows.dtype, device=rows.device)
    return _dispatch(module, name, rows, expert.unsqueeze(1), ones, adapters, group, None)


def lora_dense_experts_forward(module: torch.nn.Module, name: str, hidden_states: torch.Tensor) -> torch.Tensor | None:
    """A dense-dispatch experts module's output (E * N, H) on ``hidden_states`` (E * N, H) (expert-major: each
    expert's N tokens, scaled by its routing weight, zero where not routed), each token with its adapter's deltas;
    None when no adapter targets ``name``. Tokens not routed to an expert have zero input there, so its deltas
    (no bias) add nothing: the merged weights' output exactly."""
    from tinkerq.worker.lora import routing

    route = routing.current()
    if route is None or not route.groups:  # (no group: a shard group's idle step, which adapts nothing)
        return None
    lay = layout(module, name)
    x = hidden_states.view(lay.num_experts, -1, lay.hidden)  # (E, N, H)
    n_tokens = x.shape[1]
    adapters, token_group = route.token_groups(n_tokens, hidden_states.device)
    if all(a is None or all(a.pair(f"{name}.{p}") is None for p in (GATE, UP, DOWN)) for a in adapters):
        return None
    dtype = hidden_states.dtype

    def run(adapter: Any, rows: torch.Tensor) -> torch.Tensor:  # rows (E, n, H) -> (E, n, H)
        if adapter is None:
            return _dense_experts(module, lay, rows, None, None, 0.0)
        inputs = _input_factors(adapter.pair(f"{name}.{GATE}"), adapter.pair(f"{name}.{UP}"), lay, dtype)
        down = adapter.pair(f"{name}.{DOWN}")
        return _dense_experts(module, lay, rows, inputs, down, adapter.scaling)

    sizes = route.token_sizes(n_tokens)
    if sizes is not None:  # contiguous groups: each through its own products (batch invariance)
        with route.whole():
            out = torch.cat([run(a, rows) for a, rows in zip(adapters, torch.split(x, sizes, dim=1), strict=True)], 1)
    else:  # the sampling engine's interleaved rows
        out = x.new_zeros(x.shape)
        for g, adapter in enumerate(adapters):
            index = (token_group == g).nonzero().squeeze(1)
            if index.numel():
                out = out.index_copy(1, index, run(adapter, x.index_select(1, index)))
    return out.reshape(hidden_states.shape)


def lora_gammas_experts_forward(module: torch.nn.Module, name: str, hidden_states: torch.Tensor,
                                gammas: torch.Tensor) -> torch.Tensor | None:
    """Stacked shared experts' output (..., H) on ``hidden_states`` (..., H) and ``gammas`` (..., E) (token-major,
    as a Linear's input), each token with its adapter's deltas; None when no adapter targets ``name``."""
    from tinkerq.worker.lora import routing

    route = routing.current()
    if route is None or not route.groups:
        return None
    lay = layout(module, name)
    x = hidden_states.reshape(-1, lay.hidden)  # (N, H)
    g = gammas.reshape(-1, lay.num_experts)  # (N, E)
    n_tokens = x.shape[0]
    adapters, token_group = route.token_groups(n_tokens, hidden_states.device)
    if all(a is None or all(a.pair(f"{name}.{p}") is None for p in (GATE, UP, DOWN)) for a in adapters):
        return None
    dtype = hidden_states.dtype

    def run(adapter: Any, rows: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:  # (n, H), (n, E)
        if adapter is None:
            return _gammas_experts(module, lay, rows, coefficients, None, None, 0.0)
        inputs = _input_factors(adapter.pair(f"{name}.{GATE}"), adapter.pair(f"{name}.{UP}"), lay, dtype)
        return _gammas_experts(module, lay, rows, coefficients, inputs, adapter.pair(f"{name}.{DOWN}"),
                               adapter.scaling)

    sizes = route.token_sizes(n_tokens)
    if sizes is not None:  # contiguous groups: each through its own products (batch invariance)
        with route.whole():
            out = torch.cat([run(a, rows, c) for a, rows, c in
                             zip(adapters, torch.split(x, sizes), torch.split(g, sizes), strict=True)])
    else:  # the sampling engine's interleaved rows
        out = x.new_zeros(x.shape)
        for group, adapter in enumerate(adapters):
            index = (token_group == group).nonzero().squeeze(1)
            if index.numel():
                out = out.index_copy(0, index, run(adapter, x.index_select(0, index), g.index_select(0, index)))
    return out.reshape(hidden_states.shape)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int], transposed: bool = False) -> torch.Tensor:
    """``x`` (S, in), its rows in segments of ``counts`` (one per group of ``weight``), times each group's weight:
    ``weight`` (G, out, in), or (G, in, out) when ``transposed``. Returns (S, out). Empty groups cost nothing.

    One ``torch.nn.functional.grouped_mm`` (what transformers' own "grouped_mm" experts use) where the kernel
    takes these shapes (16-byte aligned rows); else a loop over the groups, through ``torch.split`` / ``unbind``,
    whose backward assembles the pieces' gradients once (slicing or indexing would zero-fill a gradient of the
    whole tensor per group). Both give the same numbers (bitwise on CPU)."""
    w = weight if transposed else weight.transpose(1, 2)  # (G, in, out)
    if _grouped_mm_ok(x, w):
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return _ContiguousGrad.apply(F.grouped_mm(x, w, offs=offsets))
    xs, ws = torch.split(x, counts), w.unbind(0)
    pieces = [xi @ wi for xi, wi, n in zip(xs, ws, counts, strict=True) if n]
    if not pieces:
        return x.new_zeros(0, w.shape[2])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether this torch's grouped_mm kernel takes these operands: CPU, or CUDA (SM80+) in bfloat16; every row
    a multiple of 16 bytes (a rank-1..3 float32 factor is not)."""
    if not hasattr(F, "grouped_mm") or x.dtype != w.dtype or x.dim() != 2 or not x.is_contiguous():
        return False
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):  # float64 (a reference run) is refused
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 0):
            return False
    elif x.device.type != "cpu":
        return False
    return all(n * x.element_size() % 16 == 0 for n in (x.shape[1], w.shape[1], w.shape[2]))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (grouped_mm's backward rejects broadcast ones)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _stack(factors: list[torch.Tensor | None], shape: tuple[int, int, int], rank_dim: int, rank: int,
           dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-group factors (E, a, b) (or None: zeros) padded to ``rank`` along ``rank_dim`` (1 or 2) and laid out
    (E * G, a, b) with index e * G + g: the segments the dispatch sorts slots into."""
    num_experts = shape[0]
    padded = []
    for f in factors:
        if f is None:
            f = torch.zeros(shape, dtype=dtype, device=device)
        else:
            f = f.to(dtype).expand(num_experts, *f.shape[1:])
            if f.shape[rank_dim] < rank:  # a lower-rank adapter: zero columns add nothing
                pad = [0, 0, 0, 0]
                pad[2 * (2 - rank_dim) + 1] = rank - f.shape[rank_dim]
                f = F.pad(f, pad)
        padded.append(f)
    return torch.stack(padded, 1).reshape(num_experts * len(factors), *padded[0].shape[1:])


def lora_experts_forward(module: torch.nn.Module, name: str, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor | None:
    """The experts' output (N, H) with each token's adapter delta; None when no routed adapter targets ``name``."""
    from tinkerq.worker.lora import routing

    route = routing.current()
    if route is None or not route.groups:  # (no group: a shard group's idle step, which adapts nothing)
        return None
    n_tokens = top_k_index.shape[0]
    # G adapters (or None), and the group of each token (N,)
    adapters, token_group = route.token_groups(n_tokens, hidden_states.device)
    sizes = route.token_sizes(n_tokens)
    if sizes is not None and routing.PRODUCTS != "stacked":
        # A training pass (contiguous groups): each group's tokens through a dispatch of their own, so its slots'
        # products per expert have the shapes they have alone (batch invariance, worker/lora/batch.py). One group
        # takes the same path: its gradient then sums the dispatch's uses of its tokens in the same order.
        outs = []
        with route.whole():
            for adapter, h, k, w in zip(adapters, torch.split(hidden_states, sizes), torch.split(top_k_index, sizes),
                                        torch.split(top_k_weights, sizes), strict=True):
                zeros = torch.zeros(h.shape[0], dtype=torch.long, device=h.device)
                out = _dispatch(module, name, h, k, w, [adapter], zeros, [h.shape[0]])
                original: Any = type(module)._tinkerq_original_forward  # type: ignore[attr-defined]  # set by register
                outs.append(out if out is not None else original(module, h, k, w))
        return torch.cat(outs)
    return _dispatch(module, name, hidden_states, top_k_index, top_k_weights, adapters, token_group, sizes)


def _dispatch(module: torch.nn.Module, name: str, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor, adapters: list[Any], token_group: torch.Tensor,
              sizes: list[int] | None) -> torch.Tensor | None:
    """The experts' output (N, H) for tokens of ``adapters`` (group g's tokens: ``token_group == g``; contiguous
    runs of ``sizes`` when given); None when no adapter targets ``name``."""
    n_tokens, top_k = top_k_index.shape
    pairs = {p: [a.pair(f"{name}.{p}") if a is not None else None for a in adapters] for p in (GATE, UP, DOWN)}
    if all(pair is None for group in pairs.values() for pair in group):
        return None
    lay = layout(module, name)
    experts_module: Any = module  # an HF experts block: its weights and activation are attributes
    dtype, device = hidden_states.dtype, hidden_states.device
    groups, experts = len(adapters), lay.num_experts
    scalings = [a.scaling if a is not None else 0.0 for a in adapters]
    members = _Members(sizes, token_group, groups)  # each group's tokens

    expert = top_k_index.reshape(-1)  # (S,) S = N * K slots
    segment = expert * groups + token_group.repeat_interleave(top_k)  # (S,) the slot's (expert, group)
    order = torch.argsort(segment, stable=True)  # (S,) expert-major, then group
    token = order // top_k  # (S,) the token of each sorted slot
    per_expert = torch.bincount(expert, minlength=experts).tolist()
    per_segment = torch.bincount(segment, minlength=experts * groups).tolist()
    x = hidden_states[token]  # (S, H)

    up_weight = experts_module.gate_up_proj if lay.gated else experts_module.up_proj
    h = grouped_linear(x, up_weight, per_expert, lay.transposed)  # (S, 2I or I)
    if lay.has_bias:
        h = h + (experts_module.gate_up_proj_bias if lay.gated else experts_module.up_proj_bias)[expert[order]]
    factors = [_input_factors(pairs[GATE][g], pairs[UP][g], lay, dtype) for g in range(groups)]
    if any(f is not None for f in factors):
        h = h + _inner_delta(hidden_states, factors, members, scalings, token, per_segment, experts, h.shape[1])
    h = experts_module._apply_gate(h) if lay.gated else experts_module.act_fn(h)  # (S, I)

    out = grouped_linear(h, experts_module.down_proj, per_expert, lay.transposed)  # (S, H)
    if lay.has_bias:
        out = out + experts_module.down_proj_bias[expert[order]]
    weights = top_k_weights.reshape(-1)[order].to(out.dtype)[:, None]  # (S, 1)
    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(order.numel(), device=device)
    final = (out * weights)[unsort].view(n_tokens, top_k, out.shape[1]).sum(1)  # (N, H) (N may be 0)

    down = pairs[DOWN]
    if any(p is not None for p in down):
        rank = max(p[0].shape[1] for p in down if p is not None)
        a_stack = _stack([p[0] if p is not None else None for p in down], (experts, rank, lay.intermediate), 1, rank,
                         dtype, device)  # (E * G, r, I)
        ha = grouped_linear(h, a_stack, per_segment)  # (S, r)
        ha = (ha * weights)[unsort].view(n_tokens, top_k, ha.shape[1]).sum(1)  # (N, r): routing-weighted, per token
        parts = [F.linear(rows[:, :pair[1].shape[2]] * scalings[g], pair[1][0].to(dtype))
                 if pair is not None and rows.shape[0] else None
                 for g, (pair, rows) in enumerate(zip(down, members.gather(ha), strict=True))]  # (n_g, H)
        final = final + members.scatter(parts, final.shape[1], final)
    return final.to(hidden_states.dtype)


def _input_factors(gate: Any, up: Any, lay: ExpertsLayout,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One group's w1 and w3 adapters as one pair over the input projection's whole output (2I gated, else I):
    A (R, H) their shared factors stacked, B (E, 2I, R) block-diagonal in the projection's own layout
    ([gate | up] or interleaved), so both deltas are one grouped matmul and one add."""
    present = [(pair, rows) for pair, rows in ((gate, "gate"), (up, "up")) if pair is not None]
    if not present:
        return None
    width = 2 * lay.intermediate if lay.gated else lay.intermediate
    rank = sum(pair[0].shape[1] for pair, _ in present)
    b = torch.zeros(lay.num_experts, width, rank, dtype=dtype, device=present[0][0][1].device)
    col = 0
    for pair, which in present:
        r = pair[0].shape[1]
        if not lay.gated:
            rows = slice(None)
        elif lay.concatenated:
            rows = slice(0, lay.intermediate) if which == "gate" else slice(lay.intermediate, None)
        else:
            rows = slice(0, None, 2) if which == "gate" else slice(1, None, 2)
        b[:, rows, col:col + r] = pair[1].to(dtype)
        col += r
    a = torch.cat([pair[0][0].to(dtype) for pair, _ in present])  # (R, H)
    return a, b


class _Members:
    """Which of the (N,) flattened tokens each group holds: contiguous runs in training passes (views, one
    concatenation), row indices in the sampling engine (gathers and index copies)."""

    def __init__(self, sizes: list[int] | None, token_group: torch.Tensor, groups: int) -> None:
        self.sizes = sizes
        self.index = None if sizes is not None else [(token_group == g).nonzero().squeeze(1) for g in range(groups)]

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """``t`` (N, ...) cut into each group's rows."""
        if self.sizes is not None:
            return list(torch.split(t, self.sizes))
        return [t.index_select(0, i) for i in self.index]  # type: ignore[union-attr]

    def scatter(self, parts: list[torch.Tensor | None], width: int, like: torch.Tensor) -> torch.Tensor:
        """Per-group rows (n_g, width) (None: zeros) back into one (N, width)."""
        sizes = self.sizes if self.sizes is not None else [len(i) for i in self.index]  # type: ignore[union-attr]
        if self.sizes is not None:
            return torch.cat([p if p is not None else like.new_zeros(n, width) for p, n in zip(parts, sizes,
                                                                                                   strict=True)])
        out = like.new_zeros(like.shape[0], width)
        for p, i in zip(parts, self.index, strict=True):  # type: ignore[arg-type]
            if p is not None:
                out = out.index_copy(0, i, p)
        return out


def _inner_delta(hidden: torch.Tensor, factors: list[tuple[torch.Tensor, torch.Tensor] | None],
                 members: _Members, scalings: list[float], token: torch.Tensor, per_segment: list[int],
                 num_experts: int, width: int) -> torch.Tensor:
    """The input projection's delta on the sorted slots (S, width): s * (x A^T) per group's tokens (N, R), then
    the per-expert B over the (expert, group) segments."""
    rank = max(f[0].shape[0] for f in factors if f is not None)
    parts = [F.pad(F.linear(rows, f[0]) * scalings[g], (0, rank - f[0].shape[0]))
             if f is not None and rows.shape[0] else None
             for g, (f, rows) in enumerate(zip(factors, members.gather(hidden), strict=True))]  # (n_g, R)
    xa = members.scatter(parts, rank, hidden)  # (N, R)
    b_stack = _stack([f[1] if f is not None else None for f in factors], (num_experts, width, rank), 2, rank,
                     hidden.dtype, hidden.device)  # (E * G, width, R)
    return grouped_linear(xa[token], b_stack, per_segment)  # (S, width)


def delta_weight(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """The per-expert weight change (E, out, in) of one projection's factors, in float32."""
    return scaling * torch.matmul(b.float(), a.float())  # (E|1, out, r) @ (E|1, r, in) broadcasts to (E, out, in)


def merge(module: torch.nn.Module, proj: str, delta: torch.Tensor, lay: ExpertsLayout,
          merged: dict[str, torch.Tensor]) -> None:
    """Add ``delta`` (E, out, in) to projection ``proj`` of ``module`` in ``merged`` ({param name: float32 copy},
    filled from the module on first use, so w1 and w3 both land in one gate_up_proj)."""
    if proj == DOWN:
        name, rows = "down_proj", slice(None)
    elif lay.gammas:  # separate gate_proj and up_proj
        name, rows = ("gate_proj" if proj == GATE else "up_proj"), slice(None)
    elif not lay.gated:
        name, rows = "up_proj", slice(None)
    else:
        name, first = "gate_up_proj", proj == GATE
        if lay.concatenated:
            rows = slice(0, lay.intermediate) if first else slice(lay.intermediate, None)
        else:
            rows = slice(0, None, 2) if first else slice(1, None, 2)
    if name not in merged:
        merged[name] = getattr(module, name).detach().float().clone()
    view = merged[name].transpose(1, 2) if lay.transposed else merged[name]  # (E, out, in)
    view[:, rows] += delta

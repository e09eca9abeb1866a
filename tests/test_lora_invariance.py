"""Batch invariance of mixed LoRA passes (worker/lora/batch.py): a request's logprobs, per-token losses, loss,
metrics and adapter gradients in a pass shared with other tenants are bitwise (``torch.equal``) what it gets
alone in a pass, on dense and MoE models (float32, CPU); and micro-batches of different tenants that can share a
forward do share it.

Tenants differ in rank, targets, loss and datum lengths (prompt positions weighted zero, a fully masked RL datum,
one-token datums), so their rows pad, micro-batch and route differently.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinkerq import types
from tinkerq.recipes.families import build_model
from tinkerq.worker.lora import routing
from tinkerq.worker.lora.batch import LossItem, padded_length, plan, run_pass
from tinkerq.worker.lora.session import LoraBase, LoraSession
from tinkerq.worker.training.logprobs import LogprobComputer

pytestmark = pytest.mark.timeout(120)
VOCAB = 101  # the families' tiny vocabulary
MICROBATCH_TOKENS = 96
PPO = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
# (rank, flags, loss): every tenant a different rank; targets and losses differ too
TENANTS = [(4, {}, "cross_entropy"), (2, dict(train_unembed=False), "ppo"),
           (8, dict(train_attn=False), "importance_sampling"), (3, dict(train_mlp=False), "cross_entropy")]
VARIED = [[5, 17, 9, 30, 1], [12], [40, 3, 25, 7], [1, 14]]  # per tenant: several micro-batches, or one short datum
STACKED = [[20, 31, 18, 25, 29], [24], [19, 32, 27], [30, 17]]  # every micro-batch pads to 32: one forward of 352
# model -> (config overrides, micro-batch tokens, datum lengths per tenant): dense families, and MoE ones; the wide
# one stacks 352-row products where each tenant alone has 32-160 (MKL on 2 threads sums a (M, 1024) x (1024, 256)
# product's rows differently for M = 32..64 and M >= 192: the case per-group products are for)
MODELS = {
    "llama": (dict(), MICROBATCH_TOKENS, VARIED),
    "llama-wide": (dict(hidden_size=256, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4,
                        head_dim=32), 512, STACKED),
    "qwen3_moe": (dict(), MICROBATCH_TOKENS, VARIED),
    "gpt_oss": (dict(), MICROBATCH_TOKENS, VARIED),
    "deepseek_v3": (dict(), MICROBATCH_TOKENS, VARIED),
    "qwen3_5_moe": (dict(), MICROBATCH_TOKENS, VARIED),
}


def lora_base(name: str) -> LoraBase:
    overrides, budget, _ = MODELS[name]
    model = build_model(name.split("-")[0], 0, **overrides)
    return LoraBase(model, LogprobComputer(model, "torch"), model_dir="/nonexistent", microbatch_tokens=budget)


def tenants(base: LoraBase) -> list[LoraSession]:
    out = []
    for i, (rank, flags, _) in enumerate(TENANTS):
        s = LoraSession(f"t{i}", base, types.LoraConfig(rank=rank, seed=40 + i, **flags), base_model="tiny")
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():  # nonzero B: every adapter changes its own rows
            for p in s.engine.params:
                p.add_(torch.randn(p.shape, generator=gen), alpha=0.05)
        out.append(s)
    return out


def datum(rng: np.random.Generator, n: int, loss: str, masked: bool = False) -> types.Datum:
    seq = rng.integers(3, VOCAB, size=n + 1)
    prompt = int(rng.integers(0, n))  # prompt positions: weight (advantage, sampler logprob) zero
    live = np.arange(n) >= prompt
    if masked:
        live[:] = False
    inputs: dict = {"target_tokens": seq[1:].tolist()}
    if loss == "cross_entropy":
        inputs["weights"] = np.where(live, rng.uniform(0.5, 1.5, n), 0.0).astype(np.float32)
    else:
        inputs["logprobs"] = np.where(live, rng.uniform(-6.0, -2.0, n), 0.0).astype(np.float32)
        inputs["advantages"] = np.where(live, rng.normal(size=n), 0.0).astype(np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1].tolist()), loss_fn_inputs=inputs)


def requests(seed: int, lengths: list[list[int]] = VARIED) -> list[list[types.Datum]]:
    """Per tenant, datums of ``lengths``; RL tenants' second datum is fully masked."""
    rng = np.random.default_rng(seed)
    out = []
    for (_, _, loss), ns in zip(TENANTS, lengths, strict=True):
        out.append([datum(rng, n, loss, masked=(loss != "cross_entropy" and i == 1)) for i, n in enumerate(ns)])
    return out


def run(base: LoraBase, sessions: list[LoraSession], data: list[list[types.Datum]],
        backward: bool, checkpointing: bool = False) -> list[tuple[types.ForwardBackwardOutput, list[torch.Tensor]]]:
    items = [LossItem(s, d, loss, PPO if loss == "ppo" else None, checkpointing=checkpointing)
             for s, d, (_, _, loss) in zip(sessions, data, TENANTS, strict=True)]
    run_pass(items, base.model, base.logprobs, head=base.head, microbatch_tokens=base.microbatch_tokens,
             device=base.device, backward=backward)
    out = []
    for item in items:
        assert item.error is None, item.error
        out.append((item.output, [p.grad.clone() for p in item.target.engine.params]))
        for p in item.target.engine.params:
            p.grad.zero_()
    return out


@pytest.fixture(params=["groups", "tiles"])
def layout(request, monkeypatch):
    """Each bitwise layout of a pass's products (routing.PRODUCTS): per group (the default) and in tiles."""
    monkeypatch.setattr(routing, "PRODUCTS", request.param)
    return request.param


def assert_bitwise(mixed, alone) -> None:
    (out, grads), (solo, solo_grads) = mixed, alone
    assert out.metrics == solo.metrics  # exact floats: loss:sum and every metric
    for a, b in zip(out.loss_fn_outputs, solo.loss_fn_outputs, strict=True):
        for key in ("logprobs", "elementwise_loss"):
            assert np.array_equal(a[key].to_numpy(), b[key].to_numpy()), key
    for g, h in zip(grads, solo_grads, strict=True):
        assert torch.equal(g, h), float((g - h).abs().max())


@pytest.mark.parametrize("name", list(MODELS))
def test_a_mixed_pass_is_bitwise_each_tenant_alone(name, layout):
    base = lora_base(name)
    sessions = tenants(base)
    data = requests(1, MODELS[name][2])
    for backward in (True, False):
        mixed = run(base, sessions, data, backward)
        for i, s in enumerate(sessions):
            assert_bitwise(mixed[i], _alone(base, s, data[i], TENANTS[i][2], backward)[0])
        if not backward:
            for s in sessions:  # a forward leaves no gradient
                assert all(not p.grad.any() for p in s.engine.params)


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_small_tiles_and_chunks_stay_bitwise(name, monkeypatch):
    """Tiles of 16 tokens and loss-head chunks of 40 (the defaults, 128 and the vocabulary's, leave these tiny
    passes one tile a product): every group's tokens span several tiles and a shorter last one, tiles of several
    sizes share one chunk and a chunk cuts through groups; each tenant still gets its numbers alone."""
    monkeypatch.setattr(routing, "PRODUCTS", "tiles")
    monkeypatch.setattr(routing, "TILE_ROWS", 16)
    base = lora_base(name)
    monkeypatch.setattr(base.logprobs, "chunk_tokens", 40)
    sessions = tenants(base)
    data = requests(3, MODELS[name][2])
    mixed = run(base, sessions, data, True)
    for i, s in enumerate(sessions):
        assert_bitwise(mixed[i], _alone(base, s, data[i], TENANTS[i][2], True)[0])


def _alone(base, session, data, loss, backward):
    items = [LossItem(session, data, loss, PPO if loss == "ppo" else None)]
    run_pass(items, base.model, base.logprobs, head=base.head, microbatch_tokens=base.microbatch_tokens,
             device=base.device, backward=backward)
    assert items[0].error is None, items[0].error
    out = [(items[0].output, [p.grad.clone() for p in session.engine.params])]
    for p in session.engine.params:
        p.grad.zero_()
    return out


def test_training_in_mixed_passes_equals_training_alone(layout):
    """Three forward_backward + optim_step rounds (AdamW, eps 1e-12, which magnifies any last-bit difference of a
    gradient): a tenant trained in mixed passes ends with the weights of the same tenant trained alone."""
    base = lora_base("qwen3_moe")
    mixed, solo = tenants(base), tenants(base)[1]  # solo starts as mixed[1] (same seeds)
    adam = types.AdamParams(learning_rate=1e-2, eps=1e-12)
    for step in range(3):
        data = requests(10 + step)
        items = [LossItem(s, d, loss, PPO if loss == "ppo" else None)
                 for s, d, (_, _, loss) in zip(mixed, data, TENANTS, strict=True)]
        run_pass(items, base.model, base.logprobs, head=base.head, microbatch_tokens=base.microbatch_tokens,
                 device=base.device, backward=True)
        alone = [LossItem(solo, data[1], "ppo", PPO)]
        run_pass(alone, base.model, base.logprobs, head=base.head, microbatch_tokens=base.microbatch_tokens,
                 device=base.device, backward=True)
        assert items[1].output.metrics == alone[0].output.metrics
        norms = [s.optim_step(adam).metrics["grad_norm:mean"] for s in mixed]
        assert solo.optim_step(adam).metrics["grad_norm:mean"] == norms[1]
    for p, q in zip(mixed[1].engine.params, solo.engine.params, strict=True):
        assert torch.equal(p, q)


def test_micro_batches_of_equal_length_share_a_forward():
    """Two tenants whose micro-batches pad to the same length run them in one forward (the speed-up of mixed
    passes); a tenant of another length runs its own; each still gets its numbers alone."""
    base = lora_base("llama")
    sessions = tenants(base)[:3]
    rng = np.random.default_rng(2)
    data = [[datum(rng, 20, "cross_entropy"), datum(rng, 27, "cross_entropy")],  # both pad to 32
            [datum(rng, 32, "ppo")],
            [datum(rng, 50, "importance_sampling")]]  # pads to 64
    forwards = []
    hook = base.model.base_model.register_forward_pre_hook(lambda m, a, k: forwards.append(k["input_ids"].shape),
                                                           with_kwargs=True)
    try:
        items = [LossItem(s, d, TENANTS[i][2], PPO if i == 1 else None) for i, (s, d) in
                 enumerate(zip(sessions, data, strict=True))]
        run_pass(items, base.model, base.logprobs, head=base.head, microbatch_tokens=MICROBATCH_TOKENS,
                 device=base.device, backward=True)
    finally:
        hook.remove()
    # tenant 0 (2 rows, padded) and 1 (1 row, unpadded) differ in padding: 32 and 32 do not stack unless both
    # are padded or both are not; tenant 0's rows are padded, tenant 1's is not
    assert sorted(tuple(s) for s in forwards) == [(1, 32), (1, 64), (2, 32)]
    for s in sessions:
        for p in s.engine.params:
            p.grad.zero_()
    data[1] = [datum(rng, 31, "ppo")]  # now padded to 32 too: one forward for tenants 0 and 1
    forwards.clear()
    hook = base.model.base_model.register_forward_pre_hook(lambda m, a, k: forwards.append(k["input_ids"].shape),
                                                           with_kwargs=True)
    try:
        items = [LossItem(s, d, TENANTS[i][2], PPO if i == 1 else None) for i, (s, d) in
                 enumerate(zip(sessions, data, strict=True))]
        run_pass(items, base.model, base.logprobs, head=base.head, microbatch_tokens=MICROBATCH_TOKENS,
                 device=base.device, backward=True)
    finally:
        hook.remove()
    assert sorted(tuple(s) for s in forwards) == [(1, 64), (3, 32)]
    mixed = [(item.output, [p.grad.clone() for p in item.target.engine.params]) for item in items]
    for s in sessions:
        for p in s.engine.params:
            p.grad.zero_()
    for i, s in enumerate(sessions):
        assert_bitwise(mixed[i], _alone(base, s, data[i], TENANTS[i][2], True)[0])


def test_the_plan_keeps_each_tenants_micro_batches_and_order():
    """Each tenant's micro-batches are those it has alone, in its order, at most one per step; a step holds one
    padded length and stays within the token budget unless one micro-batch alone exceeds it."""
    rng = np.random.default_rng(4)
    items = [LossItem(None, [datum(rng, int(n), "cross_entropy") for n in rng.integers(1, 70, size=k)],  # type: ignore[arg-type]
                      "cross_entropy", None) for k in (1, 3, 6, 2, 9)]
    steps = plan(items, MICROBATCH_TOKENS)
    for item in items:
        mine = [(m.start, m.stop, m.length) for step in steps for m in step if m.item is item]
        alone = [(m.start, m.stop, m.length) for step in plan([item], MICROBATCH_TOKENS) for m in step]
        assert mine == alone
        assert mine[0][0] == 0 and mine[-1][1] == len(item.data)
    for step in steps:
        assert len({id(m.item) for m in step}) == len(step)
        assert len({m.key for m in step}) == 1
        assert len(step) == 1 or sum(m.rows * m.length for m in step) <= MICROBATCH_TOKENS
    assert [padded_length(n) for n in (1, 16, 17, 100, 128, 129, 144, 145, 300, 1000, 1025)] == \
        [16, 16, 32, 112, 128, 144, 144, 160, 320, 1024, 1152]
    assert padded_length(250, cap=240) == 250 and padded_length(230, cap=240) == 240


def test_products_over_the_batch_run_in_tiles(monkeypatch):
    """A frozen weight's products over the batch's rows or flattened tokens run in tiles of TILE_ROWS tokens per
    group (then one shorter tile), each tile as a product of its own; a weight that takes a gradient (an adapter's)
    runs per group; a group's own tokens run whole."""
    monkeypatch.setattr(routing, "PRODUCTS", "tiles")
    a, b = object(), object()
    linear = torch.nn.functional.linear
    x, w, bias = torch.randn(5, 4, 3), torch.randn(6, 3), torch.randn(6)
    trained = torch.randn(6, 3, requires_grad=True)
    with routing.routed([(a, slice(0, 2)), (b, slice(2, 5))], length=4) as route:
        assert route.row_sizes(torch.zeros(5, 4, 3)) == [2, 3]
        assert route.row_sizes(torch.zeros(20, 3)) == [8, 12]
        assert route.row_sizes(torch.zeros(8, 3)) is None  # a group's own tokens
        with route.whole():
            assert route.row_sizes(torch.zeros(5, 4, 3)) is None
        old, routing.TILE_ROWS = routing.TILE_ROWS, 5
        try:
            tiled, tiled_flat, per_group = linear(x, w, bias), linear(x.view(20, 3), w), linear(x, trained)
        finally:
            routing.TILE_ROWS = old
    flat = x.reshape(20, 3)
    # group a: tokens 0-7 -> tiles 0-4, 5-7; group b: 8-19 -> 8-12, 13-17, 18-19
    want = torch.cat([linear(flat[i:j].unsqueeze(0), w)[0] for i, j in [(0, 5), (5, 8), (8, 13), (13, 18), (18, 20)]])
    assert torch.allclose(tiled.view(20, 6), want + bias) and torch.allclose(tiled_flat, want)
    assert torch.equal(per_group, torch.cat([linear(x[:2], trained), linear(x[2:], trained)]))


def test_a_tile_computes_as_alone_whatever_shares_its_product():
    """The property tiles rest on, on this CPU: a group's rows get the same bits from ``tiled_linear`` whatever
    groups share the call (shapes where plain products do not: rows of a (M, 1024) x (1024, 256) product differ
    by M with MKL on 2 threads, and so did a 128-row tile's inside a ``torch.bmm`` of 7 tiles against the same tile
    alone on 2026-12-03's CPU), forward and the gradient of the input, 1 and 2 threads."""
    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for k, n in [(1024, 256), (256, 1024), (384, 32000 // 8)]:
                w = torch.randn(n, k, generator=gen)
                sizes = [16, 128, 300, 7, 128, 48, 256, 130]
                x = torch.randn(sum(sizes), k, generator=gen, requires_grad=True)
                g = torch.randn(sum(sizes), n, generator=gen)
                out = routing.tiled_linear(x, w, None, sizes)
                (grad,) = torch.autograd.grad(out, x, g)
                at = 0
                for m in sizes:
                    mine = x[at:at + m].detach().requires_grad_()
                    alone = routing.tiled_linear(mine, w, None, [m])
                    (grad_alone,) = torch.autograd.grad(alone, mine, g[at:at + m])
                    assert torch.equal(out[at:at + m], alone), (n_threads, k, n, m)
                    assert torch.equal(grad[at:at + m], grad_alone), (n_threads, k, n, m)
                    at += m
    finally:
        torch.set_num_threads(threads)


def test_position_dependent_activations_run_per_group():
    """sigmoid of a Qwen3.5-MoE shared-expert gate, (B * T, 1): each group's elements computed as a tensor of their
    own (on AVX-512 a lone 16-element tensor is a scalar tail, the same 16 inside 48 a vector block, whose last
    bits differ), and so are the other listed activations; in-place calls and other functions run whole."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(48, 1, generator=gen) * 3
    y = torch.randn(3, 16, 8, generator=gen) * 3
    F = torch.nn.functional
    cases = [(torch.sigmoid, x), (F.sigmoid, x), (F.silu, y), (F.softplus, x),
             (lambda t: F.gelu(t, approximate="tanh"), y), (F.mish, y), (F.elu, y)]
    with routing.routed([(object(), slice(0, 1)), (object(), slice(1, 3))], length=16):
        got = [f(t) for f, t in cases]
        z = x.clone()
        assert F.silu(z, inplace=True) is z
    for (f, t), out in zip(cases, got, strict=True):
        if t.shape[0] == 48:
            want = torch.cat([f(t[:16].clone()), f(t[16:].clone())])
        else:
            want = torch.cat([f(t[:1].clone()), f(t[1:].clone())])
        assert torch.equal(out, want)


def test_the_tiled_head_is_the_full_logits_head():
    """The loss head in tiles (worker/lora/head.py): target logprobs and gradients (hidden states, each group's
    low-rank factors) equal the full-logits computation's (float64, within rounding), with tiles of several sizes
    in one chunk, chunks that cut through groups, and a group without an output-projection adapter."""
    from tinkerq.worker.lora.head import tiled_target_logprobs
    from tinkerq.worker.loss_head.chunked import TorchChunkKernel

    gen = torch.Generator().manual_seed(3)
    counts, vocab, hidden_size, rank = [37, 5, 60], 50, 12, 3
    n = sum(counts)
    h = torch.randn(n, hidden_size, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    lows = [torch.randn(c, rank, generator=gen, dtype=torch.float64, requires_grad=True) for c in counts]
    lws = [torch.randn(vocab, rank, generator=gen, dtype=torch.float64, requires_grad=True) for _ in counts]
    pairs = [(lows[0], lws[0]), None, (lows[2], lws[2])]
    got = tiled_target_logprobs(h, w, targets, counts, pairs, tile_rows=16, chunk_tokens=40, kernel=TorchChunkKernel())
    logits = h @ w.t()
    extra = [lows[0] @ lws[0].t(), torch.zeros(counts[1], vocab, dtype=torch.float64), lows[2] @ lws[2].t()]
    logits = logits + torch.cat(extra)
    want = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    weights = torch.randn(n, generator=gen, dtype=torch.float64)
    inputs = [h, lows[0], lws[0], lows[2], lws[2]]
    grads = torch.autograd.grad((got * weights).sum(), inputs)
    want_grads = torch.autograd.grad((want * weights).sum(), inputs)
    for g, v in zip(grads, want_grads, strict=True):
        assert torch.allclose(g, v, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_one_adapter_over_every_row_is_the_row_index_route(name):
    """A sampling forward whose rows all hold one snapshot (row-index routing, worker/sampling/forwards.py) adds
    the delta to the whole output, without the gather and scatter: bitwise what the gather and scatter give, for
    hooked Linears over the batch's rows and over its flattened tokens (a MoE block's), and the head over a strided
    view (the last position of each row, as a prefill keeps)."""
    base = lora_base(name)
    session = tenants(base)[0]
    adapter = session.adapter.frozen()
    ids = torch.randint(0, VOCAB, (5, 7), generator=torch.Generator().manual_seed(3))
    out = []
    for fast in (True, False):
        with torch.no_grad(), routing.routed([(adapter, torch.arange(5))], batch=5) as route:
            assert route.one_adapter
            route.one_adapter = fast
            out.append([base.model(input_ids=ids).logits, base.model(input_ids=ids, logits_to_keep=1).logits])
    with torch.no_grad():
        plain = base.model(input_ids=ids).logits
    for fast, gathered in zip(*out, strict=True):
        assert torch.equal(fast, gathered)
    assert not torch.equal(out[0][0], plain)  # the adapter changed the rows
    with routing.routed([(adapter, torch.tensor([0, 2, 1]))], batch=3) as route:
        assert not route.one_adapter  # not in order
    with routing.routed([(adapter, torch.arange(4))], batch=5) as route:
        assert not route.one_adapter  # a row without the adapter

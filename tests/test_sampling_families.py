"""The sampling engine on every model family (recipes/families.py): full and sliding-window attention (gpt-oss
sinks, Gemma 3, Mistral), gated-delta-net and Mamba-2 state (Qwen3.5, Nemotron-H), MLA's latent cache
(DeepSeek-V3), MoE. Jobs of different prompt lengths join a running batch and leave it; every sampled token's
logprob and every prompt logprob equals a plain unpadded forward's (also for rows of LoRA snapshots over the
model), and seeded tokens do not depend on the batch.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import numpy as np
import pytest
import torch
from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer, LinearAttentionAndFullAttentionLayer

from tests.test_sampling_engine import make_job
from tinkerq import types
from tinkerq.recipes.families import FAMILIES, build_model
from tinkerq.worker.lora import routing
from tinkerq.worker.lora.session import LoraBase, LoraSession
from tinkerq.worker.sampling import SampleJob, TorchEngine, cache_rows, run_jobs
from tinkerq.worker.training.logprobs import LogprobComputer

pytestmark = pytest.mark.timeout(120)

ATOL = 1e-4


@functools.cache
def model_of(family: str) -> Any:
    return build_model(family)


def prompt_of(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 50, size=length).tolist()  # ids every family's vocab has


def forward_logprobs(model: Any, tokens: list[int]) -> torch.Tensor:
    """log_softmax (N, V) of one unpadded full forward of ``tokens``: row i predicts token i + 1."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def assert_matches_forward(model: Any, job: SampleJob, seqs: list[types.SampledSequence],
                           prompt_logprobs: list[np.ndarray], atol: float = ATOL) -> None:
    """Each token's logprob (and a greedy row's argmax) and the prompt's logprobs, from a plain forward."""
    assert len(seqs) == job.num_samples
    p = len(job.prompt)
    for seq in seqs:
        assert seq.stop_reason == "length" and len(seq.tokens) == len(seq.logprobs) == job.max_tokens
        lp = forward_logprobs(model, job.prompt + seq.tokens)  # (P + N, V)
        want = lp[p - 1:-1].gather(-1, torch.tensor(seq.tokens)[:, None]).squeeze(-1)  # (N,)
        np.testing.assert_allclose(seq.logprobs, want.numpy(), atol=atol, rtol=0)
        if job.params.temperature == 0:
            assert seq.tokens == lp[p - 1:-1].argmax(-1).tolist()
    if job.on_prompt_logprobs is not None:
        (got,) = prompt_logprobs  # exactly once
        lp = forward_logprobs(model, job.prompt)
        want = lp[:-1].gather(-1, torch.tensor(job.prompt[1:])[:, None]).squeeze(-1)
        assert got.shape == (p,) and np.isnan(got[0])
        np.testing.assert_allclose(got[1:], want.numpy(), atol=ATOL, rtol=0)


class Schedule:
    """Steps an engine on this thread and submits jobs after given steps (``at``: step -> jobs, submitted as
    that step ends), so they join rows already decoding; it records the step at which each job is answered."""

    def __init__(self, at: dict[int, list[SampleJob]]) -> None:
        self.at = at
        self.engine = TorchEngine()
        self.done_at: dict[int, int] = {}  # id(job) -> engine step when answered
        self.outcomes: dict[int, tuple[Any, Any]] = {}

    def watch(self, job: SampleJob) -> SampleJob:
        def on_done(seqs: Any, err: Any) -> None:
            self.done_at[id(job)] = self.engine.steps
            self.outcomes[id(job)] = (seqs, err)
        job.on_done = on_done
        return job

    def run(self, first: list[SampleJob]) -> None:
        jobs = first + [j for js in self.at.values() for j in js]
        for job in jobs:
            self.watch(job)
        try:
            for job in first:
                self.engine.submit(job)
            while self.engine.step():
                for job in self.at.pop(self.engine.steps - 1, []):
                    self.engine.submit(job)  # admitted at the next step, beside the running rows
            if len(self.outcomes) < len(jobs):  # a failed job can leave the schedule unreached
                errors = [err for _, err in self.outcomes.values() if err is not None]
                raise errors[0] if errors else TimeoutError("the jobs did not finish")
        finally:
            self.engine.close()
        assert not self.at


def asking(job: SampleJob, asked: dict[int, list[np.ndarray]]) -> SampleJob:
    """``job`` asking for its prompt logprobs, collected into ``asked[id(job)]``."""
    job.on_prompt_logprobs = asked.setdefault(id(job), []).append
    return job


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_logprobs_equal_plain_forward(family: str) -> None:
    model = model_of(family)
    window = getattr(model.config, "sliding_window", None)
    assert window is None or window < 9  # the longer prompts, and every row's decode, go past the window
    asked: dict[int, list[np.ndarray]] = {}

    def job(prompt: list[int], n: int, max_tokens: int, **params: Any) -> SampleJob:
        return make_job(model, prompt, n, max_tokens, key=family, **params)

    first = job(prompt_of(5, 1), 2, 10, temperature=1.0, seed=1)
    at = {
        1: [asking(job(prompt_of(14, 2), 2, 6, temperature=1.0, seed=2), asked),  # past the window
            asking(job(prompt_of(3, 3), 1, 10, temperature=0.0), asked),  # greedy, shorter than the window
            asking(job(prompt_of(14, 4), 1, 8, temperature=1.0, seed=4), asked)],  # one prefill with the other 14
        4: [job(prompt_of(9, 5), 3, 3, temperature=1.0, seed=5),  # rows finish while others run
            job(prompt_of(7, 6), 1, 9, temperature=1.0, seed=6)],
    }
    late = [j for js in at.values() for j in js]
    schedule = Schedule(at)
    schedule.run([first])

    assert schedule.done_at[id(first)] > 4  # the late jobs joined a running batch
    for made in [first, *late]:
        seqs, err = schedule.outcomes[id(made)]
        assert err is None, err
        assert_matches_forward(model, made, seqs, asked.get(id(made), []))


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "gpt_oss", "mistral"])
def test_seeded_tokens_do_not_depend_on_the_batch(family: str) -> None:
    model = model_of(family)

    def target() -> SampleJob:
        return make_job(model, prompt_of(11, 50), 2, 9, key=family, temperature=1.0, seed=7)

    (alone,) = run_jobs(None, [target()], timeout=60)
    others = [make_job(model, prompt_of(n, n), 2, 10, key=family, temperature=1.0, seed=n) for n in (3, 13)]
    batched = run_jobs(None, [others[0], target(), others[1]], timeout=60)[1]
    joining = target()
    schedule = Schedule({2: [joining]})
    running = make_job(model, prompt_of(6, 60), 2, 10, key=family, temperature=1.0, seed=60)
    schedule.run([running])
    joined, err = schedule.outcomes[id(joining)]
    assert err is None and schedule.done_at[id(running)] > 2

    tokens = [s.tokens for s in alone]
    assert len({tuple(t) for t in tokens}) == 2  # the two rows of the seeded job differ
    for seqs in (batched, joined):
        assert [s.tokens for s in seqs] == tokens
        np.testing.assert_allclose([s.logprobs for s in seqs], [s.logprobs for s in alone], atol=ATOL, rtol=0)


def test_deepseek_caches_the_latent_and_reexpands_it_through_kv_b_proj() -> None:
    """MLA's cache is the latent (B, 1, T, kv_lora_rank) and the rope key (B, 1, T, qk_rope_head_dim), not the
    per-head keys and values: the engine's rows hold just that, and every decode step re-expands the whole
    latent through ``kv_b_proj``, so a LoRA-style hook there applies at every step and logprobs stay exact."""
    model = model_of("deepseek_v3")
    config = model.config
    rank, rope = config.kv_lora_rank, config.qk_rope_head_dim
    gen = torch.Generator().manual_seed(0)
    low_a = torch.randn(2, rank, generator=gen)  # (r, in): a rank-2 delta on kv_b_proj, as LoRA adds it
    low_b = torch.randn(config.num_attention_heads * (config.qk_nope_head_dim + config.v_head_dim), 2, generator=gen)
    inputs: list[tuple[int, ...]] = []

    def lora(module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
        inputs.append(tuple(args[0].shape))
        return out + 0.5 * (args[0] @ low_a.T) @ low_b.T

    row_shapes: list[list[tuple[int, ...]]] = []
    engine = TorchEngine()

    def gate(module: torch.nn.Module, args: Any) -> None:  # before each of the engine's forwards
        group = engine._groups.get("ds")
        if group is not None and group.rows is not None:
            row_shapes.append([tuple(x.shape) for state in group.rows.state for x in state])

    jobs = [make_job(model, prompt_of(n, n), 2, 4, key="ds", seed=n) for n in (4, 9)]
    handles = [layer.self_attn.kv_b_proj.register_forward_hook(lora) for layer in model.model.layers]
    handles.append(model.register_forward_pre_hook(gate))
    try:
        results = run_jobs(engine, jobs, timeout=60)
        engine.close()
        handles.pop().remove()  # the gate: the reference forwards below are not the engine's
        assert max(shape[2] for shape in inputs) == 9 + 4 - 1  # the last decode expands every cached column
        assert all(shape[1] == 1 and shape[3] == rank for shape in inputs)
        for job, seqs in zip(jobs, results, strict=True):
            assert_matches_forward(model, job, seqs, [])  # the reference forward runs the hook too
    finally:
        engine.close()
        for handle in handles:
            handle.remove()
    plain = forward_logprobs(model, jobs[1].prompt + results[1][0].tokens)[8:-1]
    hooked = torch.tensor(results[1][0].logprobs)
    assert (plain.gather(-1, torch.tensor(results[1][0].tokens)[:, None]).squeeze(-1) - hooked).abs().max() > 1e-3
    assert row_shapes
    for shapes in row_shapes:
        assert len(shapes) == 2 * config.num_hidden_layers
        for keys, values in zip(shapes[::2], shapes[1::2], strict=True):
            assert keys[1] == values[1] == 1 and keys[3] == rank and values[3] == rope and keys[2] == values[2]


def test_hybrid_layer_state_round_trip() -> None:
    """A layer holding both linear-attention state and keys/values: rows are selected and concatenated in
    both parts (no family here has one; e.g. Falcon-H1 style caches do)."""
    layer = LinearAttentionAndFullAttentionLayer(number_of_states=1)
    kind = cache_rows.kind_of(layer)

    def rows(b: int, t: int, start: float) -> cache_rows.State:
        conv = torch.arange(b * 3 * 2, dtype=torch.float32).view(b, 3, 2) + start  # (B, C, K)
        recurrent = torch.full((b, 2, 2, 2), start)  # (B, H, Dk, Dv)
        keys = torch.arange(b * t, dtype=torch.float32).view(b, 1, t, 1).expand(b, 2, t, 4) + start  # (B, H, T, D)
        return [conv, recurrent, keys, keys + 0.5]

    a, b = rows(2, 5, 0.0), rows(1, 3, 100.0)
    both = kind.cat([a, b])
    assert [tuple(x.shape) for x in both] == [(3, 3, 2), (3, 2, 2, 2), (3, 2, 5, 4), (3, 2, 5, 4)]
    assert torch.equal(both[2][2, :, :2], torch.zeros(2, 2, 4)) and torch.equal(both[2][2, :, 2:], b[2][0])
    kind.put(layer, both, 5)
    assert layer.has_previous_state[0] and layer.keys is both[2] and layer.conv_states[0] is both[0]
    picked = kind.select(kind.read(layer), torch.tensor([2]), 3)  # the short row alone: its 3 columns
    assert all(torch.equal(x, y) for x, y in zip(picked, b, strict=True))
    odd = type("OffloadedLayer", (DynamicLayer,), {})  # a subclass may hold more than keys and values
    with pytest.raises(NotImplementedError, match="OffloadedLayer"):
        cache_rows.kind_of(odd())


def test_sparse_attention_indexer_keys_round_trip() -> None:
    """A DSA layer (DeepSeek-V3.2, GLM-5): keys, values and the indexer's keys (B, T, D) are left-padded,
    concatenated and selected together, the indexer's columns aligned with the keys'."""
    layer = DynamicIndexedLayer()
    kind = cache_rows.kind_of(layer)

    def rows(b: int, t: int, start: float) -> cache_rows.State:
        keys = torch.arange(b * t, dtype=torch.float32).view(b, 1, t, 1).expand(b, 2, t, 4) + start  # (B, H, T, D)
        index = torch.arange(b * t, dtype=torch.float32).view(b, t, 1).expand(b, t, 3) + start  # (B, T, D)
        return [keys, keys + 0.5, index]

    a, b = rows(2, 5, 0.0), rows(1, 3, 100.0)
    both = kind.cat([a, b])
    assert [tuple(x.shape) for x in both] == [(3, 2, 5, 4), (3, 2, 5, 4), (3, 5, 3)]
    assert torch.equal(both[2][2, :2], torch.zeros(2, 3)) and torch.equal(both[2][2, 2:], b[2][0])
    kind.put(layer, both, 5)
    assert layer.is_indexer_initialized and layer.indexer_keys is both[2]
    picked = kind.select(kind.read(layer), torch.tensor([2]), 3)  # the short row alone: its 3 columns
    assert all(torch.equal(x, y) for x, y in zip(picked, b, strict=True))
    with pytest.raises(NotImplementedError, match="DynamicIndexedLayer"):  # positions kept per row: not batched
        indexed = DynamicIndexedLayer()
        indexed.indexer_position_ids = torch.zeros(1, 1, 3)
        cache_rows.kind_of(indexed)


def lora_snapshot(base: LoraBase, seed: int, **flags: bool) -> Any:
    """A LoRA session's frozen adapter (``flags``: its train_* switches) with nonzero B (a fresh adapter changes
    nothing)."""
    session = LoraSession(f"s{seed}", base, types.LoraConfig(rank=2, seed=seed, **flags), base_model="tiny")
    with torch.no_grad():
        for p in session.engine.params:
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + p.numel())), alpha=0.3)
    return session.snapshot()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_lora_rows_equal_their_adapters_forward(family: str) -> None:
    """Rows of two LoRA snapshots and of the base share prefills and decode steps (one pair joining a running
    batch); each row's logprobs equal a plain forward routed to its adapter (linear-attention and Mamba
    projections, MLA's kv_b_proj over the whole latent, fused experts)."""
    model = build_model(family)  # its own: LoraBase hooks and freezes it
    base = LoraBase(model, LogprobComputer(model, "torch"), model_dir="/nonexistent", microbatch_tokens=64)
    adapters = [lora_snapshot(base, seed) for seed in (1, 2)]

    def job(prompt: list[int], adapter: Any, max_tokens: int, seed: int) -> SampleJob:
        made = make_job(model, prompt, 2, max_tokens, key=family, temperature=1.0, seed=seed)
        made.adapter = adapter
        return made

    first = [job(prompt_of(6, 1), adapters[0], 8, 1), job(prompt_of(6, 2), None, 8, 2)]
    shared = prompt_of(11, 3)  # one prompt under two adapters: two prefill rows
    at = {2: [job(shared, adapters[1], 6, 3), job(shared, adapters[0], 5, 4)]}
    late = [j for js in at.values() for j in js]
    schedule = Schedule(at)
    schedule.run(first)

    # The linear-attention MoE families with adapters this large (B at 0.3 on every target at once) are
    # ill-conditioned in float32: the plain forward itself differs by 4.6e-5 between a 9-token prefix and the whole
    # 17 tokens (Qwen3-Next, same adapter); the rows here measured 5.9e-4 at 0.3, 1.3e-5 at 0.1, 1.7e-6 at 0.03, and
    # each train_* flag alone at 0.3 <= 2.6e-6 (a missing or misrouted delta would scale with the adapter, not blow
    # up past a size): rounding amplified, so these two get 1e-3 (docs/families.md).
    atol = 1e-3 if family in ("qwen3_next", "kimi_linear") else ATOL
    for made in first + late:
        seqs, err = schedule.outcomes[id(made)]
        assert err is None, err
        with routing.routed([(made.adapter, slice(0, 1))]) if made.adapter else contextlib.nullcontext():
            assert_matches_forward(model, made, seqs, [], atol=atol)
    with routing.routed([(adapters[0], slice(0, 1))]):  # the adapters really change the rows
        adapted = forward_logprobs(model, shared)
    assert (adapted - forward_logprobs(model, shared)).abs().max() > 1e-3

"""Every MoE causal-LM class of the installed transformers (recipes/moe_classes.py enumerates them), built tiny:
LoRA over attention, MLPs and routed experts and the output projection against the merged-weights reference of
tests/test_families_lora.py, sampling a LoRA snapshot against a plain forward, and a full session's step against
plain torch AdamW. A layout tinkerq cannot adapt is one user error naming the module and what train_mlp=False does.
"""

from __future__ import annotations

import copy
import functools
import re
from typing import Any, cast

import numpy as np
import pytest
import torch

from tests.helpers import make_batch, reference_logprobs, reference_step
from tests.test_families_lora import ADAM, merged_weights, reference_loss
from tests.test_sampling_engine import make_job
from tests.test_sampling_families import assert_matches_forward, lora_snapshot, prompt_of
from tinkerq import types
from tinkerq.errors import ValidationError
from tinkerq.recipes.moe_classes import build_moe_class, built_classes, moe_classes, skipped
from tinkerq.settings import Settings
from tinkerq.worker.loading import support
from tinkerq.worker.lora import routing
from tinkerq.worker.lora.adapter import adaptable, find_targets
from tinkerq.worker.lora.session import LoraBase, LoraSession
from tinkerq.worker.sampling import run_jobs
from tinkerq.worker.sharding.experts import check_expert_parallel
from tinkerq.worker.training.logprobs import LogprobComputer
from tinkerq.worker.training.session import TrainingSession
from tinkerq.worker.training.sessions import SessionFactory

pytestmark = pytest.mark.timeout(120)

# Routed experts in layouts tinkerq refuses (one user error under train_mlp=True), with the module the error names.
REFUSED = {
    "DbrxForCausalLM": "ffn.experts.mlp (DbrxExpertGLU)",  # experts stacked 2-D (E * I, H), no grouped layout
    "DogeForCausalLM": "mlp.down_embed (Embedding)",  # retrieval experts: one embedding row per expert
    "JetMoeForCausalLM": "mlp.input_linear (JetMoeParallelExperts)",  # unmarked, forward(inputs, expert_size)
    "Inkling2LoopForCausalLM": "model.message_input (Inkling2LoopMessageAttentionResidual)",  # a 3-D query
    "LongcatFlashForCausalLM": "mlp.experts (LongcatFlashExperts)",  # zero experts: gate_up E + Z, down E
}


def _served(path: str, names: list[str]) -> list[str]:
    """The classes whose ``path`` worker/loading/support.py serves: each is checked exact below. The others are
    refused at session creation (test_a_refused_path_is_one_user_error_at_creation): no path is served unproven."""
    return [n for n in names if support.refusal(n, path) is None]


LORA = _served("lora", built_classes())  # a layout refused under train_mlp: checked with train_mlp=False
REFUSED_PATHS = sorted((n, path) for (n, path) in support.REFUSED if n in built_classes())


# The layout of experts modules transformers ships without its markers, as their source lays them out: the
# reference below reads markers, the test states them (tinkerq reads the structure and probes it).
_UNMARKED = {"Llama4TextExperts": dict(is_transposed=True, has_gate=True, is_concatenated=True)}


def _lora_flags(name: str, model: torch.nn.Module) -> dict[str, bool]:
    """Every flag on, or, where train_mlp is refused (REFUSED), train_mlp=False with attention where it has some."""
    if name not in REFUSED:
        return {}
    return dict(train_mlp=False, train_attn=any(p.component == "attn" for p in adaptable(model)))


@functools.cache
def _model(name: str) -> Any:
    return build_moe_class(name)


def _marked_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` (its forwards the plain transformers ones) with markers on unmarked experts modules."""
    ref = copy.deepcopy(model)
    for module in ref.modules():
        for key, value in _UNMARKED.get(type(module).__name__, {}).items():
            setattr(module, key, value)
    return ref


def test_every_enumerated_class_is_built_or_skipped_with_a_reason():
    found = moe_classes()
    built, skip = set(built_classes()), skipped()
    assert built | set(skip) == set(found) and not built & set(skip)
    assert all(why for why in skip.values())
    assert set(REFUSED) <= built
    assert {"Llama4ForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM", "DeepseekV3ForCausalLM"} <= built
    assert len(built) >= 50  # transformers 5.24: 61 enumerated, 2 not built yet, 1 vision-language


@pytest.mark.parametrize("name", LORA)
def test_lora_fb_equals_the_merged_weights_reference(name: str) -> None:
    """One rank-2 forward_backward over every target (attention, MLPs, routed and shared experts, output
    projection): loss and every A and B gradient equal the adapter merged into a copy of the model, then a plain
    forward and backward. A class whose experts' layout train_mlp refuses is checked with what it serves:
    train_mlp=False (attention where it has adaptable projections, and the output projection)."""
    model = build_moe_class(name)
    base = LoraBase(model, LogprobComputer(model, "torch"), model_dir="/nonexistent", microbatch_tokens=64)
    flags = _lora_flags(name, model)
    s = LoraSession("s", base, types.LoraConfig(rank=2, seed=3, **flags), base_model="tiny")
    for p in s.engine.params:  # nonzero B, so every adapter changes its rows
        p.data.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())), alpha=0.05)
    if not flags:
        assert any(t.experts for t in s.adapter.targets)  # the routed experts are adapted
        assert {t.component for t in s.adapter.targets} == {"attn", "mlp", "unembed"}
    else:
        assert {t.component for t in s.adapter.targets} == {"unembed"} | ({"attn"} if flags["train_attn"] else set())
    # Data draw 0: with draw 1, Qwen3-MoE's layer-0 k_proj A gradient differs by 8.8e-4 of its largest entry in
    # float32 (draws 0, 2, 3 pass); the same check in float64 (model, session and eager reference experts) passes
    # at this tolerance: float32 rounding amplified there (a near tie in a top-2 routing is the suspect), not logic.
    data = make_batch(np.random.default_rng(0), 2, max_len=9)
    out = s.run_loss(data, "cross_entropy", None, backward=True)

    ours = dict(s.adapter.named_pairs())
    leaves = {n: p.detach().clone().requires_grad_(True) for n, p in ours.items()}
    pairs = {n.removesuffix(".lora_A.weight"): (leaves[n], leaves[n.replace("lora_A", "lora_B")])
             for n in leaves if n.endswith("lora_A.weight")}
    ref = _marked_copy(model)
    loss = reference_loss(ref, merged_weights(ref, pairs, s.config.scaling), data)
    assert out.metrics["loss:sum"] == pytest.approx(float(loss.detach()), rel=1e-5)
    loss.backward()
    for n, p in ours.items():
        # A target whose output reaches the loss only through a non-differentiable top-k (a sparse-attention
        # indexer's projections) gets no gradient in the reference, zeros in the session.
        want = leaves[n].grad if leaves[n].grad is not None else torch.zeros_like(p)
        # float32 sums in another order, through up to 6 layers (Llama-4's tiny model): 2.5e-4 of max|g| measured
        # (Llama-4 layer-5 k_proj A), against 2e-4 over 2-3 layers in tests/test_families_lora.py. On a fresh
        # install of 2026-12-03 (transformers 5.24.0, numpy 2.4.6) Llama-4 measured 5.1e-4 (layer-4 o_proj B) and
        # 1.04e-3 (layer-5 k_proj A), one entry of 64 each, with the code of the day before too; with the model in
        # float64 (its rotary tables stay float32) the largest deviation was 2.8e-6 of max|g|: rounding, not logic.
        scale = max(1e-6, float(want.abs().max()))
        bound = 2e-3 if name == "Llama4ForCausalLM" else 5e-4
        torch.testing.assert_close(p.grad, want, atol=bound * scale, rtol=0, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("name", _served("sampling", built_classes()))
def test_sampled_logprobs_of_a_lora_snapshot_equal_its_forward(name: str) -> None:
    """A LoRA row and a base row of different prompt lengths in the same steps (train_mlp=False where the experts'
    layout is refused): every sampled logprob equals a plain forward (routed to the adapter for its row)."""
    model = build_moe_class(name)
    base = LoraBase(model, LogprobComputer(model, "torch"), model_dir="/nonexistent", microbatch_tokens=64)
    adapter = lora_snapshot(base, seed=5, **_lora_flags(name, model))
    jobs = [make_job(model, prompt_of(5, 1), 1, 4, key=name, temperature=1.0, seed=1),
            make_job(model, prompt_of(7, 2), 1, 4, key=name, temperature=1.0, seed=2)]
    jobs[0].adapter = adapter  # one adapted row and one base row in the same steps
    results = run_jobs(None, jobs, timeout=60)
    with routing.routed([(adapter, slice(0, 1))]):
        assert_matches_forward(model, jobs[0], results[0], [])
    assert_matches_forward(model, jobs[1], results[1], [])


@pytest.mark.parametrize("name", _served("full", built_classes()))
def test_full_session_step_equals_plain_adamw(name: str) -> None:
    model = build_moe_class(name).requires_grad_(True)
    reference = copy.deepcopy(model)
    session = TrainingSession("m", model, base_dir="/nonexistent", microbatch_tokens=64,
                              logprobs=LogprobComputer(model, "torch"), blank_model=lambda: build_moe_class(name))
    opt = torch.optim.AdamW(reference.parameters(), lr=0.0)
    data = make_batch(np.random.default_rng(2), 2, max_len=9)
    out = session.run_loss(data, "cross_entropy", None, backward=True)
    for d, o in zip(data, out.loss_fn_outputs, strict=True):
        with torch.no_grad():
            np.testing.assert_allclose(o["logprobs"].to_numpy(), reference_logprobs(reference, d).numpy(), atol=2e-5)
    norm = reference_step(reference, opt, [data], ADAM)
    assert session.optim_step(ADAM).metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-4)
    for (n, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize(("name", "path"), REFUSED_PATHS)
def test_a_refused_path_is_one_user_error_at_creation(name: str, path: str) -> None:
    """A path support.py refuses is refused by the worker's session factory when the session (or sampler) is
    made, with one user error naming the class, the path, why, and what works instead; nothing is made."""
    model = build_moe_class(name)
    factory = SessionFactory(Settings(), model, "/nonexistent", LogprobComputer(model, "torch"), base_model="tiny",
                             worker_id="w", shards=None, evictable=lambda *_: None)
    what = {"full": "full-parameter training", "lora": "LoRA training", "sampling": "sampling",
            "shard_group": "a shard group", "expert_parallel": "expert parallelism"}[path]
    message = rf"{what} of {name} is not served: .+; .+"
    slots: dict[str, Any] = {}
    with pytest.raises(ValidationError, match=message):
        if path == "sampling":  # checked before the session is looked at
            factory.admit_sampler(cast(Any, None), slots)
        elif path in ("shard_group", "expert_parallel"):  # a shard group's start (worker/sharding/experts.py)
            check_expert_parallel(model, 2)
        else:
            factory.make("m", types.LoraConfig(rank=2) if path == "lora" else None, slots, lambda _: None)
    assert not slots and factory.lora_base is None  # nothing was made


def test_every_path_of_the_lineups_classes_is_served_or_refused_with_a_reason() -> None:
    """The classes every built class maps to in support.py, and the refusals' texts."""
    assert set(built_classes()) <= support.PROVEN
    for (name, path), refusal in support.REFUSED.items():
        assert name in support.PROVEN and path in support.PATHS and refusal.why and refusal.instead
    assert support.refusal("GPT2LMHeadModel", "full") is not None  # a class never proven: refused whole
    for name in ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "InklingForCausalLM", "Inkling2ForCausalLM",
                 "KimiLinearForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "NemotronHForCausalLM"):
        paths = support.served(name)
        assert {p: paths[p] for p in ("full", "lora", "sampling")} == dict.fromkeys(("full", "lora", "sampling"),
                                                                                     "served"), name
        # Inkling-2's and Kimi-Linear's checkpoints are not served on a shard group (a vision-language checkpoint; a
        # streamed load that differed), nor Inkling's shared experts split by expert
        sharded = name not in ("Inkling2ForCausalLM", "KimiLinearForCausalLM")
        assert (paths["shard_group"] == "served") == sharded, name
        assert (paths["expert_parallel"] == "served") == (sharded and name != "InklingForCausalLM"), name
    assert support.served("DeepseekV4ForCausalLM")["lora"] == "served"
    # A class proven on one worker but never on a shard group: refused there, at the group's start.
    with pytest.raises(ValidationError, match=r"a shard group of MixtralForCausalLM is not served: tinkerq has not "
                                              r"proven this class on a shard group .+; serve it on a single worker"):
        check_expert_parallel(build_moe_class("MixtralForCausalLM"), 2)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_layout_tinkerq_cannot_adapt_is_one_user_error_and_train_mlp_false_works(name: str) -> None:
    model = build_moe_class(name)
    message = re.escape(REFUSED[name]) + r" holds fused expert parameters .*train_mlp=False to adapt attention and " \
        r"the output projection only \(these routed experts then stay frozen\)"
    with pytest.raises(ValidationError, match=message):
        find_targets(model, types.LoraConfig(rank=2))
    base = LoraBase(model, LogprobComputer(model, "torch"), model_dir="/nonexistent", microbatch_tokens=64)
    # JetMoe's attention is itself a mixture of experts and LongCat-Flash's MLA has no plain projections tinkerq
    # adapts there: the output projection alone
    attn = not any(isinstance(m, torch.nn.Linear) and "attn" in n for n, m in model.named_modules()) or \
        name in ("JetMoeForCausalLM", "LongcatFlashForCausalLM")
    config = types.LoraConfig(rank=2, seed=1, train_mlp=False, train_attn=not attn)
    s = LoraSession("s", base, config, base_model="tiny")
    assert {t.component for t in s.adapter.targets} == ({"unembed"} if attn else {"attn", "unembed"})
    out = s.run_loss(make_batch(np.random.default_rng(0), 2, max_len=8), "cross_entropy", None, backward=True)
    assert np.isfinite(out.metrics["loss:sum"])


def test_llama4_experts_are_read_from_their_structure_and_a_changed_forward_is_refused() -> None:
    """Llama4TextExperts has no transformers markers: its layout comes from its shapes, checked by a probe of its
    own forward. The same weights behind a forward that computes something else are refused."""
    from tinkerq.worker.lora.experts import layout

    model = build_moe_class("Llama4ForCausalLM")
    experts = next(m for m in model.modules() if type(m).__name__ == "Llama4TextExperts")
    lay = layout(experts, "experts")
    assert (lay.dense, lay.transposed, lay.gated, lay.concatenated) == (True, True, True, True)

    class Swapped(torch.nn.Module):  # [up | gate]: the same shapes, another layout
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.gate_up_proj, self.down_proj, self.act_fn = inner.gate_up_proj, inner.down_proj, inner.act_fn

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            x = hidden_states.view(self.gate_up_proj.shape[0], -1, self.gate_up_proj.shape[1])
            up, gate = torch.bmm(x, self.gate_up_proj).chunk(2, dim=-1)
            return torch.bmm(up * self.act_fn(gate), self.down_proj).view(-1, self.gate_up_proj.shape[1])

    with pytest.raises(ValidationError, match=r"odd \(Swapped\) holds fused expert parameters .*train_mlp=False"):
        layout(Swapped(experts), "odd")


def test_llama4_lora_merged_weights_reload_to_the_sessions_logprobs(tmp_path) -> None:
    """The merged full model of a Llama-4 adapter (its experts' deltas added in their (E, in, out) storage),
    saved and loaded back with plain from_pretrained, gives the session's logprobs."""
    import transformers

    from tinkerq.worker.lora.session import write_merged

    model = build_moe_class("Llama4ForCausalLM")
    base = LoraBase(model, LogprobComputer(model, "torch"), model_dir="/nonexistent", microbatch_tokens=64)
    s = LoraSession("s", base, types.LoraConfig(rank=2, seed=4), base_model="tiny")
    with torch.no_grad():
        for p in s.engine.params:
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())), alpha=0.1)
    write_merged(base.model, s.adapter.frozen(), tmp_path)
    reloaded = transformers.Llama4ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    data = make_batch(np.random.default_rng(3), 2, max_len=9)
    out = s.run_loss(data, "cross_entropy", None, backward=False)
    moved = 0.0
    for d, o in zip(data, out.loss_fn_outputs, strict=True):
        with torch.no_grad():
            want = reference_logprobs(reloaded, d).numpy()
            moved = max(moved, float(np.abs(want - reference_logprobs(model, d).numpy()).max()))
        # x (W + s B A)^T against x W^T + s (x A^T) B^T in float32 over 6 layers, B at 0.1: up to 6.3e-5 measured
        # with products in tiles, 1.2e-4 with the default layout (the reloaded model equals the in-memory merged
        # reference of test_lora_fb_... exactly); a wrong merge is off by the adapter's effect, > 1e-3 (below)
        np.testing.assert_allclose(o["logprobs"].to_numpy(), want, atol=2.5e-4)
    assert moved > 1e-3  # the adapter changed the model


@pytest.mark.parametrize("name", built_classes())
def test_the_fused_loss_head_is_used_only_where_it_gives_the_models_own_logits(name: str) -> None:
    """Where fused_head_support says hidden states @ W^T are the logits, they equal the class's own forward's
    (Inkling divides its hidden states by a muP width multiplier first: that class takes its own forward)."""
    from tinkerq.worker.training.logprobs import fused_head_support

    model = build_moe_class(name)
    tokens = torch.tensor([prompt_of(6, 3)])
    why = fused_head_support(model)
    if why is not None and "backbone" in why:  # Llama-4: the class is its own base_model, its forward is used
        assert LogprobComputer(model, "torch").backend == "model-logits"
        return
    with torch.no_grad():
        own = model(input_ids=tokens).logits.float()
        fused = model.base_model(input_ids=tokens).last_hidden_state @ model.get_output_embeddings().weight.T
    if why is None:
        torch.testing.assert_close(fused, own, atol=1e-5, rtol=1e-5)
    else:
        assert not torch.allclose(fused, own, atol=1e-5)  # the fallback is needed, not merely cautious


def test_deepseek_v4_rows_run_in_lockstep_groups_and_equal_the_forward() -> None:
    """DeepSeek-V4's compressed-attention cache counts its windows once per layer, not per row: each job's rows get a
    group of their own (one prefill, one length; the layer itself expands the prompt's row to the job's samples), two
    jobs of one prompt length and one of another run beside each other, and every sampled logprob equals a plain
    forward, the windows compressing every 2 and 4 tokens."""
    from tinkerq.worker.sampling import cache_rows

    model = build_moe_class("DeepseekV4ForCausalLM")
    assert cache_rows.lockstep(model) and not cache_rows.lockstep(build_moe_class("DeepseekV3ForCausalLM"))
    jobs = [make_job(model, prompt_of(9, 1), 3, 9, key="v4", temperature=1.0, seed=1),
            make_job(model, prompt_of(6, 2), 2, 5, key="v4", temperature=0.0),
            make_job(model, prompt_of(9, 3), 1, 7, key="v4", temperature=1.0, seed=3)]
    results = run_jobs(None, jobs, timeout=120)
    for job, seqs in zip(jobs, results, strict=True):
        assert_matches_forward(model, job, seqs, [])

"""Every model family Tinker users train, in process: full sessions against plain PyTorch, LoRA (dense and
shared-outer expert adapters) against a reference written plainly here, mixed-tenant passes against each tenant
alone, and the user errors of configs a family cannot take.

The models are tiny random ones built from each family's transformers config (tinkerq/recipes/families.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.func import functional_call

from tests.helpers import adamw_step, make_batch, reference_logprobs, reference_step
from tinkerq import types
from tinkerq.errors import ValidationError
from tinkerq.recipes.families import FAMILIES, MOE_FAMILIES, build_family, build_model
from tinkerq.worker.lora.adapter import find_targets, parameters_per_rank
from tinkerq.worker.lora.batch import LossItem, run_pass
from tinkerq.worker.lora.session import LoraBase, LoraSession
from tinkerq.worker.training.logprobs import LogprobComputer
from tinkerq.worker.training.session import TrainingSession

pytestmark = pytest.mark.timeout(120)
ADAM = types.AdamParams(learning_rate=5e-3, weight_decay=0.01, grad_clip_norm=1.0, eps=1e-3)


def lora_base(family: str, seed: int = 0) -> LoraBase:
    model = build_model(family, seed)
    return LoraBase(model, LogprobComputer(model, "torch"), model_dir="/nonexistent", microbatch_tokens=64)


def lora_session(base: LoraBase, seed: int, rank: int = 4, **flags) -> LoraSession:
    s = LoraSession(f"s{seed}", base, types.LoraConfig(rank=rank, seed=seed, **flags), base_model="tiny")
    for p in s.engine.params:  # nonzero B, so every adapter changes its rows from the start
        p.data.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel() + seed)), alpha=0.05)
    return s


def assert_one_pass_equals_each_alone(base: LoraBase, tenants: list[LoraSession], requests: list) -> None:
    """Each tenant's request alone, then all of them in one mixed pass: the same logprobs, loss and gradients."""
    solo = []
    for t, data in zip(tenants, requests, strict=True):
        out = t.run_loss(data, "cross_entropy", None, backward=True)
        solo.append((out, [p.grad.clone() for p in t.engine.params]))
        for p in t.engine.params:
            p.grad.zero_()
    items = [LossItem(t, data, "cross_entropy", None) for t, data in zip(tenants, requests, strict=True)]
    run_pass(items, base.model, base.logprobs, head=base.head, microbatch_tokens=64, device=base.device,
             backward=True)
    for item, t, (out, grads) in zip(items, tenants, solo, strict=True):
        assert item.error is None
        assert item.output.metrics["loss:sum"] == pytest.approx(out.metrics["loss:sum"], rel=1e-5)
        for a, b in zip(out.loss_fn_outputs, item.output.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-5)
        # run_loss (the engine's path) pads to the longest row (11 tokens here), a pass to a bucket (16): products
        # of other shapes, float32 sums in another order, through the whole backward (head, an MoE or MLP layer,
        # attention). The same function: in float64 both agree within 1e-16. In float32 each lies up to ~8e-6 of
        # max|g| from float64 (qwen3_moe's layer-1 q_proj A of the every-target tenant: 3.1e-6 for run_loss, 7.5e-6
        # for the pass), so they differ by up to their sum: 1.06e-5 (qwen3_moe, AVX-512), 1.39e-5 (deepseek_v3's
        # kv_a_proj_with_mqa B, ATEN_CPU_CAPABILITY=avx2). Not bitwise, and not meant to be: 2e-5 of max|g|.
        for g, p in zip(grads, t.engine.params, strict=True):
            assert float((g - p.grad).abs().max()) <= 2e-5 * max(1.0, float(g.abs().max()))


# -- the reference: the adapter merged into the base weights, written out plainly ------------------------------

def merged_weights(model: torch.nn.Module, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
                   scaling: float) -> dict[str, torch.Tensor]:
    """Parameter overrides W + scaling * B @ A, differentiable in A and B.

    A Linear's pair is (A (r, in), B (out, r)). An expert projection's (model.layers.N.mlp.experts.w1|w3|w2) is
    Tinker's shared-outer pair: A (1|E, r, in), B (E|1, out, r), so B @ A broadcasts to (E, out, in). w1 (gate)
    and w3 (up) are the two halves of gate_up_proj, [gate | up] or interleaved g0, u0, g1, u1, ...; an ungated
    expert (up_proj only) has w1 alone. Transposed experts store (E, in, out)."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))  # lm_head.weight of a tied model too
    out: dict[str, torch.Tensor] = {}
    per_experts: dict[str, dict[str, torch.Tensor]] = {}
    sliced: dict[str, list[tuple[int, torch.Tensor]]] = {}  # a fused Linear's parts: (first row, delta)
    for name, (a, b) in pairs.items():
        prefix, _, leaf = name.rpartition(".")  # lm_head has no prefix
        mixer = modules.get(prefix)
        if a.dim() == 2 and leaf in ("in_proj_q", "in_proj_k", "in_proj_v"):  # rows q | k | v of in_proj_qkv
            start = {"in_proj_q": 0, "in_proj_k": mixer.key_dim, "in_proj_v": 2 * mixer.key_dim}[leaf]
            sliced.setdefault(f"{prefix}.in_proj_qkv", []).append((start, scaling * (b @ a)))
        elif a.dim() == 2 and leaf in ("gate_proj", "x_proj") and hasattr(mixer, "ssm_state_size"):  # Mamba
            start = 0 if leaf == "gate_proj" else mixer.intermediate_size  # in_proj rows [gate | x | B C dt]
            sliced.setdefault(f"{prefix}.in_proj", []).append((start, scaling * (b @ a)))
        elif a.dim() == 2:
            out[f"{name}.weight"] = params[f"{name}.weight"] + scaling * (b @ a)
        else:
            module, proj = name.rsplit(".", 1)
            per_experts.setdefault(module, {})[proj] = scaling * torch.matmul(b, a)  # (E, out, in)
    for module_name, pieces in sliced.items():
        weight = params[f"{module_name}.weight"]
        delta = torch.zeros_like(weight)
        for start, d in pieces:
            delta = delta + torch.nn.functional.pad(d, (0, 0, start, weight.shape[0] - start - d.shape[0]))
        out[f"{module_name}.weight"] = weight + delta
    for module_name, deltas in per_experts.items():
        m = modules[module_name]
        # Stacked shared experts (Inkling's) carry no transformers markers: gate_proj and up_proj (E, I, H) apart.
        separate = isinstance(getattr(m, "gate_proj", None), torch.Tensor) and m.gate_proj.dim() == 3
        t = (lambda w: w.transpose(1, 2)) if getattr(m, "is_transposed", False) else (lambda w: w)
        if "w2" in deltas:
            out[f"{module_name}.down_proj"] = m.down_proj + t(deltas["w2"])
        if separate:
            for proj, param in (("w1", "gate_proj"), ("w3", "up_proj")):
                if proj in deltas:
                    out[f"{module_name}.{param}"] = getattr(m, param) + t(deltas[proj])
            continue
        if not m.has_gate:
            if "w1" in deltas:
                out[f"{module_name}.up_proj"] = m.up_proj + t(deltas["w1"])
            continue
        gate = deltas.get("w1", torch.zeros_like(deltas.get("w3", torch.zeros(0))))
        up = deltas.get("w3", torch.zeros_like(gate))
        if gate.numel() == 0:
            continue
        both = torch.cat([gate, up], 1) if m.is_concatenated else torch.stack([gate, up], 2).flatten(1, 2)
        out[f"{module_name}.gate_up_proj"] = m.gate_up_proj + t(both)
    return out


def reference_loss(model, overrides, data) -> torch.Tensor:
    """Tinker's cross_entropy, -sum(weights * logprobs), one unpadded full forward per datum."""
    total = torch.zeros(())
    for d in data:
        tokens = torch.tensor(d.model_input.to_ints())[None]
        targets = torch.tensor(np.asarray(d.loss_fn_inputs["target_tokens"].to_numpy()))
        weights = torch.from_numpy(np.asarray(d.loss_fn_inputs["weights"].to_numpy()))
        # tie_weights=False: an adapted tied output projection leaves the input embedding as it is
        logits = functional_call(model, overrides, (tokens,), tie_weights=False).logits[0].float()  # (N, V)
        lp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
        total = total - (weights * lp).sum()
    return total


# -- full sessions --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_session_steps_equal_plain_pytorch(family):
    """Two fb + optim_step rounds of a full-parameter session equal the same loop in plain PyTorch + AdamW."""
    model = build_model(family).requires_grad_(True)
    reference = build_model(family).requires_grad_(True)
    session = TrainingSession("m", model, base_dir="/nonexistent", microbatch_tokens=64,
                              logprobs=LogprobComputer(model, "torch"), blank_model=lambda: build_model(family))
    opt = torch.optim.AdamW(reference.parameters(), lr=0.0)
    rng = np.random.default_rng(1)
    for _ in range(2):
        data = make_batch(rng, 3, max_len=14)
        out = session.run_loss(data, "cross_entropy", None, backward=True)
        for d, o in zip(data, out.loss_fn_outputs, strict=True):
            with torch.no_grad():
                np.testing.assert_allclose(o["logprobs"].to_numpy(), reference_logprobs(reference, d).numpy(),
                                           atol=2e-5)
        norm = reference_step(reference, opt, [data], ADAM)
        assert session.optim_step(ADAM).metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-4)
    for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, atol=1e-5, rtol=1e-4, msg=name)


# -- LoRA -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_steps_equal_a_plain_shared_outer_reference(family):
    """fb (logprobs, loss, gradients of every A and B) and optim_step of a rank-4 adapter over every target the
    family has equal the merged-weights reference above trained with torch.optim.AdamW."""
    base = lora_base(family)
    s = lora_session(base, seed=7)
    ours = dict(s.adapter.named_pairs())
    leaves = {n: p.detach().clone().requires_grad_(True) for n, p in ours.items()}
    opt = torch.optim.AdamW(leaves.values(), lr=0.0)
    rng = np.random.default_rng(2)
    for _ in range(2):
        data = make_batch(rng, 3, max_len=14)
        out = s.run_loss(data, "cross_entropy", None, backward=True)
        pairs = {n.removesuffix(".lora_A.weight"): (leaves[n], leaves[n.replace("lora_A", "lora_B")])
                 for n in leaves if n.endswith("lora_A.weight")}
        loss = reference_loss(base.model, merged_weights(base.model, pairs, s.config.scaling), data)
        assert out.metrics["loss:sum"] == pytest.approx(float(loss.detach()), rel=1e-5)
        loss.backward()
        for name, p in ours.items():  # float32 sums in another order (x W'^T against x W^T + s (x A^T) B^T)
            scale = max(1e-6, float(leaves[name].grad.abs().max()))
            torch.testing.assert_close(p.grad, leaves[name].grad, atol=2e-4 * scale, rtol=0,
                                       msg=lambda m, name=name: f"{name}: {m}")
        norm = adamw_step(opt, list(leaves.values()), ADAM)
        assert s.optim_step(ADAM).metrics["grad_norm:mean"] == pytest.approx(float(norm), rel=1e-4)
        for name, p in ours.items():
            # Adam divides by sqrt(v) + eps: gradient rounding moves a weight by up to ~1e-3 of the step size
            torch.testing.assert_close(p.detach(), leaves[name].detach(), atol=2e-3 * ADAM.learning_rate, rtol=0,
                                       msg=lambda m, name=name: f"{name}: {m}")
    assert not any(p.requires_grad for p in base.model.parameters())  # the base stays frozen


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_train_mlp_adapts_routed_experts_shared_experts_and_dense_mlps_never_routers(family):
    model = build_model(family)
    targets = find_targets(model, types.LoraConfig(rank=2, train_attn=False, train_unembed=False))
    names = [t.name for t in targets]
    experts = [t for t in targets if t.experts]
    assert experts, names
    for t in experts:  # Tinker's shared-outer shapes
        a, b = t.shapes(2)
        if t.name.endswith(".w2"):
            assert a == (t.experts, 2, t.in_features) and b == (1, t.out_features, 2)
        else:
            assert a == (1, 2, t.in_features) and b == (t.experts, t.out_features, 2)
    routed_layers = {n.rsplit(".experts.", 1)[0] for n in names if ".experts." in n}
    moe_blocks = {n.rsplit(".", 1)[0] for n, m in model.named_modules() if n.endswith(".experts")}
    assert routed_layers == moe_blocks  # every MoE layer's routed experts
    assert not any("router" in n or n.endswith(".gate") or n.endswith("shared_expert_gate") for n in names)
    if family in ("qwen3_moe", "deepseek_v3", "nemotron_h"):  # dense MLP layers beside the MoE ones
        assert any(".experts." not in n and "shared" not in n for n in names), names
    if family in ("qwen3_5_moe", "deepseek_v3", "nemotron_h"):
        assert any("shared_expert" in n for n in names), names


def test_sixteen_tenants_over_two_families_in_mixed_passes_equal_each_alone():
    """Two MoE/hybrid bases, 8 tenants each (ranks and flags mixed): one pass per base gives each tenant the
    outputs and gradients it gets alone, though other tenants' tokens reach the same experts."""
    rng = np.random.default_rng(3)
    flags = [dict(), dict(train_attn=False), dict(train_mlp=False), dict(rank=2)]
    for family in ("qwen3_moe", "nemotron_h"):
        base = lora_base(family)
        tenants = [lora_session(base, seed=50 + i, **{"rank": 4, **flags[i % 4]}) for i in range(8)]
        requests = [make_batch(rng, int(rng.integers(1, 4)), max_len=14) for _ in tenants]
        assert_one_pass_equals_each_alone(base, tenants, requests)


# -- bad input ------------------------------------------------------------------------------------------------

def test_a_config_that_adapts_nothing_is_one_user_error():
    model = build_model("qwen3")  # tied output projection
    with pytest.raises(ValidationError, match="adapts nothing in this model"):
        find_targets(model, types.LoraConfig(rank=2, train_attn=False, train_mlp=False, train_unembed=False))


def test_a_rank_larger_than_a_target_allows_names_the_target():
    with pytest.raises(ValidationError, match=r"rank 20 is larger than .*experts.w1 \(32 -> 16\).*use rank <= 16"):
        find_targets(build_model("qwen3_moe"), types.LoraConfig(rank=20, train_attn=False))


def test_unknown_architecture_is_one_user_error(tmp_path):
    from tinkerq.worker.loading.models import ModelLoadError, load_causal_lm

    build_family("llama", tmp_path)
    config = (tmp_path / "config.json").read_text().replace('"llama"', '"no_such_family"')
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ModelLoadError, match="cannot load"):
        load_causal_lm(str(tmp_path))


def test_parameter_counts_per_rank_cover_every_family():
    """Counts per unit of rank by component: every family has attention and MLP parameters to adapt."""
    for family in FAMILIES:
        counts = parameters_per_rank(find_targets(build_model(family), types.LoraConfig(rank=1)))
        assert counts["attn"] > 0 and counts["mlp"] > 0 and counts["unembed"] > 0, (family, counts)


@pytest.mark.parametrize("name, expected", [
    # Per unit of rank, as tinker-cookbook 0.6.1's hyperparam_utils tabulates them for these checkpoints.
    ("Qwen3-30B-A3B", {"mlp": 14_450_688, "attn": 835_584, "unembed": 153_984}),
    ("gpt-oss-20b", {"mlp": 6_842_880, "attn": 497_664, "unembed": 203_968}),
    ("DeepSeek-V3", {"mlp": 94_307_328, "attn": 2_440_000, "unembed": 136_448}),  # the table's DeepSeek-V3.1
    ("Qwen3.5-35B-A3B", {"mlp": 16_281_600, "attn": 1_013_760, "unembed": 250_368}),
    ("Qwen3.5-9B", {"mlp": 1_572_864, "attn": 1_130_496, "unembed": 252_416}),
])
def test_parameter_counts_per_rank_match_tinker_on_real_shapes(name, expected):
    """Shared-outer experts (H + E * I per projection and rank), shared experts but not their gates, MLA adapted on
    q_a, kv_a and o only, linear attention on in_proj_q/k/v/z and out_proj: the counts of the real checkpoints'
    shapes, built on the meta device, are Tinker's."""
    import transformers

    from tinkerq.recipes.families import REAL_FULL

    _, config_cls, fields = REAL_FULL[name]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_cls)(**fields))
    counts = parameters_per_rank(find_targets(model, types.LoraConfig(rank=1)))
    assert counts == expected


def test_a_checkpoint_asking_for_router_logits_is_served_without_them(tmp_path):
    """An auxiliary load-balancing loss is computed over the whole batch: it would couple tenants' rows."""
    from tinkerq.worker.loading.models import load_causal_lm

    build_family("qwen3_moe", tmp_path, output_router_logits=True, router_aux_loss_coef=0.5)
    assert load_causal_lm(str(tmp_path)).config.output_router_logits is False


def test_a_moe_lora_state_saved_and_loaded_continues_exactly(tmp_path):
    base = lora_base("gpt_oss")
    s = lora_session(base, seed=9)
    rng = np.random.default_rng(6)
    batches = [make_batch(rng, 2, max_len=14) for _ in range(3)]
    s.run_loss(batches[0], "cross_entropy", None, backward=True)
    s.optim_step(ADAM)
    s.run_loss(batches[1], "cross_entropy", None, backward=True)  # pending gradients travel too
    path = s.save_state(str(tmp_path), "mid", base_model="tiny", seq_id=3)
    resumed = LoraSession("r", base, s.config, base_model="tiny")
    resumed.load_state(Path(path))
    for session in (s, resumed):
        session.optim_step(ADAM)
        session.run_loss(batches[2], "cross_entropy", None, backward=True)
        session.optim_step(ADAM)
    for p, q in zip(s.engine.params, resumed.engine.params, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tenants_of_every_flag_in_one_pass_equal_each_alone(family):
    """Four tenants (attention only, MLP only, output projection only, all of them) in one mixed pass: each
    request's logprobs, loss and gradients equal the same request alone."""
    base = lora_base(family)
    flags = [dict(train_mlp=False, train_unembed=False), dict(train_attn=False, train_unembed=False),
             dict(train_attn=False, train_mlp=False), dict()]
    tenants = [lora_session(base, seed=70 + i, **f) for i, f in enumerate(flags)]
    rng = np.random.default_rng(9)
    requests = [make_batch(rng, 2, max_len=12) for _ in tenants]
    assert_one_pass_equals_each_alone(base, tenants, requests)


def test_experts_in_a_layout_tinkerq_does_not_know_are_one_user_error_naming_them():
    class OddExperts(torch.nn.Module):  # fused 3-D expert weights without transformers' layout markers
        def __init__(self) -> None:
            super().__init__()
            self.w_in = torch.nn.Parameter(torch.zeros(4, 8, 16))

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = OddExperts()

    model = build_model("llama")
    model.model.layers[0].mlp = Block()
    with pytest.raises(ValidationError, match=r"mlp.experts \(OddExperts\) holds fused expert parameters .*"
                                              r"w_in \(4, 8, 16\).*train_mlp=False"):
        find_targets(model, types.LoraConfig(rank=2))
    assert find_targets(model, types.LoraConfig(rank=2, train_mlp=False))  # the way out the message gives


def test_a_linear_attention_output_as_wide_as_its_fused_input_stays_one_target():
    """When hidden = 2 key_dim + value_dim, out_proj has in_proj_qkv's output width: only the projection from the
    hidden state is cut into q/k/v parts, and a LoRA step runs."""
    model = build_model("qwen3_5", hidden_size=64, head_dim=16)  # key_dim 16, value_dim 32: 2 * 16 + 32 = 64
    prefix = "model.layers.0.linear_attn"
    names = [t.name for t in find_targets(model, types.LoraConfig(rank=2)) if t.name.startswith(prefix)]
    assert names == [f"{prefix}.{p}" for p in ("out_proj", "in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z")]
    base = LoraBase(model, LogprobComputer(model, "torch"), model_dir="/nonexistent", microbatch_tokens=64)
    out = lora_session(base, seed=1).run_loss(make_batch(np.random.default_rng(0), 2, max_len=10), "cross_entropy",
                                              None, backward=True)
    assert np.isfinite(out.metrics["loss:sum"])


@pytest.mark.parametrize("width", [3, 8])  # 3 floats: rows not 16-byte aligned, the loop; 8: grouped_mm
def test_grouped_linear_equals_one_matmul_per_group_values_and_gradients(width):
    from tinkerq.worker.lora.experts import grouped_linear

    gen = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 1]  # an empty group too
    x = torch.randn(9, width, generator=gen, requires_grad=True)
    w = torch.randn(4, 6, width, generator=gen, requires_grad=True)  # (G, out, in)
    out = grouped_linear(x, w, counts)
    expected = torch.cat([x[0:3] @ w[0].T, x[3:8] @ w[2].T, x[8:9] @ w[3].T])
    torch.testing.assert_close(out, expected)
    grad = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, (x, w), grad)
    want_sum = torch.autograd.grad(expected, w, torch.ones_like(expected), retain_graph=True)[0]
    want = torch.autograd.grad(expected, (x, w), grad)
    for g, h in zip(got, want, strict=True):
        torch.testing.assert_close(g, h)
    grouped_linear(x, w, counts).sum().backward()  # a broadcast gradient (grouped_mm's needs it made contiguous)
    torch.testing.assert_close(w.grad, want_sum)

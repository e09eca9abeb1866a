"""LoRA sessions in process, against PEFT + torch.optim.AdamW as the oracle (docs/lora.md).

The worker-level behaviour (mixed passes of many tenants through a real worker, save/load, sampling) is in
tests/test_lora_fleet.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tests.helpers import LiveTensorBytes, adamw_step, build_tiny_llama, make_batch, reference_logprobs, rl_batch
from tinkerq import types
from tinkerq.errors import NonFiniteError, ValidationError
from tinkerq.validation import validate_lora
from tinkerq.worker import memory
from tinkerq.worker.lora.adapter import find_targets, parameters_per_rank
from tinkerq.worker.lora.batch import LossItem, run_pass
from tinkerq.worker.lora.session import LoraBase, LoraSession, write_merged
from tinkerq.worker.training.logprobs import LogprobComputer

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(300)
ADAM = types.AdamParams(learning_rate=1e-2, weight_decay=0.0)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model_dir(request, tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("lora") / "m", seed=3, tied=request.param)


def load(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture
def base(model_dir):
    model = load(model_dir)
    return LoraBase(model, LogprobComputer(model, "torch"), model_dir=str(model_dir), microbatch_tokens=64)


def session(base, seed=1, rank=4, **flags) -> LoraSession:
    return LoraSession(f"s{seed}", base, types.LoraConfig(rank=rank, seed=seed, **flags), base_model="tiny")


def peft_model(model_dir, adapter_dir):
    model = peft.PeftModel.from_pretrained(load(model_dir), str(adapter_dir), is_trainable=True)
    model.eval()  # no dropout anyway (lora_dropout 0); eval like our base
    return model


def lora_params(model) -> dict[str, torch.nn.Parameter]:
    """PEFT's trainable parameters by our names (its keys without the adapter name)."""
    return {n.removeprefix("base_model.model.").replace(".default", ""): p
            for n, p in model.named_parameters() if p.requires_grad}


def ce_loss(model, data) -> torch.Tensor:
    """Tinker's cross_entropy: -sum(weights * logprobs) over every datum."""
    total = torch.zeros(())
    for d in data:
        w = torch.from_numpy(np.asarray(d.loss_fn_inputs["weights"].to_numpy()))
        total = total - (w * reference_logprobs(model, d)).sum()
    return total


# -- configuration ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, attn, mlp, unembed", [
    ("llama-3.2-1b", 212_992, 491_520, 130_304),
    ("llama-3.1-8b", 851_968, 1_769_472, 132_352),
])
def test_parameter_counts_per_rank_match_tinker(name, attn, mlp, unembed):
    """The table in lora-notes.md (tinker-cookbook's hyperparam_utils), from models built on the meta device."""
    shapes = {"llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                   tie_word_embeddings=True),
              "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)}[name]
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**shapes))
    counts = parameters_per_rank(find_targets(model, types.LoraConfig()))
    assert counts == {"attn": attn, "mlp": mlp, "unembed": unembed}
    no_attn = parameters_per_rank(find_targets(model, types.LoraConfig(train_attn=False)))
    assert no_attn == {"attn": 0, "mlp": mlp, "unembed": unembed}


@pytest.mark.parametrize("config, message", [
    (types.LoraConfig(rank=0), "rank must be an integer from 1"),
    (types.LoraConfig(rank=512), "rank must be an integer from 1"),
    (types.LoraConfig(rank=True), "rank must be an integer"),
    (types.LoraConfig(seed=-1), "seed must be None or an integer"),
    (types.LoraConfig(train_mlp="yes"), "train_mlp must be True or False"),
    (types.LoraConfig(train_mlp=False, train_attn=False, train_unembed=False), "at least one of"),
])
def test_bad_configurations_are_user_errors(config, message):
    with pytest.raises(ValidationError, match=message):
        validate_lora(config, max_rank=256)


def test_a_new_adapter_leaves_the_model_unchanged_and_the_seed_fixes_it(base, model_dir):
    data = make_batch(np.random.default_rng(0), 4)
    reference = load(model_dir)
    s = session(base, seed=7)
    out = s.run_loss(data, "cross_entropy", None, backward=False)
    for d, o in zip(data, out.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(o["logprobs"].to_numpy(), reference_logprobs(reference, d).detach().numpy(),
                                   rtol=0, atol=1e-6)
    again, other = session(base, seed=7), session(base, seed=8)
    for (n, p), (_, q), (_, r) in zip(s.adapter.named_pairs(), again.adapter.named_pairs(),
                                      other.adapter.named_pairs(), strict=True):
        assert torch.equal(p, q)
        if n.endswith("lora_B.weight"):
            assert not p.any()
        else:  # PEFT's kaiming-uniform(a=sqrt(5)): U(+-1/sqrt(in))
            assert not torch.equal(p, r) and p.abs().max() <= 1 / math.sqrt(p.shape[1])


# -- the oracle ------------------------------------------------------------------------------------------


def test_training_equals_peft_with_adamw(base, model_dir, tmp_path):
    """fb + optim_step, 3 steps (cross_entropy, varied lengths and weights, clipping, weight decay) equal a
    PeftModel loaded from the adapter we export at creation, trained with torch.optim.AdamW."""
    s = session(base, seed=11)
    exported = s.save_weights(str(tmp_path), "init", base_model=str(model_dir))
    oracle = peft_model(model_dir, exported)
    params = lora_params(oracle)
    ours = dict(s.adapter.named_pairs())
    assert set(params) == set(ours)
    opt = torch.optim.AdamW(params.values(), lr=0.0, weight_decay=0.0)
    # eps above float32 noise: with 1e-12 Adam turns the rounding of a near-zero gradient into a full step, and
    # the two trajectories part after a step or two (the gradients themselves agree to ~4e-7 of their scale)
    adam = types.AdamParams(learning_rate=2e-2, weight_decay=0.1, grad_clip_norm=0.5, eps=1e-3)
    rng = np.random.default_rng(1)
    for _ in range(3):
        batches = [make_batch(rng, 3), make_batch(rng, 2)]  # accumulated over two calls
        for data in batches:
            item = LossItem(s, data, "cross_entropy", None)
            run_pass([item], base.model, base.logprobs, head=base.head, microbatch_tokens=64,
                     device=base.device, backward=True)
            assert item.error is None
            loss = ce_loss(oracle, data)
            np.testing.assert_allclose(item.output.metrics["loss:sum"], float(loss.detach()), rtol=1e-5)
            loss.backward()
        for name, p in params.items():  # the accumulated gradients
            scale = float(p.grad.abs().max())
            torch.testing.assert_close(ours[name].grad, p.grad, rtol=1e-4, atol=1e-4 * scale + 1e-12)
        norm = adamw_step(opt, list(params.values()), adam)
        metrics = s.optim_step(adam).metrics
        assert metrics["grad_norm:mean"] == pytest.approx(float(norm), rel=1e-5)
        for name, p in params.items():
            torch.testing.assert_close(ours[name].detach(), p.detach(), rtol=1e-4, atol=2e-4 * adam.learning_rate)
    assert any(ours[n].abs().max() > 0 for n in ours if n.endswith("lora_B.weight"))  # it did train


def test_export_round_trip_to_peft_and_merged(base, model_dir, tmp_path):
    """save_weights_for_sampler's PEFT directory (and the merged model) give our logprobs."""
    s = session(base, seed=2)
    for p in s.engine.params:  # a trained-looking adapter: B nonzero
        p.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    data = make_batch(np.random.default_rng(2), 3)
    ours = s.run_loss(data, "cross_entropy", None, backward=False)
    with LiveTensorBytes() as live:  # what it allocated stays within the admitted figure (one module in float32)
        path = s.save_weights(str(tmp_path), "trained", base_model=str(model_dir), merged=True)
    admitted = memory.merged_save_bytes(memory.ModelShape.of(base.model), s.num_parameters(), whole_base=False)
    print(f"\nmerged save: peak {live.peak:,} B of new tensors, admitted {admitted:,} B")
    assert live.peak <= admitted
    oracle = peft_model(model_dir, path)
    merged = load(f"{path}/merged")
    for d, o in zip(data, ours.loss_fn_outputs, strict=True):
        for other in (oracle, merged):
            np.testing.assert_allclose(reference_logprobs(other, d).detach().numpy(), o["logprobs"].to_numpy(),
                                       rtol=1e-5, atol=1e-5)
    if AutoConfig.from_pretrained(model_dir).tie_word_embeddings:  # the input embedding kept the base's
        assert not merged.config.tie_word_embeddings
        torch.testing.assert_close(merged.get_input_embeddings().weight, base.model.get_input_embeddings().weight)


# -- many tenants in one pass ---------------------------------------------------------------------------------


def _grads(s):
    return [p.grad.clone() for p in s.engine.params]


def clone(base, s) -> LoraSession:
    """Another session with ``s``'s configuration, weights and pending gradients (sessions are not deep-copied:
    their forward is bound to their own adapter)."""
    c = s.config
    other = session(base, seed=c.seed, rank=c.rank, train_attn=c.train_attn, train_mlp=c.train_mlp,
                    train_unembed=c.train_unembed)
    with torch.no_grad():
        for p, q in zip(other.engine.params, s.engine.params, strict=True):
            p.copy_(q)
            p.grad.copy_(q.grad)
    return other


def test_sixteen_tenants_in_one_pass_equal_each_alone(base):
    """Mixed losses (cross_entropy and RL), adapters of different ranks and targets: each request's outputs,
    metrics and gradients equal the same request alone."""
    rng = np.random.default_rng(5)
    flags = [dict(), dict(train_attn=False), dict(train_mlp=False, train_unembed=False), dict(rank=2)]
    tenants = [session(base, seed=100 + i, **{"rank": 4, **flags[i % 4]}) for i in range(16)]
    for t in tenants:  # nonzero B, so every adapter changes its rows
        for p in t.engine.params:
            p.data.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel() + t.config.seed)),
                        alpha=0.02)
    reference = load_reference_for(base)
    requests = []
    for i in range(16):
        if i % 3 == 2:
            data = [types.Datum(model_input=mi, loss_fn_inputs=inputs) for mi, inputs, _ in rl_batch(reference, rng)]
            requests.append((data, "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}))
        else:
            requests.append((make_batch(rng, int(rng.integers(1, 4))), "cross_entropy", None))
    alone = [clone(base, t) for t in tenants]  # the starting point, for the solo runs
    items = [LossItem(t, data, fn, cfg) for t, (data, fn, cfg) in zip(tenants, requests, strict=True)]
    run_pass(items, base.model, base.logprobs, head=base.head, microbatch_tokens=64, device=base.device,
             backward=True)
    mixed_grads = [_grads(t) for t in tenants]
    for solo, item, grads in zip(alone, items, mixed_grads, strict=True):
        assert item.error is None
        out = solo.run_loss(item.data, item.loss_fn, item.config, backward=True)
        assert out.metrics.keys() == item.output.metrics.keys()
        for key, value in out.metrics.items():
            assert item.output.metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
        for a, b in zip(out.loss_fn_outputs, item.output.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), rtol=1e-6, atol=1e-6)
        # Gradients: within 1e-5 of their scale. Rows pad to another length and micro-batches split elsewhere in
        # a mixed pass, so float32 sums run in another order (measured: up to ~2e-6).
        for g, h in zip(_grads(solo), grads, strict=True):
            assert float((g - h).abs().max()) <= 1e-5 * max(1.0, float(g.abs().max())), float((g - h).abs().max())


def load_reference_for(base):
    return base.model  # the frozen base (adapters inactive outside a routed pass)


def test_a_non_finite_request_fails_alone_and_changes_nothing(base):
    rng = np.random.default_rng(6)
    good, bad_loss, bad_grad = session(base, seed=1), session(base, seed=2), session(base, seed=3)
    first = make_batch(rng, 2)
    for s in (good, bad_loss, bad_grad):  # some pending gradients already
        s.run_loss(first, "cross_entropy", None, backward=True)
    before = {id(s): _grads(s) for s in (good, bad_loss, bad_grad)}
    poisoned = make_batch(rng, 2)
    poisoned[1].loss_fn_inputs["weights"] = types.TensorData.from_numpy(
        np.full(poisoned[1].model_input.length, np.inf, np.float32))
    with torch.no_grad():  # finite loss, but B so large the backward overflows
        bad_grad.adapter.b[next(iter(bad_grad.adapter.b))].fill_(3e38)
    data = make_batch(rng, 3)
    items = [LossItem(good, data, "cross_entropy", None), LossItem(bad_loss, poisoned, "cross_entropy", None),
             LossItem(bad_grad, make_batch(rng, 2), "cross_entropy", None)]
    expected = clone(base, good)
    expected_out = expected.run_loss(data, "cross_entropy", None, backward=True)
    run_pass(items, base.model, base.logprobs, head=base.head, microbatch_tokens=64, device=base.device,
             backward=True)
    assert items[0].error is None
    assert isinstance(items[1].error, NonFiniteError) and "nothing was applied" in items[1].error.message
    assert isinstance(items[2].error, NonFiniteError)
    for s in (bad_loss, bad_grad):
        for g, h in zip(_grads(s), before[id(s)], strict=True):
            assert torch.equal(g, h)
    for g, h in zip(_grads(good), _grads(expected), strict=True):
        torch.testing.assert_close(g, h, rtol=1e-6, atol=1e-6)
    assert items[0].output.metrics["loss:sum"] == pytest.approx(expected_out.metrics["loss:sum"], rel=1e-6)


def test_optim_step_touches_only_its_own_adapter_and_never_the_base(base):
    rng = np.random.default_rng(7)
    a, b = session(base, seed=1), session(base, seed=2)
    base_before = {n: p.detach().clone() for n, p in base.model.named_parameters()}
    assert not any(p.requires_grad for p in base.model.parameters())
    for s in (a, b):
        s.run_loss(make_batch(rng, 2), "cross_entropy", None, backward=True)
    b.optim_step(ADAM)  # b has AdamW moments now
    b.run_loss(make_batch(rng, 2), "cross_entropy", None, backward=True)
    b_state = [(p.detach().clone(), p.grad.clone(), {k: v.clone() for k, v in b.engine.optimizer.state[p].items()})
               for p in b.engine.params]
    a.optim_step(types.AdamParams(learning_rate=0.1, weight_decay=0.5, grad_clip_norm=1.0))
    for p, (w, g, st) in zip(b.engine.params, b_state, strict=True):
        assert torch.equal(p, w) and torch.equal(p.grad, g)
        assert all(torch.equal(v, st[k]) for k, v in b.engine.optimizer.state[p].items())
    assert a.steps == 1 and b.steps == 1
    for n, p in base.model.named_parameters():
        assert torch.equal(p, base_before[n]) and p.grad is None


def test_accumulating_over_calls_equals_one_call(base):
    rng = np.random.default_rng(8)
    d1, d2 = make_batch(rng, 2), make_batch(rng, 3)
    split, whole = session(base, seed=4), session(base, seed=4)
    for s in (split, whole):
        with torch.no_grad():
            for p in s.engine.params:
                p.add_(0.01)
    split.run_loss(d1, "cross_entropy", None, backward=True)
    split.run_loss(d2, "cross_entropy", None, backward=True)
    whole.run_loss(d1 + d2, "cross_entropy", None, backward=True)
    for g, h in zip(_grads(split), _grads(whole), strict=True):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-6)  # micro-batch boundaries move: sums reorder


def test_save_and_load_state_resume_exactly(base, tmp_path):
    rng = np.random.default_rng(9)
    batches = [make_batch(rng, 2) for _ in range(4)]
    s = session(base, seed=5)
    for data in batches[:2]:
        s.run_loss(data, "cross_entropy", None, backward=True)
        s.optim_step(ADAM)
    s.run_loss(batches[2], "cross_entropy", None, backward=True)  # pending gradients travel too
    path = s.save_state(str(tmp_path), "mid", base_model="tiny", seq_id=7)
    other = session(base, seed=99)  # another initial adapter, loaded over
    meta = other.load_state(__import__("pathlib").Path(path))
    assert meta["optimizer_steps"] == 2 and meta["seq_id"] == 7 and meta["lora"]["seed"] == 5
    for t in (s, other):
        t.optim_step(ADAM)
        t.run_loss(batches[3], "cross_entropy", None, backward=True)
        t.optim_step(ADAM)
    for p, q in zip(s.engine.params, other.engine.params, strict=True):
        assert torch.equal(p, q)


def test_states_of_another_kind_or_base_are_refused(base, tmp_path):
    from pathlib import Path

    s = session(base, seed=5)
    path = Path(s.save_state(str(tmp_path), "x", base_model="tiny", seq_id=1))
    with pytest.raises(ValidationError, match="LoRA adapter with rank=4"):
        session(base, seed=5, rank=8).load_state(path)
    with pytest.raises(ValidationError, match="saved from base model 'tiny'"):
        LoraSession("y", base, types.LoraConfig(rank=4, seed=5), base_model="other").load_state(path)
    from tinkerq.worker import checkpoints

    with pytest.raises(ValidationError, match="cannot load into a full-parameter session"):
        checkpoints.check_state(path, {})


def test_merged_export_of_a_tied_model_keeps_the_input_embedding(tmp_path):
    model_dir = build_tiny_llama(tmp_path / "tied", seed=4, tied=True)
    model = load(model_dir)
    b = LoraBase(model, LogprobComputer(model, "torch"), model_dir=str(model_dir), microbatch_tokens=64)
    s = session(b, seed=3, train_attn=False, train_mlp=False)  # the output projection only
    with torch.no_grad():
        s.adapter.b[next(iter(s.adapter.b))].normal_(0, 0.1)
    write_merged(model, s.adapter.frozen(), tmp_path / "merged")
    merged = load(tmp_path / "merged")
    torch.testing.assert_close(merged.get_input_embeddings().weight, model.get_input_embeddings().weight)
    assert not torch.equal(merged.get_output_embeddings().weight, model.get_output_embeddings().weight)
    assert model.config.tie_word_embeddings  # the shared base is as it was


# -- sampling ---------------------------------------------------------------------------------------------------


def test_rows_of_different_adapters_share_a_decode_batch_and_equal_each_merged_model(base, tmp_path):
    """Three adapters and the base itself in one engine batch (same prompt too): each row's tokens and logprobs
    equal sampling that adapter's merged model alone."""
    from tinkerq.worker.sampling import SampleJob, StopRule, TorchEngine, run_jobs

    adapters = []
    for seed in (1, 2, 3):
        s = session(base, seed=seed, train_mlp=seed != 2)
        with torch.no_grad():
            for p in s.engine.params:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + p.numel())), alpha=0.3)
        adapters.append(s.adapter.frozen())
    prompt = [5, 9, 2, 7]

    def job(model, adapter, seed, key):
        return SampleJob(model=model, model_key=key, prompt=prompt, num_samples=2,
                         params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=seed),
                         stop=StopRule(None, [], None), max_tokens=6, adapter=adapter)

    engine = TorchEngine()
    try:
        mixed = run_jobs(engine, [job(base.model, a, 10 + i, "base") for i, a in enumerate([*adapters, None])],
                         timeout=60)
        assert engine.steps <= 7  # one prefill + decode steps for all four jobs together, not four runs
    finally:
        engine.close()
    for i, adapter in enumerate([*adapters, None]):
        if adapter is None:
            alone_model = base.model
        else:
            write_merged(base.model, adapter, tmp_path / f"m{i}")
            alone_model = load(tmp_path / f"m{i}")
        (alone,) = run_jobs(None, [job(alone_model, None, 10 + i, "solo")], timeout=60)
        for a, b in zip(mixed[i], alone, strict=True):
            assert a.tokens == b.tokens
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)


def test_a_full_adapter_capacity_is_refused_with_the_fix(base):
    from tinkerq.errors import CapacityError
    from tinkerq.settings import Settings
    from tinkerq.worker import memory

    tight = Settings(memory_limit_mb=1)  # the worker process alone is far above 1 MiB
    with pytest.raises(CapacityError, match=r"a new LoRA adapter .* use a lower rank"):
        memory.admit_lora_session(10_000_000, tight, [session(base)])


def test_a_forward_only_pass_equals_each_alone_and_leaves_gradients(base):
    rng = np.random.default_rng(12)
    tenants = [session(base, seed=20 + i) for i in range(3)]
    for t in tenants:
        with torch.no_grad():
            for p in t.engine.params:
                p.add_(0.02)
        t.run_loss(make_batch(rng, 1), "cross_entropy", None, backward=True)  # pending gradients
    before = [_grads(t) for t in tenants]
    items = [LossItem(t, make_batch(rng, 2), "cross_entropy", None) for t in tenants]
    run_pass(items, base.model, base.logprobs, head=base.head, microbatch_tokens=64, device=base.device,
             backward=False)
    for t, item, grads in zip(tenants, items, before, strict=True):
        alone = t.run_loss(item.data, "cross_entropy", None, backward=False)
        assert item.output.metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], rel=1e-6)
        assert all(torch.equal(g, h) for g, h in zip(_grads(t), grads, strict=True))

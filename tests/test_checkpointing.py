"""Activation checkpointing per decoder layer (worker/training/checkpointing.py): a training forward with it gives
bitwise the logprobs, losses and gradients of one without it (float32, CPU), for full sessions and for mixed LoRA
passes of several tenants (their routing restored around each layer's recomputation), on dense and MoE models; it
saves less for the backward, within the estimate (worker/memory/estimates.py); and the worker chooses it per
request (``TINKERQ_ACTIVATION_CHECKPOINTING``: auto, on, off)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import start_named_worker
from tests.helpers import make_batch, peak_rss_growth
from tests.test_lora_invariance import TENANTS, assert_bitwise, lora_base, requests, run, tenants
from tinkerq.recipes.families import build_model
from tinkerq.worker import memory
from tinkerq.worker.training import checkpointing
from tinkerq.worker.training.logprobs import LogprobComputer
from tinkerq.worker.training.sessions import TrainingSession

pytestmark = pytest.mark.timeout(180)


class _Recomputations:
    """Counts the calls of every decoder layer's attention: twice per layer and micro-batch when checkpointed."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        from tinkerq.worker.loading.layers import decoder_layers

        for layer in decoder_layers(model):
            layer.self_attn.register_forward_pre_hook(self._count)

    def _count(self, *_: object) -> None:
        self.calls += 1


def _full_session(name: str) -> TrainingSession:
    model = build_model(name, 0)
    checkpointing.install(model)
    return TrainingSession("m", copy.deepcopy(model), base_dir="/nonexistent", microbatch_tokens=64,
                           logprobs=LogprobComputer(model, "torch"), blank_model=lambda: copy.deepcopy(model))


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "deepseek_v3"])
def test_a_full_session_trains_bitwise_with_checkpointing(name):
    """forward_backward over variable-length, weighted datums in several micro-batches, then AdamW steps: the same
    outputs, gradients and weights with checkpointing as without, and the layers did run twice."""
    sessions = {on: _full_session(name) for on in (False, True)}
    counter = _Recomputations(sessions[True].model)
    counted = _Recomputations(sessions[False].model)
    rng = np.random.default_rng(0)
    from tinkerq import types

    adam = types.AdamParams(learning_rate=1e-2, eps=1e-12)
    for _ in range(2):
        data = make_batch(rng, 5, min_len=3, max_len=40)
        outs = {on: s.run_loss(data, "cross_entropy", None, backward=True, checkpointing=on)
                for on, s in sessions.items()}
        assert outs[True].metrics == outs[False].metrics
        for a, b in zip(outs[True].loss_fn_outputs, outs[False].loss_fn_outputs, strict=True):
            assert np.array_equal(a["logprobs"].to_numpy(), b["logprobs"].to_numpy())
        for g, h in zip(sessions[True].engine.grads(), sessions[False].engine.grads(), strict=True):
            assert torch.equal(g, h), float((g - h).abs().max())
        for s in sessions.values():
            s.optim_step(adam)
    for p, q in zip(sessions[True].engine.params, sessions[False].engine.params, strict=True):
        assert torch.equal(p, q)
    assert counter.calls == 2 * counted.calls > 0


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "gpt_oss"])
def test_a_mixed_lora_pass_is_bitwise_with_checkpointing(name):
    """Four tenants of different ranks, targets and losses in one pass: each one's outputs and adapter gradients
    with checkpointing equal those without (the recomputation routes each row to its own adapter again)."""
    base = lora_base(name)
    checkpointing.install(base.model)
    sessions = tenants(base)
    counter = _Recomputations(base.model)
    data = requests(3)
    plain = run(base, sessions, data, backward=True)
    without = counter.calls
    checked = run(base, sessions, data, backward=True, checkpointing=True)
    assert counter.calls == 3 * without  # the forward, and again in the backward
    for a, b in zip(checked, plain, strict=True):
        assert_bitwise(a, b)
    assert len(checked) == len(TENANTS)


def test_checkpointing_is_off_without_gradients_or_outside_its_block():
    """A forward-only request and sampling never checkpoint (nothing is saved for a backward anyway)."""
    model = build_model("llama", 0)
    checkpointing.install(model)
    counter = _Recomputations(model)
    ids = torch.randint(0, 101, (2, 9))
    with checkpointing.enabled(), torch.no_grad():
        model(input_ids=ids)
    model(input_ids=ids).logits.sum().backward()
    assert counter.calls == 2 * checkpointing.install(model)


# -- memory: the estimate, the measured peak, the worker's choice ---------------------------------------------------


def _llama(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=768, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).eval()
    checkpointing.install(model)
    return model


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak RSS reset")
def test_checkpointing_lowers_the_peak_and_the_estimate_covers_it():
    """An 8-layer model's forward_backward of 8 x 400 tokens: with its layers checkpointed the peak RSS is well below
    the peak without, and under the checkpointed estimate (worker/memory/estimates.py), as the plain one covers
    the plain peak."""
    model = _llama(8)
    shape = memory.ModelShape.of(model)
    session = TrainingSession("m", copy.deepcopy(model), base_dir="/nonexistent", microbatch_tokens=16384,
                              logprobs=LogprobComputer(model, "torch"), blank_model=lambda: copy.deepcopy(model))
    data = make_batch(np.random.default_rng(4), 8, min_len=380, max_len=400)
    lengths = [d.model_input.length for d in data]
    session.run_loss(data[:2], "cross_entropy", None, backward=True, checkpointing=True)  # first-call allocations
    session.run_loss(data[:2], "cross_entropy", None, backward=True)
    rows = {}
    for on in (True, False):
        peak = peak_rss_growth(lambda c=on: session.run_loss(data, "cross_entropy", None, backward=True,
                                                              checkpointing=c))
        est = memory.batch_bytes(shape, lengths, microbatch_tokens=16384, backward=True,
                                 chunk_tokens=session.logprobs.chunk_tokens, checkpointing=on)
        rows[on] = (peak, est)
        print(f"\ncheckpointing {'on' if on else 'off'}: peak RSS +{peak / 2**20:.1f} MiB, estimated "
              f"{est / 2**20:.1f} MiB ({est / peak:.2f}x)")
    for peak, est in rows.values():
        assert peak <= est
    assert rows[True][0] < 0.6 * rows[False][0]  # it saves memory, as the estimates say it does
    assert rows[True][1] < 0.6 * rows[False][1]


# Families whose layers keep different things: dense, MoE, MLA (its probabilities materialised), eager attention with
# sinks, a gated-delta-rule hybrid, a Mamba hybrid, sliding windows.
LIVE_FAMILIES = ("llama", "qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_5", "qwen3_5_moe", "nemotron_h", "gemma3")


@pytest.mark.parametrize("family", LIVE_FAMILIES)
def test_the_device_estimate_covers_each_familys_live_peak(family):
    """What `tinkerq plan` counts for a batch's activations on a GPU (``activation_bytes(device_type="cuda")``: live
    tensors, no CPU heap) covers the peak of live tensor bytes (tests.helpers.LiveTensorBytes, what
    ``torch.cuda.max_memory_allocated`` counts) of a LoRA tenant's forward_backward, checkpointed and not, on batches of
    long and short rows (a linear attention pads each row to whole 64-token chunks)."""
    from tests.helpers import LiveTensorBytes
    from tinkerq import types
    from tinkerq.worker.lora.batch import LossItem
    from tinkerq.worker.lora.session import LoraBase, LoraSession

    torch.set_num_threads(1)
    model = build_model(family, 0).float()
    shape = memory.ModelShape.of(model)
    rng = np.random.default_rng(7)
    for rows, length in ((4, 128), (8, 32), (1, 512)):
        for on in (True, False):
            copied = copy.deepcopy(model)
            checkpointing.install(copied)
            base = LoraBase(copied, LogprobComputer(model, device="cpu"), model_dir="/nonexistent",
                            microbatch_tokens=rows * length, device="cpu")
            tenant = LoraSession("t", base, types.LoraConfig(rank=8, seed=1), base_model="m")
            data = []
            for _ in range(rows):
                tokens = rng.integers(0, shape.vocab, length + 1)
                data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
                                        loss_fn_inputs={"target_tokens": tokens[1:].tolist(),
                                                        "weights": np.ones(length, dtype=np.float32)}))
            item = LossItem(tenant, data, "cross_entropy", None, checkpointing=on)
            base.run_pass([item], True)  # the adapter's gradients exist from here on, as in a running session
            with LiveTensorBytes() as live:
                base.run_pass([item], True)
            assert item.error is None, item.error
            estimate = memory.activation_bytes(shape, [length] * rows, microbatch_tokens=rows * length, backward=True,
                                               chunk_tokens=base.logprobs.chunk_tokens, checkpointing=on,
                                               device_type="cuda")
            print(f"\n{family} {rows} x {length} checkpointing {'on' if on else 'off'}: live peak {live.peak:,} B, "
                  f"estimated {estimate:,} ({estimate / live.peak:.2f}x)")
            assert live.peak <= estimate, (family, rows, length, on)


def test_the_worker_checkpoints_a_batch_only_when_it_needs_to(monkeypatch):
    """admit_batch under auto: a batch that fits as it is runs as it is; one that fits only checkpointed is
    checkpointed; one that fits neither way is refused, saying so. ``on`` checkpoints every forward_backward,
    ``off`` refuses what does not fit plainly and says checkpointing would; a forward never checkpoints."""
    from tinkerq.errors import CapacityError
    from tinkerq.settings import Settings

    model = _llama(8)
    shape = memory.ModelShape.of(model)
    logprobs = LogprobComputer(model, "torch")
    small, large = [40] * 2, [400] * 8

    def need(lengths, on):
        return memory.batch_bytes(shape, lengths, microbatch_tokens=16384, backward=True,
                                  chunk_tokens=logprobs.chunk_tokens, checkpointing=on)

    assert need(large, True) < need(small, False) * 100 and need(large, True) < 0.6 * need(large, False)
    # What is free: between the large batch's checkpointed need and its plain one (the headroom on top).
    free = (need(large, True) + need(large, False)) // 2 + memory.HOST_HEADROOM_BYTES
    monkeypatch.setattr(memory, "device_free", lambda device, limit_mb=0: memory.Free(free, "a test"))
    monkeypatch.setattr(memory, "_recent_free", {})

    def admit(mode, lengths, backward=True):
        settings = Settings(activation_checkpointing=mode, microbatch_tokens=16384)
        return memory.admit_batch(model, settings, lengths, backward=backward, logprobs=logprobs)

    assert admit("auto", small) is False
    assert admit("auto", large) is True
    assert admit("on", small) is True
    assert admit("auto", large, backward=False) is False
    with pytest.raises(CapacityError, match="TINKERQ_ACTIVATION_CHECKPOINTING=auto"):
        admit("off", large)
    with pytest.raises(CapacityError, match="decoder layers checkpointed"):
        admit("auto", [1000] * 64)


# -- real workers ----------------------------------------------------------------------------------------------------


def test_a_worker_with_checkpointing_on_trains_as_one_without(model_dir, redis_url, tmp_path):
    """Two real workers of the tiny model, ``--activation-checkpointing on`` and ``off``: a full and a LoRA session
    on each, two forward_backward + optim_step rounds of variable-length datums and a forward: the same logprobs,
    losses and metrics (the on worker says in its log that it checkpointed)."""
    from tinkerq import types
    from tinkerq.launcher.processes import stop
    from tinkerq.producer import ServiceClient

    procs, logs = {}, {}
    try:
        for mode in ("on", "off"):
            logs[mode] = tmp_path / f"worker-{mode}.log"
            procs[mode] = start_named_worker(model_dir, redis_url, f"ckpt-{mode}-model", logs[mode],
                                             extra=["--activation-checkpointing", mode])
        results: dict[str, list] = {"on": [], "off": []}
        with ServiceClient(broker_url=redis_url) as sc:
            for mode in ("on", "off"):
                rng = np.random.default_rng(11)
                for lora in (False, True):
                    name = f"ckpt-{mode}-model"
                    tc = (sc.create_lora_training_client(name, rank=4, seed=1) if lora
                          else sc.create_training_client(name))
                    for _ in range(2):
                        out = tc.forward_backward(make_batch(rng, 6, min_len=5, max_len=60)).result(timeout=120)
                        step = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
                        results[mode].append((out, step.metrics))
                    results[mode].append((tc.forward(make_batch(rng, 3)).result(timeout=120), None))
                    tc.close()
        for (a, ma), (b, mb) in zip(results["on"], results["off"], strict=True):
            assert a.metrics.keys() == b.metrics.keys()
            for key in a.metrics:
                assert a.metrics[key] == pytest.approx(b.metrics[key], rel=1e-6, abs=1e-7), key
            for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs, strict=True):
                np.testing.assert_allclose(x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), rtol=1e-6, atol=1e-6)
            if ma is not None:
                assert ma["grad_norm:mean"] == pytest.approx(mb["grad_norm:mean"], rel=1e-5)
    finally:
        for proc in procs.values():
            stop(proc.pid, timeout=20)
    assert logs["on"].read_text().count("decoder layers checkpointed") == 4  # every forward_backward, no forward
    assert "decoder layers checkpointed" not in logs["off"].read_text()

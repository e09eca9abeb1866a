"""A LoRA base kept quantized (worker/loading/quantized_base.py) against the same session on the dequantized base.

Each model is a tiny family model whose weights are quantized here with worker/checkpoints/quant_formats.py's quantize_*
functions; the float model is then given the dequantized weights, written back plainly in this file (the
reference), and a copy of it keeps the stored tensors instead. LoRA logprobs, losses and gradients through
tinkerq's LoRA sessions (one alone, and a mixed pass of two) must agree within float32 tolerance, sampling must
give the same tokens, and the kept model must hold the stored bytes. The memory test measures the process's peak
RSS (Linux's VmHWM, reset through /proc/self/clear_refs) around a forward_backward, with the saved-tensor hooks
on and off.
"""

from __future__ import annotations

import copy
import gc
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import make_batch
from tinkerq import types
from tinkerq.allocator import trim_heap
from tinkerq.errors import UserError
from tinkerq.recipes.families import build_model
from tinkerq.worker.checkpoints import quant_formats as qf
from tinkerq.worker.loading import quantized_base
from tinkerq.worker.loading.quantized_base import keep_quantized
from tinkerq.worker.lora.batch import LossItem, run_pass
from tinkerq.worker.lora.session import LoraBase, LoraSession, write_merged
from tinkerq.worker.sampling import SampleJob, StopRule, run_jobs
from tinkerq.worker.training.logprobs import LogprobComputer

pytestmark = pytest.mark.timeout(120)


# -- quantizing a model in memory, and the dequantized reference written back plainly -----------------------------


def _fp8(w: torch.Tensor, block: tuple[int, int]) -> qf.QuantizedTensor:
    q, s = qf.quantize_fp8_blocks(w, block)
    return qf.QuantizedTensor(qf.FP8_BLOCK, {"weight": q, "scale_inv": s}, tuple(w.shape), block)


def _int4(w: torch.Tensor, group: int) -> qf.QuantizedTensor:
    q, s = qf.quantize_int4_packed(w, group)
    return qf.QuantizedTensor(qf.INT4_PACKED, {"packed": q, "scale": s}, tuple(w.shape), (group,))


def _mxfp4(w: torch.Tensor) -> qf.QuantizedTensor:
    blocks, scales = qf.quantize_mxfp4(w)
    return qf.QuantizedTensor(qf.MXFP4, {"blocks": blocks, "scales": scales}, tuple(w.shape))


def _experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(getattr(m, "down_proj", None), torch.nn.Parameter)
            and m.down_proj.dim() == 3]


@torch.no_grad()
def quantize(model: torch.nn.Module, fmt: str) -> dict[str, qf.QuantizedTensor]:
    """Quantize ``model``'s weights as the published checkpoints of ``fmt`` do, keyed by checkpoint name, and write
    the dequantized values back into the float model.

    fp8: every Linear of the decoder layers (blocks of 16 x 16: partial tiles on DeepSeek-V3's 20-row
    kv_a_proj_with_mqa and 48 x 16 q_b_proj) and every routed expert, per expert. int4: routed experts per expert,
    groups of 32 (a partial group on the 16-wide down projection). mxfp4: gpt-oss's fused experts, stacked
    (E, out, in) as the checkpoint stores them; the parameter is its transpose."""
    out: dict[str, qf.QuantizedTensor] = {}
    if fmt == "fp8":
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and ".layers." in name:
                out[f"{name}.weight"] = t = _fp8(m.weight, (16, 16))
                m.weight.copy_(t.dequantize())
    for name, m in _experts(model):
        e_count, inter = m.down_proj.shape[0], m.down_proj.shape[2]
        if fmt == "mxfp4":  # gpt-oss: gate_up_proj (E, H, 2I) interleaved, down_proj (E, I, H); stored transposed
            for param in ("gate_up_proj", "down_proj"):
                weight = getattr(m, param)
                out[f"{name}.{param}"] = t = _mxfp4(weight.transpose(1, 2))
                weight.copy_(t.dequantize().transpose(1, 2))
            continue
        assert not m.is_transposed and m.is_concatenated  # (E, 2I, H) = [gate | up]
        for e in range(e_count):
            for proj, rows in (("gate_proj", m.gate_up_proj[e, :inter]), ("up_proj", m.gate_up_proj[e, inter:]),
                               ("down_proj", m.down_proj[e])):
                t = _fp8(rows, (16, 16)) if fmt == "fp8" else _int4(rows, 32)
                out[f"{name}.{e}.{proj}.weight"] = t
                rows.copy_(t.dequantize())
    return out


FORMATS = {  # format: (family, config overrides)
    "fp8": ("deepseek_v3", {}),
    "int4": ("qwen3_moe", {}),
    "mxfp4": ("gpt_oss", dict(hidden_size=64, intermediate_size=32, head_dim=16)),  # whole MXFP4 blocks of 32
}


def models(fmt: str) -> tuple[torch.nn.Module, torch.nn.Module, dict[str, qf.QuantizedTensor]]:
    """(the dequantized model, a copy kept quantized, the stored tensors)."""
    family, overrides = FORMATS[fmt]
    model = build_model(family, 0, **overrides)
    stored = quantize(model, fmt)
    kept = copy.deepcopy(model)
    keep_quantized(kept, stored)
    return model, kept, stored


def session(model: torch.nn.Module, seed: int, **flags) -> tuple[LoraBase, LoraSession]:
    base = LoraBase(model, LogprobComputer(model, "torch"), model_dir="/nonexistent", microbatch_tokens=64)
    s = LoraSession(f"s{seed}", base, types.LoraConfig(rank=4, seed=seed, **flags), base_model="tiny")
    with torch.no_grad():
        for p in s.engine.params:  # nonzero B: every adapter changes its rows from the start
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel() + seed)), alpha=0.05)
    return base, s


def _logprobs(out: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def assert_close_grads(a: LoraSession, b: LoraSession, tol: float = 1e-5) -> None:
    for (name, pa), pb in zip(a.adapter.named_pairs(), b.engine.params, strict=True):
        scale = max(1.0, float(pa.grad.abs().max()))
        assert float((pa.grad - pb.grad).abs().max()) <= tol * scale, name


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_lora_on_a_kept_base_equals_the_dequantized_base(fmt: str, tmp_path: Path) -> None:
    model, kept, stored = models(fmt)
    # The kept model holds the stored bytes, not the dequantized ones.
    stats_bytes = sum(t.nbytes for t in stored.values())
    kept_buffers = sum(quantized_base.stored_bytes(m) for m in kept.modules())
    assert kept_buffers == stats_bytes
    float_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kept_bytes = sum(p.numel() * p.element_size() for p in kept.parameters()) + kept_buffers
    replaced = sum(int(np.prod(t.shape)) * 4 for t in stored.values())  # float32 weights the stored ones replaced
    assert kept_bytes <= float_bytes - replaced + stats_bytes + sum(b.numel() * b.element_size()
                                                                    for b in model.buffers())
    assert quantized_base.is_kept(kept) and not quantized_base.is_kept(model)
    assert quantized_base.parameter_count(kept) == sum(p.numel() for p in model.parameters())

    data = make_batch(np.random.default_rng(1), 3, max_len=12)
    built = []
    with pytest.MonkeyPatch.context() as patch:  # a new session reads the experts' layout without dequantizing
        patch.setattr(quantized_base, "build", lambda *a: built.append(a))
        (_, ref), (kept_base, mine) = session(model, 7), session(kept, 7)
    assert built == []
    a = ref.run_loss(data, "cross_entropy", None, backward=True)
    b = mine.run_loss(data, "cross_entropy", None, backward=True)
    assert b.metrics["loss:sum"] == pytest.approx(a.metrics["loss:sum"], rel=1e-5)
    for x, y in zip(_logprobs(a), _logprobs(b), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)
    assert_close_grads(ref, mine)

    # A mixed pass of two tenants on the kept base: each equals its session on the dequantized base.
    (_, ref2), other = session(model, 8, train_attn=False), session(kept, 8, train_attn=False)[1]
    for s in (ref, mine):
        for p in s.engine.params:
            p.grad.zero_()
    data2 = make_batch(np.random.default_rng(2), 2, max_len=12)
    items = [LossItem(mine, data, "cross_entropy", None), LossItem(other, data2, "cross_entropy", None)]
    run_pass(items, kept_base.model, kept_base.logprobs, head=kept_base.head, microbatch_tokens=64,
             device=kept_base.device, backward=True)
    solo = ref.run_loss(data, "cross_entropy", None, backward=True), ref2.run_loss(data2, "cross_entropy", None,
                                                                                   backward=True)
    for item, want in zip(items, solo, strict=True):
        assert item.error is None
        for x, y in zip(_logprobs(want), _logprobs(item.output), strict=True):
            np.testing.assert_allclose(x, y, atol=1e-5)
    # The pass pads to a bucket and run_loss to the longest row: float32 sums in another order (test_lora.py).
    assert_close_grads(ref, mine, tol=2e-5)
    assert_close_grads(ref2, other, tol=2e-5)

    # Sampling the kept base with the adapter gives the dequantized base's tokens.
    def job(m: torch.nn.Module, adapter) -> SampleJob:
        return SampleJob(model=m, model_key=id(m), prompt=[5, 9, 2, 7], num_samples=2,
                         params=types.SamplingParams(max_tokens=5, temperature=1.0, seed=3),
                         stop=StopRule(None, [], None), max_tokens=5, adapter=adapter)

    want = run_jobs(None, [job(model, ref.snapshot())], timeout=60)[0]
    got = run_jobs(None, [job(kept, mine.snapshot())], timeout=60)[0]
    assert [s.tokens for s in got] == [s.tokens for s in want]
    for s, w in zip(got, want, strict=True):
        np.testing.assert_allclose(s.logprobs, w.logprobs, atol=1e-5)

    # A merged save (save_weights_for_sampler(merged=True)) from the kept base is the dequantized base's.
    write_merged(kept, mine.adapter.frozen(), tmp_path / "kept")
    write_merged(model, ref.adapter.frozen(), tmp_path / "float")
    a_dir, b_dir = (AutoModelForCausalLM.from_pretrained(tmp_path / d, dtype=torch.float32) for d in ("kept", "float"))
    for (name, x), (_, y) in zip(sorted(a_dir.state_dict().items()), sorted(b_dir.state_dict().items()), strict=True):
        assert torch.equal(x, y), name


def test_state_dict_is_the_dequantized_model_and_full_sessions_are_refused(tmp_path: Path) -> None:
    model, kept, _ = models("fp8")
    want, got = model.state_dict(), kept.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    with pytest.raises(UserError, match="quantized-base dequantize"):
        quantized_base.refuse_full_session(kept)
    with pytest.raises(UserError, match="LoRA sessions"):
        copy.deepcopy(kept)
    quantized_base.refuse_full_session(model)  # a float base: nothing refused
    kept.to(torch.bfloat16)  # the stored parts keep their format; the dequantized weights follow the cast
    linear = kept.model.layers[0].self_attn.o_proj
    assert linear.weight.dtype == torch.bfloat16 and linear.weight_q_weight.dtype == torch.float8_e4m3fn
    assert torch.equal(linear.weight, model.model.layers[0].self_attn.o_proj.weight.to(torch.bfloat16))


def test_tensors_that_fit_no_module_are_refused() -> None:
    model = build_model("qwen3_moe", 0)
    w = model.model.layers[1].mlp.experts.down_proj[0].detach()
    with pytest.raises(UserError, match="names no Linear"):
        keep_quantized(model, {"model.layers.1.mlp.nothing.weight": _fp8(w, (16, 16))})
    with pytest.raises(UserError, match="not of all 8"):
        keep_quantized(model, {"model.layers.1.mlp.experts.0.down_proj.weight": _fp8(w, (16, 16))})
    with pytest.raises(UserError, match="dequantized, the model's weight"):
        keep_quantized(model, {"model.layers.0.self_attn.q_proj.weight": _fp8(w, (16, 16))})
    assert not quantized_base.is_kept(model)


# -- memory ---------------------------------------------------------------------------------------------------


def _rss() -> int:
    return _status("VmRSS")


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _peak_during(fn) -> int:
    """Peak RSS above the RSS at the start while ``fn`` runs (VmHWM, reset through /proc/self/clear_refs)."""
    trim_heap()
    start = _rss()
    Path("/proc/self/clear_refs").write_text("5")
    fn()
    return _status("VmHWM") - start


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS is measured through Linux's /proc")
def test_memory_is_the_stored_size_plus_one_layer() -> None:
    """The check below, in a fresh process: its peak RSS is the process's, and a test process that ran other modules
    first (threads of their own, a heap they fragmented) measured 169 MB where a fresh one measures 70-76 MiB."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", "from tests.test_quantized_base import memory_check; memory_check()"],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def memory_check() -> None:
    """An 8-layer MoE base, 201 MB of float32 expert weights (25 MB a layer), kept in FP8 (50 MB): loading it kept
    frees the float weights, and a LoRA forward_backward's peak is a layer or two of dequantized experts with the
    saved-tensor hooks, every layer's without. The stored codes are random (only sizes matter here)."""
    model = build_model("qwen3_moe", 0, hidden_size=256, moe_intermediate_size=512, num_experts=16,
                        num_hidden_layers=8, mlp_only_layers=[], intermediate_size=64)
    generator = torch.Generator().manual_seed(0)
    stored = {}
    for name, m in _experts(model):
        for e in range(m.down_proj.shape[0]):
            for proj, (rows, cols) in (("gate_proj", (512, 256)), ("up_proj", (512, 256)), ("down_proj", (256, 512))):
                codes = torch.randint(0, 0x7E, (rows, cols), dtype=torch.uint8, generator=generator)  # no NaN code
                scales = torch.rand(rows // 128, cols // 128, generator=generator) / 448
                stored[f"{name}.{e}.{proj}.weight"] = qf.QuantizedTensor(
                    qf.FP8_BLOCK, {"weight": codes.view(torch.float8_e4m3fn), "scale_inv": scales}, (rows, cols),
                    (128, 128))
    layer_bytes = sum(p.numel() * 4 for p in _experts(model)[0][1].parameters())
    trim_heap()
    before = _rss()
    stats = keep_quantized(model, stored)
    del stored
    trim_heap()
    freed = before - _rss()
    assert stats.dequantized_bytes == 8 * layer_bytes and stats.largest_module_bytes == layer_bytes
    # The float experts (201 MB) are released; the stored ones were stacked into buffers, the originals freed.
    assert freed >= 0.8 * stats.dequantized_bytes, (freed, stats)

    _, s = session(model, 1, train_attn=False, train_unembed=False)  # experts adapted: their dispatch saves weights
    data = make_batch(np.random.default_rng(0), 2, min_len=20, max_len=24)

    def step() -> None:
        s.run_loss(data, "cross_entropy", None, backward=True)
        gc.collect()

    recomputing = _peak_during(step)
    with quantized_base.saving_weights():
        saving = _peak_during(step)
    # With the hooks, a layer's dequantized experts (24 MiB) in the forward or rebuilt in the backward, with the
    # dequantization's temporaries and the activations: 70-76 MiB measured here (keep_quantized fixes glibc's mmap
    # threshold: with the dynamic one, the freed layers fragmented the heap and the peak was 157-198 MiB). Without
    # them, every layer's, saved by the graph until its backward: 206 MiB.
    assert recomputing < 0.5 * stats.dequantized_bytes, (recomputing, stats.dequantized_bytes)
    assert saving - recomputing > 0.4 * stats.dequantized_bytes, (saving, recomputing, stats.dequantized_bytes)


@pytest.mark.parametrize("layout", ["deepseek_v3-fp8", "gpt_oss-mxfp4", "kimi_k2-int4"])
def test_published_checkpoints_kept_as_stored(tmp_path: Path, layout: str) -> None:
    """The worker's path: a checkpoint in a published layout (recipes/published.py: sharded, per-expert keys,
    DeepSeek's MTP layer) loaded dequantized, then kept from the checkpoint's own stored tensors
    (worker/checkpoints/reader.py): the same LoRA numbers as the dequantized load."""
    from tinkerq.recipes.published import build_published
    from tinkerq.worker.checkpoints.reader import read_quantized_tensors
    from tinkerq.worker.loading.models import load_causal_lm

    directory = str(build_published(layout, tmp_path / layout))
    model = load_causal_lm(directory, dtype="float32")
    kept = load_causal_lm(directory, dtype="float32")
    stats = quantized_base.keep_checkpoint_quantized(kept, directory)
    assert stats.modules > 0 and stats.tensors <= len(read_quantized_tensors(directory))
    assert stats.stored_bytes == sum(quantized_base.stored_bytes(m) for m in kept.modules())
    data = make_batch(np.random.default_rng(3), 2, max_len=10)
    (_, ref), (_, mine) = session(model, 5), session(kept, 5)
    a = ref.run_loss(data, "cross_entropy", None, backward=True)
    b = mine.run_loss(data, "cross_entropy", None, backward=True)
    for x, y in zip(_logprobs(a), _logprobs(b), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)
    assert_close_grads(ref, mine)


def test_planner_plans_a_kept_base_as_stored_plus_one_layer() -> None:
    """`tinkerq plan --quantized-base keep`: the LoRA base at its stored size, one layer's quantized weights
    dequantized as the working set (counted here on the meta model independently), full sessions unchanged."""
    from tinkerq.worker.planning.planner import KEPT_LAYER_FACTOR, meta_model, plan, read_config, render

    deq = plan("gpt-oss-20b", devices=8, device_gb=80, dtype="bfloat16")
    kept = plan("gpt-oss-20b", devices=8, device_gb=80, dtype="bfloat16", quantized_base="keep")
    q = kept.quantized
    assert q is not None and q.method == "mxfp4"
    model = meta_model(read_config("gpt-oss-20b")[1], "bfloat16")
    experts = model.model.layers[0].mlp.experts  # every layer alike: its MXFP4 matrices, in bfloat16
    layer = sum(getattr(experts, p).numel() * 2 for p in ("gate_up_proj", "down_proj"))
    assert q.layer_bytes == layer
    assert kept.lora.parts["frozen base as stored (shared)"] == q.checkpoint_bytes + sum(
        b.numel() * b.element_size() for b in model.buffers())
    assert kept.lora.parts["one layer dequantized (working)"] == KEPT_LAYER_FACTOR * layer
    assert q.checkpoint_bytes < q.dequantized_bytes / 3  # 4.25-bit experts against bfloat16
    assert kept.lora.at == 1 and kept.lora.fits and kept.lora.total == sum(kept.lora.parts.values()) + \
        kept.lora.adapter_bytes
    assert kept.full == deq.full  # full sessions need float weights: planned dequantized either way
    assert "--quantized-base keep" in render(kept) and "as stored" in render(kept)
    with pytest.raises(UserError, match="dequantize or keep"):
        plan("gpt-oss-20b", devices=8, device_gb=80, quantized_base="fp4")


def test_a_worker_keeps_a_published_fp8_base(tmp_path: Path, redis_url: str) -> None:
    """`tinkerq worker --quantized-base keep` on a DeepSeek-V3 FP8 checkpoint: a LoRA forward_backward gives the
    in-process dequantized session's logprobs; a full session is one user error naming the fix."""
    from tests.conftest import start_named_worker
    from tinkerq.errors import TinkerqError
    from tinkerq.producer import ServiceClient
    from tinkerq.recipes.published import build_published
    from tinkerq.worker.loading.models import load_causal_lm

    directory = build_published("deepseek_v3-fp8", tmp_path / "ckpt")
    proc = start_named_worker(directory, redis_url, "kept-fp8", tmp_path / "worker.log",
                              extra=["--quantized-base", "keep", "--dtype", "float32"])
    sc = ServiceClient(broker_url=redis_url)
    try:
        data = make_batch(np.random.default_rng(4), 2, max_len=10)
        tc = sc.create_lora_training_client("kept-fp8", rank=4, seed=11).result()
        got = tc.forward_backward(data, "cross_entropy").result(timeout=120)
        model = load_causal_lm(str(directory), dtype="float32")
        # The kept weights are counted: the model's parameters as the dequantized model has them.
        assert tc.get_info().num_parameters == sum(p.numel() for p in model.parameters())
        base = LoraBase(model, LogprobComputer(model, "torch"), model_dir=str(directory), microbatch_tokens=4096)
        want = LoraSession("ref", base, types.LoraConfig(rank=4, seed=11), base_model="kept-fp8").run_loss(
            data, "cross_entropy", None, backward=True)
        for x, y in zip(_logprobs(want), _logprobs(got), strict=True):
            np.testing.assert_allclose(x, y, atol=1e-5)
        with pytest.raises(TinkerqError, match="quantized-base dequantize"):
            sc.create_training_client("kept-fp8").result(timeout=60)
        assert "kept as stored" in (tmp_path / "worker.log").read_text()
    finally:
        sc.close()
        proc.terminate()
        proc.wait(30)

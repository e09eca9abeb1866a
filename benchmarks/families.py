"""Model families: training and sampling throughput per family, LoRA on MoE against the base, adapter sizes.

In process (no Redis, no worker process); every baseline is measured or computed in the same run and nothing
asserts on timings. Models come from ``tinkerq.recipes.families`` (random weights from a fixed seed).

* **table** (default part): each family's tiny model (``FAMILIES``, float32): ``forward_backward`` tokens/s of a
  full-parameter ``TrainingSession`` (its own copy of the weights) and of a rank-``--rank`` LoRA session
  (``train_attn``/``train_mlp``/``train_unembed`` all True; the largest rank every target takes where a tiny
  projection is narrower: Qwen3.5's linear-attention a/b projections) on the same batch (8 datums x 64 tokens,
  cross_entropy), and sampling tokens/s (8 prompts of 16 tokens x 16 new tokens, temperature 1, no stop token,
  all submitted at once to one ``TorchEngine``). Alternating rep by rep, median after ``--warmup``; ``x llama``
  is the ratio to the llama row of the same run. A family whose sampling (or training) fails gets an
  ``error: ...`` cell, and the run goes on.
* **moe** (default part): the issue's target, "a LoRA forward_backward on an MoE family costs <= 1.3x the base
  model's own forward + backward of the same batch". Each family of ``MOE_FAMILIES`` at a wider config than the
  tiny one (``MOE_WIDE``: hidden 256, 16 experts of 512, top-2, heads of 32, every MoE layer kept MoE), so
  matmuls rather than Python dominate; 8 datums x 128 tokens, cross_entropy. Measured, alternating:
    (b) **base fb**: the frozen base model's own forward + backward of the batch through the same loss head
        (``LogprobComputer``), weights frozen, gradients to the activations only (the input embeddings' output
        made a leaf that requires grad): the issue's "base model's own forward + backward". RATIO (b) is
        LoRA fb / base fb.
    (a) **full fb**: a full-parameter ``TrainingSession.run_loss`` on the same batch (what a user compares).
    LoRA fb: ``LoraSession.run_loss`` (rank ``--rank``, all targets); and, as a diagnostic, the same adapter
    with ``train_mlp=False`` (no dense-MLP, shared-expert or routed-expert adapters).
* **counts** (``--counts``): LoRA parameters per unit of rank (attn / mlp / unembed / total, from
  ``find_targets`` + ``parameters_per_rank``) for the full-size ``REAL_FULL`` configs (Qwen3-30B-A3B,
  gpt-oss-20b, DeepSeek-V3) built on the meta device, and Llama-3.2-1B next to the cookbook's published
  figures (attn 212,992; mlp 491,520; unembed 130,304 per rank).
* **real-small** (``--shape real-small``, meant for ``--device cuda --dtype bfloat16``): the ``REAL_SMALL``
  shapes (real width, 4 layers): full fb, LoRA fb (without and with activation checkpointing, "ckpt": each decoder
  layer recomputed in the backward, worker/training/checkpointing.py) and base fb tokens/s, MFU, sampling tokens/s
  and peak memory
  (``torch.cuda.max_memory_allocated``, reset before each call, so it includes what stays resident: the base and
  the full session's copy; on CPU the process's peak RSS is printed once).
  8 datums x 1024 tokens, 64 prompts of 16 tokens x 128 new tokens. ``--layers N`` and ``--shrink K`` (widths,
  vocabulary and expert counts divided by K) make it small enough to exercise on a CPU.

MFU (model FLOPs utilisation) = model FLOPs / median time / peak (``--peak-tflops``, default 989 on CUDA: an
H200's dense bf16 peak; no MFU on CPU unless given). Model FLOPs per token, N = active base parameters (every
parameter except the input embedding table, which is a lookup, the output projection counted even when tied;
routed experts' parameters x top_k / num_experts), R = active adapter parameters (a Linear target rank x
(in + out); an expert target its shared factor whole plus its per-expert factor x top_k / num_experts):

    full fb      6 N          (forward 2 N, gradients to activations 2 N, to weights 2 N)
    LoRA fb      4 N + 6 R    (the frozen base: forward and gradients to activations only)
    base fb      4 N

Attention's T^2 terms (QK^T, AV) and the Mamba / linear-attention scans are left out, so MFU is a lower bound.

    .venv/bin/python benchmarks/families.py [--families llama qwen3_moe ...] [--threads 2] [--reps 3] [--warmup 1]
    .venv/bin/python benchmarks/families.py --counts
    .venv/bin/python benchmarks/families.py --device cuda --dtype bfloat16 --shape real-small
    .venv/bin/python benchmarks/families.py --device cpu --shape real-small --layers 1 --shrink 16   # CPU smoke
"""

from __future__ import annotations

import argparse
import copy
import resource
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from _fleet import machine, median, print_table
from transformers import AutoModelForCausalLM

from tinkerq import types
from tinkerq.recipes.families import FAMILIES, MOE_FAMILIES, REAL_FULL, REAL_SMALL, build_model
from tinkerq.worker.lora import experts as fused
from tinkerq.worker.lora.adapter import Target, find_targets, parameters_per_rank
from tinkerq.worker.lora.session import LoraBase, LoraSession
from tinkerq.worker.sampling import SampleJob, StopRule, TorchEngine, run_jobs
from tinkerq.worker.training import checkpointing
from tinkerq.worker.training.logprobs import LogprobComputer
from tinkerq.worker.training.session import TrainingSession

MICROBATCH_TOKENS = 16384  # the worker's default (tinkerq/settings.py)
TARGET_MOE = 1.3  # the bound on LoRA fb / base fb for MoE families
H200_BF16_TFLOPS = 989.0
PROMPT_TOKENS = 16
NO_STOP = StopRule([], [], None)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Batches per part: (datums, tokens per datum, prompts, new tokens per prompt)
SIZES = {"table": (8, 64, 8, 16), "moe": (8, 128, 8, 16), "real-small": (8, 1024, 64, 128)}

# The MoE part's wider configs (overrides of the tiny ones): hidden 256, 8 heads of 32 (4 KV heads), 16 routed
# experts of 512 (top-2, as the tiny configs), dense / shared-expert MLPs of 512-1024; every MoE layer stays MoE.
_WIDE: dict[str, Any] = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=32)
MOE_WIDE: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(_WIDE, intermediate_size=1024, moe_intermediate_size=512, num_experts=16,
                      mlp_only_layers=[]),  # both layers MoE, as in Qwen3-30B-A3B
    "qwen3_5_moe": dict(_WIDE, moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=16,
                        linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=4,
                        linear_num_value_heads=8),  # linear attention + full attention, both MoE
    "gpt_oss": dict(_WIDE, intermediate_size=512, num_local_experts=16, sliding_window=32),
    "deepseek_v3": dict(_WIDE, num_key_value_heads=8, intermediate_size=1024, moe_intermediate_size=512,
                        n_routed_experts=16, q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=16, head_dim=16,
                        qk_nope_head_dim=32, v_head_dim=32),  # 1 dense + 2 MoE layers, MLA
    "nemotron_h": dict(_WIDE, intermediate_size=1024, moe_intermediate_size=512,
                       moe_shared_expert_intermediate_size=512, n_routed_experts=16, mamba_num_heads=8,
                       mamba_head_dim=32, ssm_state_size=32, chunk_size=32,
                       layers_block_type=["mamba", "moe", "attention", "moe"]),
}
LLAMA_3_2_1B = ("llama", "LlamaConfig", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                             num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                             tie_word_embeddings=True))
COOKBOOK_LLAMA_1B = {"attn": 212_992, "mlp": 491_520, "unembed": 130_304}  # per rank, tinker-cookbook's figures


# -- plumbing ---------------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def short_error(exc: BaseException, width: int = 60) -> str:
    line = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return "error: " + (line if len(line) <= width else line[:width - 3] + "...")


class Runner:
    """Timed calls of named kinds, alternating rep by rep; a kind that raises is recorded and not called again."""

    def __init__(self, kinds: dict[str, Callable[[], Any]], device: torch.device) -> None:
        self.kinds = kinds
        self.device = device
        self.times: dict[str, list[float]] = {k: [] for k in kinds}
        self.peak: dict[str, int] = {k: 0 for k in kinds}
        self.errors: dict[str, BaseException] = {}

    def run(self, reps: int, warmup: int, label: str) -> None:
        for rep in range(warmup + reps):
            line = []
            for name, fn in self.kinds.items():
                if name in self.errors:
                    continue
                if self.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(self.device)
                sync(self.device)
                t0 = time.perf_counter()
                try:
                    fn()
                    sync(self.device)
                except Exception as exc:  # reported as the family's row, the run goes on
                    self.errors[name] = exc
                    line.append(f"{name} {short_error(exc)}")
                    continue
                elapsed = time.perf_counter() - t0
                if self.device.type == "cuda":
                    self.peak[name] = max(self.peak[name], torch.cuda.max_memory_allocated(self.device))
                line.append(f"{name} {elapsed:.3f}")
                if rep >= warmup:
                    self.times[name].append(elapsed)
            print(f"  {label} rep {rep}{' (warm-up)' if rep < warmup else ''}: " + "; ".join(line), flush=True)

    def median(self, name: str) -> float | None:
        return median(self.times[name]) if name not in self.errors and self.times[name] else None

    def cell(self, name: str, fmt: Callable[[float], Any]) -> Any:
        """``fmt(median seconds)`` or the kind's error."""
        if name in self.errors:
            return short_error(self.errors[name])
        m = self.median(name)
        return fmt(m) if m is not None else "-"


def make_data(rng: np.random.Generator, n: int, length: int, vocab: int) -> list[types.Datum]:
    data = []
    for _ in range(n):
        seq = rng.integers(3, vocab, length + 1, dtype=np.int64)  # 0-2: the demo tokenizer's pad/bos/eos
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
            loss_fn_inputs={"target_tokens": seq[1:], "weights": rng.uniform(0.5, 1.5, length).astype(np.float32)},
        ))
    return data


def as_tensors(data: list[types.Datum], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(tokens, mask, targets, weights) of equal-length datums, (B, T) each."""
    tokens = torch.tensor([d.model_input.to_ints() for d in data], device=device)
    targets = torch.tensor(np.stack([np.asarray(d.loss_fn_inputs["target_tokens"].to_numpy()) for d in data]),
                           device=device)
    weights = torch.tensor(np.stack([np.asarray(d.loss_fn_inputs["weights"].to_numpy()) for d in data]),
                           device=device)
    return tokens, torch.ones_like(tokens), targets, weights


def base_fb(base: LoraBase, batch: tuple[torch.Tensor, ...]) -> None:
    """The frozen base model's own forward + backward of ``batch`` through the worker's loss head: the weights get
    no gradient, the activations do (the input embeddings' output is made a leaf that requires grad)."""
    tokens, mask, targets, weights = batch
    embed = base.model.get_input_embeddings()
    hook = embed.register_forward_hook(lambda module, args, out: out.detach().requires_grad_())
    try:
        logprobs = base.logprobs(base.model, tokens, mask, targets)
        (-(logprobs * weights).sum()).backward()
    finally:
        hook.remove()


def lora_config(rank: int, seed: int = 0, **flags: bool) -> types.LoraConfig:
    return types.LoraConfig(rank=rank, seed=seed, **{"train_attn": True, "train_mlp": True, "train_unembed": True,
                                                     **flags})


def sample(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> int:
    """All prompts submitted at once to one TorchEngine (one sample each, no stop token); tokens sampled."""
    jobs = [SampleJob(model=model, model_key="bench", prompt=p, num_samples=1,
                      params=types.SamplingParams(seed=i, temperature=1.0), stop=NO_STOP, max_tokens=new_tokens)
            for i, p in enumerate(prompts)]
    engine = TorchEngine(max_rows=max(256, len(prompts)))
    try:
        results = run_jobs(engine, jobs)
    finally:
        engine.close()
    n = sum(len(s.tokens) for seqs in results for s in seqs)
    if n != len(prompts) * new_tokens:
        raise RuntimeError(f"sampled {n} tokens, expected {len(prompts) * new_tokens}")
    return n


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def active_params(model: torch.nn.Module) -> float:
    """N of the docstring: parameters a token's forward multiplies by (see the module docstring)."""
    top_k = getattr(model.config, "num_experts_per_tok", None)
    total = 0.0
    seen: set[int] = set()  # a tied weight belongs to two modules
    for module in model.modules():
        mine = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in mine)
        own = sum(p.numel() for p in mine)
        if own and fused.is_fused_experts(module) and top_k:
            experts = next(p for p in module.parameters(recurse=False) if p.dim() == 3).shape[0]
            own = own * min(top_k, experts) / experts
        total += own
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or embed.weight is not head.weight:  # tied: the one table is the output projection's matmul
        total -= embed.weight.numel()
    return total


def active_adapter_params(targets: list[Target], rank: int, top_k: int | None) -> float:
    """R of the docstring."""
    total = 0.0
    for t in targets:
        if not t.experts:
            total += rank * (t.in_features + t.out_features)
            continue
        a, b = t.shapes(rank)
        shared, per_expert = (a, b) if t.shared_a else (b, a)
        frac = min(top_k or t.experts, t.experts) / t.experts
        total += float(np.prod(shared)) + float(np.prod(per_expert)) * frac
    return total


def build(family: str, overrides: dict[str, Any], dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    model = build_model(family, 0, **overrides)  # float32 on the CPU (the recipe's seed), then moved
    checkpointing.install(model)  # as a worker's loaded model: its layers can be checkpointed when asked
    return model.to(device=device, dtype=dtype).eval()


def sessions(family: str, model: torch.nn.Module, args: argparse.Namespace,
             overrides: dict[str, Any]) -> tuple[LoraBase, TrainingSession]:
    """A LoRA base over ``model`` (frozen) and a full session on a copy of it."""
    full_model = copy.deepcopy(model).requires_grad_(True)
    full = TrainingSession("full", full_model, base_dir="/nonexistent", microbatch_tokens=MICROBATCH_TOKENS,
                           logprobs=LogprobComputer(full_model, args.loss_backend),
                           blank_model=lambda: build_model(family, 0, **overrides))
    base = LoraBase(model, LogprobComputer(model, args.loss_backend), model_dir="/nonexistent",
                    microbatch_tokens=MICROBATCH_TOKENS)
    return base, full


def vocab_of(model: torch.nn.Module) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


# -- 1. table ---------------------------------------------------------------------------------------------------


def run_table(families: list[str], args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    datums, length, n_prompts, new_tokens = SIZES["table"]
    tokens = datums * length
    results: dict[str, tuple[int, Any, Runner]] = {}
    for family in families:
        model = build(family, {}, dtype, device)
        base, full = sessions(family, model, args, {})
        vocab = vocab_of(model)
        rng = np.random.default_rng(1)
        data = make_data(rng, datums, length, vocab)
        prompts = [rng.integers(3, vocab, PROMPT_TOKENS).tolist() for _ in range(n_prompts)]
        lora: Any = None
        lora_params: Any = "-"
        try:
            # A tiny model's narrowest projection (Qwen3.5's linear-attention a/b: one per value head) may be
            # narrower than --rank: the largest rank every target takes, then.
            rank = min(args.rank, *(min(t.in_features, t.out_features) for t in base.targets(lora_config(1))))
            lora = LoraSession("lora", base, lora_config(rank), base_model=family)
            lora_params = f"{lora.num_parameters():,}" + (f" (rank {rank})" if rank != args.rank else "")
        except Exception as exc:
            lora_params = short_error(exc)

        def lora_fb(lora: Any = lora, data: list[types.Datum] = data) -> None:
            if lora is None:
                raise RuntimeError("no LoRA session (see the LoRA params column)")
            lora.run_loss(data, "cross_entropy", None, backward=True)

        runner = Runner({
            "full fb": lambda full=full, data=data: full.run_loss(data, "cross_entropy", None, backward=True),
            "LoRA fb": lora_fb,
            "sample": lambda model=model, prompts=prompts: sample(model, prompts, new_tokens),
        }, device)
        runner.run(args.reps, args.warmup, family)
        results[family] = (n_params(model), lora_params, runner)

    ref = results.get("llama", (0, None, None))[2]

    def vs_llama(runner: Runner, kind: str) -> str:
        mine, theirs = runner.median(kind), ref.median(kind) if ref is not None else None
        return f"{theirs / mine:.2f}" if mine and theirs else "-"

    rows = []
    for family, (params, lora_params, r) in results.items():
        full_s, lora_s = r.median("full fb"), r.median("LoRA fb")
        rows.append((family, f"{params:,}", lora_params,
                     r.cell("full fb", lambda s: f"{tokens / s:,.0f}"), vs_llama(r, "full fb"),
                     r.cell("LoRA fb", lambda s: f"{tokens / s:,.0f}"), vs_llama(r, "LoRA fb"),
                     f"{lora_s / full_s:.2f}" if full_s and lora_s else "-",
                     r.cell("sample", lambda s: f"{n_prompts * new_tokens / s:,.0f}"), vs_llama(r, "sample")))
    print(f"\n[table] tiny models ({dtype_name(dtype)}, {device}): forward_backward of {datums} datums x {length} "
          f"tokens = {tokens} tokens (cross_entropy), full session vs rank-{args.rank} LoRA (attn+mlp+unembed; a "
          f"lower rank where a tiny projection is narrower, shown with the LoRA params); "
          f"sampling {n_prompts} prompts x {PROMPT_TOKENS} tokens + {new_tokens} new tokens = "
          f"{n_prompts * new_tokens} tokens (one TorchEngine); median of {args.reps} after {args.warmup} warm-up, "
          f"alternating; x llama = tokens/s / llama's tokens/s")
    print_table(["family", "params", "LoRA params", "full fb tok/s", "x llama", "LoRA fb tok/s", "x llama",
                 "LoRA/full time", "sample tok/s", "x llama"], rows)
    print_errors({f: r for f, (_, _, r) in results.items()})


def print_errors(runners: dict[str, Runner]) -> None:
    for family, r in runners.items():
        for kind, exc in r.errors.items():
            print(f"  {family} {kind}: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- 2. moe -----------------------------------------------------------------------------------------------------


def run_moe(families: list[str], args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    datums, length, _, _ = SIZES["moe"]
    tokens = datums * length
    rows, ratio_lines, runners = [], [], {}
    for family in families:
        overrides = dict(MOE_WIDE[family])
        if args.hidden != _WIDE["hidden_size"]:  # --hidden: the same shapes at another width (heads of hidden / 8)
            overrides.update(hidden_size=args.hidden)
            if "qk_rope_head_dim" not in overrides:  # MLA: head_dim is the rope part; the rest stays as it is
                overrides.update(head_dim=args.hidden // _WIDE["num_attention_heads"])
        model = build(family, overrides, dtype, device)
        impl = getattr(model.config, "_experts_implementation", None)
        base, full = sessions(family, model, args, overrides)
        data = make_data(np.random.default_rng(2), datums, length, vocab_of(model))
        batch = as_tensors(data, device)
        lora = LoraSession("lora", base, lora_config(args.rank, 7), base_model=family)
        no_mlp = LoraSession("lora-no-mlp", base, lora_config(args.rank, 7, train_mlp=False), base_model=family)
        runner = Runner({
            "base fb": lambda base=base, batch=batch: base_fb(base, batch),
            "LoRA fb": lambda lora=lora, data=data: lora.run_loss(data, "cross_entropy", None, backward=True),
            "full fb": lambda full=full, data=data: full.run_loss(data, "cross_entropy", None, backward=True),
            "LoRA no-mlp fb": lambda s=no_mlp, data=data: s.run_loss(data, "cross_entropy", None, backward=True),
        }, device)
        runner.run(args.reps, args.warmup, family)
        runners[family] = runner
        b, lo, f, nm = (runner.median(k) for k in ("base fb", "LoRA fb", "full fb", "LoRA no-mlp fb"))

        def ratio(x: float | None, y: float | None) -> str:
            return f"{x / y:.2f}" if x and y else "-"

        rows.append((family, f"{n_params(model) / 1e6:.2f}M", f"{active_params(model) / 1e6:.2f}M",
                     f"{lora.num_parameters():,}", impl or "-", runner.cell("base fb", lambda s: s),
                     runner.cell("LoRA fb", lambda s: s), runner.cell("full fb", lambda s: s),
                     runner.cell("LoRA no-mlp fb", lambda s: s), ratio(lo, b), ratio(lo, f), ratio(nm, b)))
        if lo and b:
            verdict = "met" if lo / b <= TARGET_MOE else "NOT met"
            best = min(runner.times["LoRA fb"]) / min(runner.times["base fb"])
            ratio_lines.append(f"RATIO {family}: LoRA fb / base fb (b) median {lo / b:.2f}x, best-of {best:.2f}x "
                               f"(target <= {TARGET_MOE}x: {verdict}); LoRA fb / full fb (a) {ratio(lo, f)}x")
    print(f"\n[moe] wider MoE configs (MOE_WIDE: hidden 256, 16 experts of 512, top-2; {dtype_name(dtype)}, "
          f"{device}): forward_backward of {datums} datums x {length} tokens = {tokens} tokens (cross_entropy), "
          f"rank-{args.rank} LoRA (attn+mlp+unembed); median seconds of {args.reps} after {args.warmup} warm-up, "
          f"alternating")
    print("  (b) base fb = the frozen base's own forward + backward of the same batch through the same loss head, "
          "gradients to activations only: the issue's 1.3x bound is on LoRA fb / (b)")
    print("  (a) full fb = a full-parameter TrainingSession's forward_backward (weights' gradients too): what a "
          "user compares")
    print_table(["family", "params", "active", "LoRA params", "experts impl", "(b) base fb s", "LoRA fb s",
                 "(a) full fb s", "LoRA no-mlp fb s", "LoRA/(b)", "LoRA/(a)", "no-mlp/(b)"], rows)
    print_errors(runners)
    for line in ratio_lines:
        print(line)


# -- 3. counts --------------------------------------------------------------------------------------------------


def run_counts() -> None:
    import transformers

    cases = {name: (family, config_cls, fields) for name, (family, config_cls, fields) in REAL_FULL.items()}
    cases["Llama-3.2-1B"] = LLAMA_3_2_1B
    rows = []
    llama: dict[str, int] = {}
    for name, (family, config_cls, fields) in cases.items():
        config = getattr(transformers, config_cls)(**fields)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        targets = find_targets(model, lora_config(1))
        per = parameters_per_rank(targets)
        total = sum(per.values())
        experts = sum(1 for t in targets if t.experts)
        rows.append((name, family, f"{n_params(model) / 1e9:.2f}B", f"{active_params(model) / 1e9:.2f}B",
                     f"{per['attn']:,}", f"{per['mlp']:,}", f"{per['unembed']:,}", f"{total:,}",
                     f"{32 * total / 1e6:.1f}M", f"{len(targets)} ({experts} expert)"))
        if name == "Llama-3.2-1B":
            llama = per
    print("\n[counts] LoRA parameters per unit of rank (find_targets + parameters_per_rank, all of train_attn/"
          "train_mlp/train_unembed), full-size configs on the meta device; 'active' as in the MFU formula")
    print_table(["model", "family", "params", "active", "attn/rank", "mlp/rank", "unembed/rank", "total/rank",
                 "at rank 32", "targets"], rows)
    same = all(llama.get(k) == v for k, v in COOKBOOK_LLAMA_1B.items())
    print(f"Llama-3.2-1B vs tinker-cookbook's published per-rank counts "
          f"({', '.join(f'{k} {v:,}' for k, v in COOKBOOK_LLAMA_1B.items())}): {'equal' if same else 'DIFFER'}")


# -- 4. real-small ----------------------------------------------------------------------------------------------


def real_small_overrides(family: str, args: argparse.Namespace) -> dict[str, Any]:
    _, fields = REAL_SMALL[family]
    fields = dict(fields)  # the batch needs positions past the tiny configs' 256 (below)
    _, length, _, new_tokens = sizes(args, "real-small")
    fields["max_position_embeddings"] = max(4096, length + 1, PROMPT_TOKENS + new_tokens)
    if args.layers:
        fields["num_hidden_layers"] = args.layers
        for key in ("layer_types", "layers_block_type"):
            kinds = fields.get(key) or FAMILIES[family][2].get(key)
            if kinds:
                fields[key] = [kinds[i % len(kinds)] for i in range(args.layers)]
    if args.shrink > 1:
        k = args.shrink
        for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "head_dim", "vocab_size"):
            if key in fields:  # multiples of 16: grouped_mm wants 16-byte strides in bfloat16
                fields[key] = max(16, fields[key] // k // 16 * 16)
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            if key in fields:
                fields[key] = max(4, fields[key] // k)
                top_k = fields.get("num_experts_per_tok", FAMILIES[family][2].get("num_experts_per_tok", 2))
                fields["num_experts_per_tok"] = min(top_k, fields[key] // 2)
    return fields


def sizes(args: argparse.Namespace, part: str) -> tuple[int, int, int, int]:
    datums, length, prompts, new_tokens = SIZES[part]
    return (args.datums or datums, args.seq_len or length, args.prompts or prompts, args.new_tokens or new_tokens)


def run_real_small(families: list[str], args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    datums, length, n_prompts, new_tokens = sizes(args, "real-small")
    tokens = datums * length
    peak = args.peak_tflops if args.peak_tflops else (H200_BF16_TFLOPS if device.type == "cuda" else None)
    rows, runners = [], {}
    for family in families:
        checkpoint, _ = REAL_SMALL[family]
        overrides = real_small_overrides(family, args)
        t0 = time.perf_counter()
        model = build(family, overrides, dtype, device)
        base, full = sessions(family, model, args, overrides)
        lora = LoraSession("lora", base, lora_config(args.rank), base_model=family)
        print(f"  {family} ({checkpoint}, {overrides['num_hidden_layers']} layers): built in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        rng = np.random.default_rng(3)
        vocab = vocab_of(model)
        data = make_data(rng, datums, length, vocab)
        batch = as_tensors(data, device)
        prompts = [rng.integers(3, vocab, PROMPT_TOKENS).tolist() for _ in range(n_prompts)]
        runner = Runner({
            "full fb": lambda full=full, data=data: full.run_loss(data, "cross_entropy", None, backward=True),
            "LoRA fb": lambda lora=lora, data=data: lora.run_loss(data, "cross_entropy", None, backward=True),
            "LoRA fb ckpt": lambda lora=lora, data=data: lora.run_loss(data, "cross_entropy", None, backward=True,
                                                                       checkpointing=True),
            "base fb": lambda base=base, batch=batch: base_fb(base, batch),
            "sample": lambda model=model, prompts=prompts: sample(model, prompts, new_tokens),
        }, device)
        runner.run(args.reps, args.warmup, family)
        runners[family] = runner
        n_active = active_params(model)
        r_active = active_adapter_params(base.targets(lora.config), args.rank,
                                         getattr(model.config, "num_experts_per_tok", None))
        # Checkpointed, the layers' forward runs twice: the same model FLOPs, more hardware FLOPs (MFU counts the
        # model's, as is usual; its time shows the recomputation's cost).
        flops = {"full fb": 6 * n_active, "LoRA fb": 4 * n_active + 6 * r_active, "base fb": 4 * n_active,
                 "LoRA fb ckpt": 4 * n_active + 6 * r_active}

        def mfu(kind: str, runner: Runner = runner, flops: dict[str, float] = flops) -> str:
            s = runner.median(kind)
            return f"{100 * flops[kind] * tokens / s / (peak * 1e12):.1f}%" if s and peak else "-"

        def mem(kind: str, runner: Runner = runner) -> str:
            return f"{runner.peak[kind] / 2**30:.1f}" if device.type == "cuda" else "-"

        rows.append((family, checkpoint, f"{n_params(model) / 1e9:.3f}B", f"{n_active / 1e9:.3f}B",
                     f"{lora.num_parameters() / 1e6:.2f}M",
                     runner.cell("full fb", lambda s: f"{tokens / s:,.0f}"), mfu("full fb"), mem("full fb"),
                     runner.cell("LoRA fb", lambda s: f"{tokens / s:,.0f}"), mfu("LoRA fb"), mem("LoRA fb"),
                     runner.cell("LoRA fb ckpt", lambda s: f"{tokens / s:,.0f}"), mfu("LoRA fb ckpt"),
                     mem("LoRA fb ckpt"),
                     runner.cell("base fb", lambda s: f"{tokens / s:,.0f}"), mfu("base fb"),
                     runner.cell("sample", lambda s: f"{n_prompts * new_tokens / s:,.0f}"), mem("sample")))
        runner.kinds = {}  # let the models go before the next family's are built
        del base, full, lora, model, data, batch
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\n[real-small] REAL_SMALL shapes ({dtype_name(dtype)}, {device}, layers={args.layers or 'as given'}, "
          f"shrink={args.shrink}): forward_backward of {datums} datums x {length} tokens = {tokens} tokens "
          f"(cross_entropy), rank-{args.rank} LoRA; sampling {n_prompts} prompts x {PROMPT_TOKENS} + {new_tokens} "
          f"new tokens; median of {args.reps} after {args.warmup} warm-up; MFU against "
          f"{f'{peak:g} TFLOP/s' if peak else 'no peak given (--peak-tflops)'}; GiB = "
          f"torch.cuda.max_memory_allocated during the call, everything resident included (the base, the full "
          f"session's copy and its gradients; no optim_step is run)")
    print_table(["family", "shape of", "params", "active", "LoRA params", "full fb tok/s", "MFU", "GiB",
                 "LoRA fb tok/s", "MFU", "GiB", "LoRA ckpt tok/s", "MFU", "GiB", "base fb tok/s", "MFU",
                 "sample tok/s", "GiB"], rows)
    print_errors(runners)
    if device.type != "cuda":
        print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


# -- main -------------------------------------------------------------------------------------------------------


def family_list(text: str) -> str:
    if text not in FAMILIES:
        raise argparse.ArgumentTypeError(f"unknown family {text!r}; known: {', '.join(FAMILIES)}")
    return text


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", type=family_list, help="a subset (default: all; the moe part "
                                                                        "takes the MoE ones among them)")
    parser.add_argument("--table", action="store_true", help="the per-family table (default with --moe)")
    parser.add_argument("--moe", action="store_true", help="LoRA fb vs base fb on wider MoE configs")
    parser.add_argument("--counts", action="store_true", help="per-rank LoRA parameter counts of full-size configs")
    parser.add_argument("--shape", choices=["tiny", "real-small"], default="tiny",
                        help="tiny: the table and moe parts; real-small: REAL_SMALL shapes with MFU and memory")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="model dtype (default float32)")
    parser.add_argument("--rank", type=positive_int, default=8, help="LoRA rank (default 8)")
    parser.add_argument("--hidden", type=positive_int, default=_WIDE["hidden_size"],
                        help=f"moe: the hidden size (default {_WIDE['hidden_size']}; LoRA's fixed per-call costs weigh "
                             f"less as it grows)")
    parser.add_argument("--layers", type=positive_int, help="real-small: decoder layers (default: REAL_SMALL's 4)")
    parser.add_argument("--shrink", type=positive_int, default=1,
                        help="real-small: divide widths, vocabulary and expert counts by this (CPU smoke runs)")
    parser.add_argument("--datums", type=positive_int, help="real-small: datums per batch (default 8)")
    parser.add_argument("--seq-len", type=positive_int, help="real-small: tokens per datum (default 1024)")
    parser.add_argument("--prompts", type=positive_int, help="real-small: prompts sampled at once (default 64)")
    parser.add_argument("--new-tokens", type=positive_int, help="real-small: tokens sampled per prompt (default 128)")
    parser.add_argument("--peak-tflops", type=float, help="peak for MFU (default 989 on CUDA: H200 dense bf16)")
    parser.add_argument("--threads", type=positive_int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--reps", type=positive_int, default=5, help="timed reps (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed reps first (default 1)")
    parser.add_argument("--loss-backend", default="auto", help="LogprobComputer backend (the worker's default: auto)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    families = args.families or list(FAMILIES)

    started = time.perf_counter()
    print(f"families: {dtype_name(dtype)} on {device}, {args.threads} torch threads, LoRA rank {args.rank}; "
          f"{machine()}", flush=True)
    if args.shape == "real-small":
        chosen = [f for f in families if f in REAL_SMALL]
        if not chosen:
            parser.error(f"--shape real-small has shapes for {', '.join(REAL_SMALL)} only")
        run_real_small(chosen, args, device, dtype)
    else:
        if not (args.table or args.moe or args.counts):
            args.table = args.moe = True
        if args.table:
            run_table(families, args, device, dtype)
        if args.moe:
            chosen = [f for f in families if f in MOE_FAMILIES]
            if chosen:
                run_moe(chosen, args, device, dtype)
        if args.counts:
            run_counts()
    print(f"\ntotal {time.perf_counter() - started:.0f} s; {machine()}")


if __name__ == "__main__":
    main()

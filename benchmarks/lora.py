"""LoRA sessions: how many fit beside one base, a mixed pass over many tenants, and a LoRA step vs a full step.

Three parts, in process (no Redis, no worker process), each with its baseline measured or computed in the
same run; nothing asserts on timings. Model: the ~20M-parameter Llama of train_step.py (``LLAMA_20M``,
random weights, seed 0, saved with ``save_pretrained`` and loaded back), float32. Adapters: rank 32 on the
attention, MLP and output projections (``train_attn``/``train_mlp``/``train_unembed`` all True).

* ``--tenants``: how many rank-32 LoRA sessions fit beside the base in ``--budget-gib`` against how many
  full-parameter sessions, from the adapter's parameter count (``find_targets`` + ``parameters_per_rank``,
  16 bytes per parameter: float32 weights, pending gradients, two AdamW moments) and
  ``memory.session_state_bytes`` (+ the one shared ``training_working_bytes`` room the worker's admission
  asks for) for full sessions. Then the same formulas for Llama-3.2-1B and Llama-3.1-8B shapes (built on
  the meta device, bfloat16 base) in an ``--gpu-gib`` GPU minus the base. Activations are left out of both.
* ``--mixed``: 16 tenants each send one forward_backward of one 128-token datum (cross_entropy): one mixed
  pass over all 16 (``tinkerq.worker.lora.batch.run_pass`` with 16 ``LossItem``) against the same 16 requests one
  after another (``run_pass`` with one item each, and ``LoraSession.run_loss``), alternating rep by rep,
  median after a warm-up. Also checks that the mixed losses equal the one-at-a-time ones (bitwise: the pass is
  batch-invariant), and measures, as the ceiling batching can reach on this machine without any LoRA code, the
  same tokens through a plain trainable copy of the base (same loss head): one (16, 128) forward + backward vs
  16 of (1, 128). Diagnostics: the same pass with its products stacked over the tenants
  (``routing.PRODUCTS = "stacked"``: faster, no longer bitwise), the other bitwise layout, fixed-shape tiles
  (``routing.PRODUCTS = "tiles"``), mixed and one at a time, a frozen copy of the base (input gradients only: the
  base's share of a LoRA pass) batched and one at a time, and with ``--before REV`` the pass of
  ``worker/lora/batch.py`` at git revision REV (imported from ``git show``; run with the products stacked, which
  is how that code ran, e.g. 42d3d33, before batch invariance). ``--varied``: datum lengths drawn in 64..192
  instead of 128 (micro-batches of different padded lengths do not share a forward).
* ``--step``: a LoRA step (forward_backward + optim_step) against a full-parameter step (``TrainingSession``)
  on the same batch of 8 datums x 128 tokens, alternating, median seconds per step; plus, as a diagnostic,
  the same adapter without the output projection (``train_unembed=False``).

    .venv/bin/python benchmarks/lora.py [--tenants] [--mixed] [--step] [--threads 2] [--reps 3] [--warmup 1]
                                        [--varied] [--before REV]

``--device cuda`` runs parts 2 and 3 on a GPU (synchronising around each timed call), still in float32.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _fleet import ROOT, build_llama, machine, median, print_table
from train_step import LLAMA_20M
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tinkerq import types
from tinkerq.worker import memory
from tinkerq.worker.lora import routing
from tinkerq.worker.lora.adapter import find_targets, parameters_per_rank
from tinkerq.worker.lora.batch import LossItem, run_pass
from tinkerq.worker.lora.session import LoraBase, LoraSession
from tinkerq.worker.training.logprobs import LogprobComputer
from tinkerq.worker.training.session import TrainingSession

RANK = 32
TENANTS, TENANT_TOKENS = 16, 128
STEP_DATUMS, STEP_TOKENS = 8, 128
MICROBATCH_TOKENS = 16384  # the worker's default (tinkerq/settings.py)
TARGET_MIXED = 1.12  # issue 29: >= 1.12x one request at a time, still bitwise equal to each tenant alone
GIB = 2**30
ADAM = types.AdamParams(learning_rate=1e-4)
LLAMA_SHAPES: dict[str, dict[str, Any]] = {
    "Llama-3.2-1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "Llama-3.1-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}


def lora_config(seed: int, unembed: bool = True) -> types.LoraConfig:
    return types.LoraConfig(rank=RANK, seed=seed, train_attn=True, train_mlp=True, train_unembed=unembed)


def make_data(rng: np.random.Generator, n: int, length: int, vocab: int) -> list[types.Datum]:
    data = []
    for _ in range(n):
        seq = rng.integers(0, vocab, length + 1, dtype=np.int64)
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
            loss_fn_inputs={"target_tokens": seq[1:], "weights": rng.uniform(0.5, 1.5, length).astype(np.float32)},
        ))
    return data


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.3f}"


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


# -- 1. tenants -------------------------------------------------------------------------------------------------


def capacity(model: torch.nn.Module, budget: int) -> dict[str, Any]:
    """Sessions of each kind that fit in ``budget`` bytes beside ``model`` (the base), by the worker's formulas."""
    shape = memory.ModelShape.of(model)
    base = shape.param_bytes + shape.buffer_bytes
    lora_params = RANK * sum(parameters_per_rank(find_targets(model, lora_config(0))).values())
    lora_bytes = memory.LORA_BYTES_PER_PARAMETER * lora_params
    full_bytes = memory.session_state_bytes(shape)
    working = memory.training_working_bytes(shape)  # one shared room, as admit_session asks for it
    free = budget - base
    n_lora = max(0, free // lora_bytes)
    n_full = max(0, (free - working) // full_bytes)
    n_full_state = max(0, free // full_bytes)
    return dict(params=sum(p.numel() for p in model.parameters()), base=base, lora_params=lora_params,
                lora_bytes=lora_bytes, full_bytes=full_bytes, working=working, n_lora=n_lora, n_full=n_full,
                n_full_state=n_full_state)


def run_tenants(model: torch.nn.Module, args: argparse.Namespace) -> None:
    rows = []
    cases: list[tuple[str, torch.nn.Module, int]] = [("20M bench model (float32, CPU)", model,
                                                      int(args.budget_gib * GIB))]
    for name, shape in LLAMA_SHAPES.items():
        with torch.device("meta"):
            meta = LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16)
        cases.append((f"{name} (bf16, meta)", meta, int(args.gpu_gib * GIB)))
    for name, m, budget in cases:
        c = capacity(m, budget)
        ratio = f"{c['n_lora'] / c['n_full']:.1f}" if c["n_full"] else "- (no full session fits)"
        rows.append((name, f"{c['params'] / 1e6:,.1f}M", gib(budget), gib(c["base"]),
                     f"{c['lora_params'] / 1e6:.2f}M", mib(c["lora_bytes"]), mib(c["full_bytes"]),
                     mib(c["working"]), c["n_lora"], c["n_full"], c["n_full_state"], ratio))
    print(f"\n[tenants] rank-{RANK} LoRA (attn+mlp+unembed, {memory.LORA_BYTES_PER_PARAMETER} B/param) vs full "
          f"sessions (memory.session_state_bytes, + one shared training_working_bytes room); budget minus the "
          f"base; activations not counted")
    print_table(["model", "params", "budget GiB", "base GiB", "LoRA params", "LoRA MiB", "full MiB",
                 "full working MiB", "LoRA fit", "full fit", "full fit w/o working", "LoRA/full"], rows)


# -- 2. mixed ---------------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


@contextlib.contextmanager
def products(layout: str) -> Iterator[None]:
    """Passes in this block run their products as ``layout`` says (``routing.PRODUCTS``: tiles, groups, stacked)."""
    before, routing.PRODUCTS = routing.PRODUCTS, layout
    try:
        yield
    finally:
        routing.PRODUCTS = before


@contextlib.contextmanager
def stacked_products() -> Iterator[None]:
    """The pass with its products over all tenants' rows at once (not batch-invariant): a diagnostic."""
    with products("stacked"):
        yield


def load_before(rev: str) -> Any:
    """``worker/lora/batch.py`` at git revision ``rev``, as a module of its own (its run_pass and LossItem)."""
    source = subprocess.run(["git", "show", f"{rev}:worker/lora/batch.py"], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout
    spec = importlib.util.spec_from_loader(f"lora_batch_{rev}", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:worker/lora/batch.py", "exec"), module.__dict__)
    return module


def run_mixed(base: LoraBase, model_dir: Path, vocab: int, args: argparse.Namespace) -> None:
    tenants = [LoraSession(f"t{i}", base, lora_config(100 + i), base_model="bench") for i in range(TENANTS)]
    for i, t in enumerate(tenants):  # nonzero B: every adapter changes its own rows, so a mix-up would show
        gen = torch.Generator().manual_seed(1000 + i)
        with torch.no_grad():
            for name, p in t.adapter.named_pairs():
                if name.endswith("lora_B.weight"):
                    p.add_(torch.randn(p.shape, generator=gen).to(p.device), alpha=0.02)
    rng = np.random.default_rng(1)
    lengths = [int(n) for n in rng.integers(64, 193, TENANTS)] if args.varied else [TENANT_TOKENS] * TENANTS
    requests = [make_data(rng, 1, n, vocab) for n in lengths]
    before = load_before(args.before) if args.before else None

    def pass_over(group: list[tuple[LoraSession, list[types.Datum]]], module: Any = None) -> list[float]:
        item_cls, run = (module.LossItem, module.run_pass) if module is not None else (LossItem, run_pass)
        items = [item_cls(t, data, "cross_entropy", None) for t, data in group]
        run(items, base.model, base.logprobs, head=base.head, microbatch_tokens=base.microbatch_tokens,
            device=base.device, backward=True)
        for item in items:
            if item.error is not None:
                raise item.error
        return [item.output.metrics["loss:sum"] for item in items]  # type: ignore[union-attr]

    def stacked(module: Any = None) -> list[float]:
        with stacked_products():
            return pass_over(pairs, module)

    def in_tiles(fn: Callable[[], list[float]]) -> list[float]:
        with products("tiles"):
            return fn()

    # The ceiling batching can reach on this machine without any LoRA code: a trainable copy of the base, the
    # same loss head (LogprobComputer) and tokens, forward + backward of one (16, 128) batch vs 16 of (1, 128)
    # (--varied: right-padded to the longest row).
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(base.device).eval()
    plain_logprobs = LogprobComputer(plain, args.loss_backend)
    rows = [(torch.as_tensor(d[0].model_input.to_ints(), device=base.device),
             torch.as_tensor(np.asarray(d[0].loss_fn_inputs["target_tokens"].to_numpy()), device=base.device),
             torch.as_tensor(np.asarray(d[0].loss_fn_inputs["weights"].to_numpy()), device=base.device))
            for d in requests]

    # The base's share of a LoRA pass, without the adapters: a frozen copy whose backward computes input gradients
    # through every layer (its embeddings' output asks for them, as the first adapted projection's input does) and
    # no weight gradients. Batched against one at a time it bounds what batching can gain a LoRA pass whose adapters
    # cost nothing.
    frozen = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(base.device).eval()
    frozen.requires_grad_(False)
    frozen.get_input_embeddings().register_forward_hook(lambda _m, _a, out: out.requires_grad_())
    frozen_logprobs = LogprobComputer(frozen, args.loss_backend)

    def plain_fb(group: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], model: Any = None,
                 logprobs: Any = None) -> list[float]:
        tokens, targets, weights, mask = (torch.nn.utils.rnn.pad_sequence(list(x), batch_first=True)
                                          for x in zip(*[(*r, torch.ones_like(r[0])) for r in group], strict=True))
        lp = (logprobs or plain_logprobs)(model or plain, tokens, mask, targets)
        losses = -(lp * weights).sum(dim=1)
        losses.sum().backward()
        return losses.tolist()

    def plain_way(batched: bool) -> list[float]:
        out = plain_fb(rows) if batched else [plain_fb([r])[0] for r in rows]
        for p in plain.parameters():
            p.grad = None
        return out

    def frozen_way(batched: bool, per_request: bool = False) -> list[float]:
        if not batched:
            return [plain_fb([r], frozen, frozen_logprobs)[0] for r in rows]
        if not per_request:
            return plain_fb(rows, frozen, frozen_logprobs)
        # the bitwise pass's layout without adapters: each request's rows a routing group of its own, so every
        # product over the batch, the loss head's too, runs per request (routing.PRODUCTS = "groups")
        with routing.routed([(None, slice(i, i + 1)) for i in range(len(rows))], head=base.head,
                            length=len(rows[0][0])):
            return plain_fb(rows, frozen, frozen_logprobs)

    pairs = list(zip(tenants, requests, strict=True))
    ways: dict[str, Callable[[], list[float]]] = {
        f"mixed: one run_pass of {TENANTS} requests": lambda: pass_over(pairs),
        f"one at a time: {TENANTS} x run_pass of 1": lambda: [pass_over([p])[0] for p in pairs],
        f"one at a time: {TENANTS} x LoraSession.run_loss": lambda: [
            t.run_loss(d, "cross_entropy", None, backward=True).metrics["loss:sum"] for t, d in pairs],
        f"no LoRA, trainable base: one fb of {TENANTS} datums": lambda: plain_way(True),
        f"no LoRA, trainable base: {TENANTS} fb of 1 datum": lambda: plain_way(False),
        "diagnostic: mixed, products stacked (not bitwise)": stacked,
        f"diagnostic: no LoRA, frozen base: one fb of {TENANTS} datums": lambda: frozen_way(True),
        f"diagnostic: no LoRA, frozen base: {TENANTS} fb of 1 datum": lambda: frozen_way(False),
        f"diagnostic: no LoRA, frozen base: one fb of {TENANTS}, products per request": lambda: frozen_way(True, True),
        "products in tiles: mixed": lambda: in_tiles(lambda: pass_over(pairs)),
        "products in tiles: one at a time": lambda: in_tiles(lambda: [pass_over([p])[0] for p in pairs]),
    }
    if before is not None:
        ways[f"before ({args.before}): one run_pass of {TENANTS} requests"] = lambda: stacked(before)
    times: dict[str, list[float]] = {k: [] for k in ways}
    losses: dict[str, list[float]] = {}
    for rep in range(args.warmup + args.reps):
        line = []
        for name, fn in ways.items():
            elapsed, losses[name] = timed(fn, base.device)
            line.append(f"{elapsed:.3f}")
            if rep >= args.warmup:
                times[name].append(elapsed)
        print(f"  mixed rep {rep}{' (warm-up)' if rep < args.warmup else ''}: " + " / ".join(line) + " s",
              flush=True)

    tokens = sum(lengths)
    mixed_name, seq_name, solo_name, plain_batched, plain_seq, *diagnostics = ways
    baseline = median(times[seq_name])
    shape = f"{min(lengths)}..{max(lengths)}" if args.varied else f"{TENANT_TOKENS}"
    print(f"\n[mixed] {TENANTS} rank-{RANK} tenants x one forward_backward of 1 datum x {shape} tokens "
          f"(cross_entropy) = {tokens} tokens; {args.reps} reps after {args.warmup} warm-up, alternating")
    # per rep, one-at-a-time time / this path's time (same rep): robust to load that drifts across a run
    per_rep = {n: median([a / b for a, b in zip(times[seq_name], t, strict=True)]) for n, t in times.items()}
    print_table(["path", "median s", "min s", "tokens/s", "x one-at-a-time tokens/s", "median of per-rep x"],
                [(n, median(t), min(t), tokens / median(t), baseline / median(t), per_rep[n])
                 for n, t in times.items()])
    ratio = baseline / median(times[mixed_name])
    lora_paths = [d for d in diagnostics if "frozen base" not in d]  # the frozen base has no adapters: other losses
    for name, other in [(mixed_name, seq_name), (mixed_name, solo_name), *((d, seq_name) for d in lora_paths)]:
        diff = max(abs(a - b) for a, b in zip(losses[name], losses[other], strict=True))
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses[name], losses[other], strict=True))
        label = "mixed" if name == mixed_name else name.replace(f"one run_pass of {TENANTS} requests", "pass")
        print(f"loss:sum {label} vs {other.split(': ')[1]}: "
              f"{'bitwise equal' if diff == 0 else f'max abs diff {diff:.3e} (max relative {rel:.2e})'} over "
              f"{TENANTS} tenants (losses {min(losses[other]):.2f}..{max(losses[other]):.2f})")
    ceiling = median(times[plain_seq]) / median(times[plain_batched])
    print(f"batching without LoRA (same tokens, same loss head, trainable base): {ceiling:.2f}x tokens/s; "
          f"the mixed LoRA pass takes {median(times[mixed_name]) / median(times[plain_batched]):.2f}x the time "
          f"of that plain batched pass")
    for name in diagnostics:
        print(f"{name}: {baseline / median(times[name]):.2f}x one-at-a-time tokens/s; the mixed pass takes "
              f"{median(times[mixed_name]) / median(times[name]):.2f}x its time")
    frozen_batched, frozen_seq, frozen_groups = (median(times[n]) for n in ways if "frozen base" in n)
    adapters = baseline - frozen_seq  # the adapters' work (and routing) of the 16 requests one at a time
    print(f"frozen base (a LoRA pass's base work, no adapters): batching gains it {frozen_seq / frozen_batched:.2f}x "
          f"with products stacked, {frozen_seq / frozen_groups:.2f}x with products per request; the adapters' work "
          f"one at a time, by difference: {adapters:.3f} s of {baseline:.3f} s; so a mixed pass whose adapters cost "
          f"what they cost one at a time could reach {baseline / (frozen_batched + adapters):.2f}x stacked and "
          f"{baseline / (frozen_groups + adapters):.2f}x bitwise (products per request)")
    tiles_mixed, tiles_seq = (n for n in ways if n.startswith("products in tiles"))
    t_mixed, t_seq = median(times[tiles_mixed]), median(times[tiles_seq])
    print(f"products in tiles (routing.PRODUCTS = 'tiles'): mixed {t_seq / t_mixed:.2f}x its one at a time; against "
          f"products per group (the default): mixed {median(times[mixed_name]) / t_mixed:.2f}x, one at a time "
          f"{baseline / t_seq:.2f}x their speed")
    best = min(times[seq_name]) / min(times[mixed_name])
    print(f"RATIO mixed/one-at-a-time tokens/s: median {ratio:.2f}x, best-of {best:.2f}x "
          f"(target >= {TARGET_MIXED}x: {'met' if ratio >= TARGET_MIXED else 'NOT met'})")


# -- 3. step ----------------------------------------------------------------------------------------------------


def run_step(base: LoraBase, model_dir: Path, vocab: int, device: torch.device, args: argparse.Namespace) -> None:
    full_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    full = TrainingSession("full", full_model, base_dir=str(model_dir), microbatch_tokens=MICROBATCH_TOKENS,
                           logprobs=LogprobComputer(full_model, args.loss_backend),
                           blank_model=lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    lora = LoraSession("lora", base, lora_config(7), base_model="bench")
    # A diagnostic: the same adapter without the output projection, to show what adapting it costs.
    no_head = LoraSession("lora-no-unembed", base, lora_config(7, unembed=False), base_model="bench")
    data = make_data(np.random.default_rng(2), STEP_DATUMS, STEP_TOKENS, vocab)

    def step(session: Any) -> tuple[float, float, float]:
        fb_s, out = timed(lambda: session.run_loss(data, "cross_entropy", None, backward=True), device)
        opt_s, _ = timed(lambda: session.optim_step(ADAM), device)
        return fb_s, opt_s, out.metrics["loss:sum"]

    kinds = {"LoRA rank 32": lora, "LoRA rank 32, no unembed (diagnostic)": no_head, "full-parameter": full}
    fb: dict[str, list[float]] = {k: [] for k in kinds}
    opt: dict[str, list[float]] = {k: [] for k in kinds}
    first_loss: dict[str, float] = {}
    for rep in range(args.warmup + args.reps):
        line = []
        for name, session in kinds.items():
            fb_s, opt_s, loss = step(session)
            first_loss.setdefault(name, loss)
            line.append(f"{name} {fb_s:.3f} + {opt_s:.3f} s (loss {loss:.2f})")
            if rep >= args.warmup:
                fb[name].append(fb_s)
                opt[name].append(opt_s)
        print(f"  step rep {rep}{' (warm-up)' if rep < args.warmup else ''}: " + "; ".join(line), flush=True)

    total = {k: [a + b for a, b in zip(fb[k], opt[k], strict=True)] for k in kinds}
    baseline = median(total["full-parameter"])
    tokens = STEP_DATUMS * STEP_TOKENS
    print(f"\n[step] forward_backward + optim_step (AdamW), {STEP_DATUMS} datums x {STEP_TOKENS} tokens = {tokens} "
          f"tokens, cross_entropy; {args.reps} reps after {args.warmup} warm-up, alternating")
    print_table(["session", "trained params", "state MiB (measured)", "fb median s", "optim median s",
                 "step median s", "step min s", "x full step"],
                [(name, f"{sum(p.numel() for p in s.engine.params):,}", mib(s.engine.state_bytes()),
                  median(fb[name]), median(opt[name]), median(total[name]), min(total[name]),
                  median(total[name]) / baseline) for name, s in kinds.items()])
    shape = memory.ModelShape.of(full_model)
    lora_formula = memory.LORA_BYTES_PER_PARAMETER * sum(p.numel() for p in lora.engine.params)
    full_measured = full.engine.state_bytes() + shape.buffer_bytes
    full_formula = memory.session_state_bytes(shape)
    lora_measured = lora.engine.state_bytes()
    print(f"state check (engine.state_bytes() after the steps vs the formulas of part 1): LoRA "
          f"{lora_measured:,} B vs 16 B/param {lora_formula:,} B ({lora_measured - lora_formula:+,} "
          f"B: AdamW's step counters); full {full_measured:,} B (with buffers) vs session_state_bytes "
          f"{full_formula:,} B ({full_measured - full_formula:+,} B)")
    a, b = first_loss["LoRA rank 32"], first_loss["full-parameter"]
    print(f"first-step loss (B = 0: the LoRA model is the base): LoRA {a:.6f} vs full {b:.6f}, "
          f"relative diff {abs(a - b) / abs(b):.2e}")
    print(f"RATIO LoRA/full step time: median {median(total['LoRA rank 32']) / baseline:.3f}x "
          f"(forward_backward {median(fb['LoRA rank 32']) / median(fb['full-parameter']):.3f}x, optim_step "
          f"{median(opt['LoRA rank 32']) / median(opt['full-parameter']):.3f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", action="store_true", help="part 1: sessions that fit in a memory budget")
    parser.add_argument("--mixed", action="store_true", help="part 2: one mixed pass vs one request at a time")
    parser.add_argument("--step", action="store_true", help="part 3: a LoRA step vs a full-parameter step")
    parser.add_argument("--budget-gib", type=float, default=16.0, help="part 1, 20M model (GiB = 2**30 bytes)")
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="part 1, the 1B / 8B shapes")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--loss-backend", default="auto", help="LogprobComputer backend (the worker's default: auto)")
    parser.add_argument("--varied", action="store_true", help="part 2: datum lengths drawn in 64..192, not 128")
    parser.add_argument("--before", metavar="REV", help="part 2: also time worker/lora/batch.py at git revision REV")
    args = parser.parse_args()
    if not (args.tenants or args.mixed or args.step):
        args.tenants = args.mixed = args.step = True
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_llama(Path(tmp) / "llama-20m", seed=0, **LLAMA_20M)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
        n_params = sum(p.numel() for p in model.parameters())
        base = LoraBase(model, LogprobComputer(model, args.loss_backend), model_dir=str(model_dir),
                        microbatch_tokens=MICROBATCH_TOKENS)
        print(f"lora: {n_params / 1e6:.2f}M-parameter Llama, float32 on {device}, {args.threads} torch threads, "
              f"loss head {base.logprobs.backend}, micro-batches of {MICROBATCH_TOKENS} tokens; {machine()}",
              flush=True)
        if args.tenants:
            run_tenants(model, args)
        if args.mixed:
            run_mixed(base, model_dir, LLAMA_20M["vocab_size"], args)
        if args.step:
            run_step(base, model_dir, LLAMA_20M["vocab_size"], device, args)
    print(f"\ntotal {time.perf_counter() - started:.0f} s; {machine()}")


if __name__ == "__main__":
    main()

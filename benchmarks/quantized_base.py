"""A LoRA base kept quantized against the same base dequantized: memory and the time of one forward_backward.

Each variant runs in a child process of its own (same model, same seed, same request), so their RSS is comparable:
the model is a Qwen3-MoE built from its config, its routed experts quantized in block FP8 (128 x 128, one tensor per
expert as DeepSeek-V3 and Qwen3's FP8 checkpoints ship them; ``--format int4`` or ``mxfp4`` for the others) with
worker/checkpoints/quant_formats.py, the dequantized weights written back; ``keep`` then keeps the stored tensors
(worker/loading/quantized_base.py). Printed per variant: RSS after loading, peak RSS over a LoRA forward_backward (on
CUDA:
torch's allocated and peak bytes), and the step's median time; then the ratios.

    python benchmarks/quantized_base.py                       # CPU, float32
    python benchmarks/quantized_base.py --device cuda --dtype bfloat16 --hidden 2048 --experts 64 --layers 8

Figures and the design: docs/quantized.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _quantize(model: Any, fmt: str) -> dict[str, Any]:
    """The routed experts' stored tensors by checkpoint name; the float model gets their dequantized values."""
    import torch

    from tinkerq.worker.checkpoints import quant_formats as qf

    stored: dict[str, Any] = {}
    with torch.no_grad():
        for name, m in model.named_modules():
            if not (isinstance(getattr(m, "down_proj", None), torch.nn.Parameter) and m.down_proj.dim() == 3):
                continue
            inter = m.down_proj.shape[2]
            for e in range(m.down_proj.shape[0]):
                for proj, rows in (("gate_proj", m.gate_up_proj[e, :inter]), ("up_proj", m.gate_up_proj[e, inter:]),
                                   ("down_proj", m.down_proj[e])):
                    w = rows.float()
                    if fmt == "fp8":
                        q, s = qf.quantize_fp8_blocks(w, (128, 128))
                        t = qf.QuantizedTensor(qf.FP8_BLOCK, {"weight": q, "scale_inv": s}, tuple(w.shape), (128, 128))
                    elif fmt == "int4":
                        q, s = qf.quantize_int4_packed(w, 32)
                        t = qf.QuantizedTensor(qf.INT4_PACKED, {"packed": q, "scale": s}, tuple(w.shape), (32,))
                    else:
                        b, s = qf.quantize_mxfp4(w)
                        t = qf.QuantizedTensor(qf.MXFP4, {"blocks": b, "scales": s}, tuple(w.shape))
                    stored[f"{name}.{e}.{proj}.weight"] = t
                    rows.copy_(t.dequantize())
    return stored


def child(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch

    from tinkerq import types
    from tinkerq.allocator import trim_heap
    from tinkerq.recipes.families import build_model
    from tinkerq.worker.loading.quantized_base import keep_quantized
    from tinkerq.worker.lora.session import LoraBase, LoraSession
    from tinkerq.worker.training.logprobs import LogprobComputer

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    trim_heap()
    imports = _status("VmRSS") if device.type != "cuda" else 0  # the interpreter, torch and transformers
    model = build_model("qwen3_moe", 0, hidden_size=args.hidden, moe_intermediate_size=args.intermediate,
                        num_experts=args.experts, num_hidden_layers=args.layers, mlp_only_layers=[],
                        intermediate_size=args.intermediate, num_attention_heads=8, num_key_value_heads=4,
                        head_dim=args.hidden // 8, vocab_size=1024)
    stored = _quantize(model, args.format)
    model.to(device, dtype)
    stats = None
    if args.variant == "keep":
        stats = keep_quantized(model, stored)
    del stored
    trim_heap()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    loaded = torch.cuda.memory_allocated(device) if cuda else _status("VmRSS")
    base = LoraBase(model, LogprobComputer(model, "torch"), model_dir="/nonexistent", microbatch_tokens=4096)
    session = LoraSession("bench", base, types.LoraConfig(rank=8, seed=1), base_model="bench")
    rng = np.random.default_rng(0)
    data = [types.Datum(model_input=types.ModelInput.from_ints(rng.integers(0, 1024, args.tokens).tolist()),
                        loss_fn_inputs={"target_tokens": rng.integers(0, 1024, args.tokens).tolist(),
                                        "weights": np.ones(args.tokens, dtype=np.float32)})
            for _ in range(args.datums)]
    out = session.run_loss(data, "cross_entropy", None, backward=True)  # warm up; the numbers compared
    logprobs = [float(x) for o in out.loss_fn_outputs for x in o["logprobs"].to_numpy()]
    times = []
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    else:
        trim_heap()
        start = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        session.run_loss(data, "cross_entropy", None, backward=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated(device) if cuda else start + (_status("VmHWM") - start))
    return {"variant": args.variant, "imports_bytes": imports, "loaded_bytes": loaded, "peak_bytes": peak,
            "step_s": statistics.median(times), "loss": out.metrics["loss:sum"], "logprobs": logprobs,
            "stored_bytes": stats.stored_bytes if stats else None,
            "dequantized_bytes": stats.dequantized_bytes if stats else None,
            "largest_module_bytes": stats.largest_module_bytes if stats else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--format", default="fp8", choices=["fp8", "int4", "mxfp4"])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--datums", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--variant", choices=["dequantize", "keep"], help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(child(args)))
        return
    flags = sys.argv[1:]
    results = {}
    for variant in ("dequantize", "keep"):
        out = subprocess.run([sys.executable, __file__, *flags, "--variant", variant], check=True,
                             capture_output=True, text=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    what = "CUDA allocated" if args.device.startswith("cuda") else "RSS"
    mib = 1 << 20
    print(f"Qwen3-MoE, {args.layers} layers x {args.experts} experts ({args.hidden} x {args.intermediate}), routed "
          f"experts in {args.format}, {args.device} {args.dtype}; LoRA rank 8 forward_backward of {args.datums} x "
          f"{args.tokens} tokens, median of {args.repeat}")
    keep = results["keep"]
    print(f"expert weights: {keep['dequantized_bytes'] / mib:,.1f} MiB dequantized, {keep['stored_bytes'] / mib:,.1f} "
          f"MiB stored, largest layer {keep['largest_module_bytes'] / mib:,.1f} MiB")
    print(f"{'variant':<11} {what + ' loaded, MiB':>22} {'(model alone)':>14} {'peak in step, MiB':>18} "
          f"{'(above loaded)':>15} {'step, s':>8}")
    for variant, r in results.items():
        alone = (r["loaded_bytes"] - r["imports_bytes"]) / mib
        print(f"{variant:<11} {r['loaded_bytes'] / mib:>22,.1f} {alone:>14,.1f} "
              f"{r['peak_bytes'] / mib:>18,.1f} {(r['peak_bytes'] - r['loaded_bytes']) / mib:>15,.1f} "
              f"{r['step_s']:>8.3f}")
    d = results["dequantize"]
    diff = max(abs(a - b) for a, b in zip(keep["logprobs"], d["logprobs"], strict=True))
    print(f"the same LoRA request on both: loss {d['loss']:.6f} dequantized, {keep['loss']:.6f} kept; logprobs differ "
          f"by at most {diff:.2e}")
    model_keep, model_deq = (r["loaded_bytes"] - r["imports_bytes"] for r in (keep, d))
    print(f"keep / dequantize: model loaded {model_keep / model_deq:.2f}x, process peak "
          f"{keep['peak_bytes'] / d['peak_bytes']:.2f}x, step time {keep['step_s'] / d['step_s']:.2f}x")


if __name__ == "__main__":
    main()

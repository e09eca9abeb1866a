"""Peak memory and time of the loss head's forward + backward: chunked backends vs the full-logits reference.

Each (shape, backend) runs in its own process so peak memory is that process's alone. The measured part
is: target logprobs from hidden (T, H) and weight (V, H), a weighted sum, and backward to both inputs.
Peak memory is the growth of the process's peak RSS (VmHWM, reset after the inputs are built) over its RSS
before the first step (CPU), or torch's peak allocated bytes over what the inputs hold (CUDA).

    .venv/bin/python benchmarks/loss_head.py                     # CPU, float32, both shapes
    .venv/bin/python benchmarks/loss_head.py --device cuda --dtype bfloat16 --backends reference torch apex
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(2048, 512, 32000), (8192, 896, 151936)]


def _proc_status_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux), so transient input-building memory is not counted."""
    Path("/proc/self/clear_refs").write_text("5")


def run_one(t: int, h: int, v: int, backend: str, device: str, dtype: str, reps: int) -> dict:
    """Runs inside the child process."""
    sys.path.insert(0, str(ROOT))
    import torch

    from tinkerq.worker.loss_head import target_logprobs_from_hidden

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    hidden = (torch.randn(t, h, device=device) * 0.5).to(dt).requires_grad_(True)
    weight = (torch.randn(v, h, device=device) * 0.02).to(dt).requires_grad_(True)
    targets = torch.randint(0, v, (t,), device=device)
    weights = torch.rand(t, device=device)
    chunk = max(16, min(8192, (128 * 1024 * 1024) // (4 * v)))  # the worker's rule

    def step() -> float:
        out = target_logprobs_from_hidden(hidden, weight, targets, backend=backend, chunk_tokens=chunk)
        loss = -(out * weights).sum()
        loss.backward()
        hidden.grad = None
        weight.grad = None
        return float(loss)

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        _reset_peak_rss()
        base = _proc_status_bytes("VmRSS")
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        loss = step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() if device == "cuda" else _proc_status_bytes("VmHWM")) - base
    return {"T": t, "H": h, "V": v, "backend": backend, "device": device, "dtype": dtype,
            "chunk_tokens": chunk, "peak_mb": peak / 2**20, "seconds": min(times), "loss": loss,
            "threads": torch.get_num_threads()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--backends", nargs="+", default=["reference", "torch"])
    p.add_argument("--shapes", nargs="+", default=[",".join(map(str, s)) for s in SHAPES], help="T,H,V ...")
    p.add_argument("--reps", type=int, default=1, help="timed repetitions (min is reported)")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        t, h, v, backend = args.child.split(",")
        print(json.dumps(run_one(int(t), int(h), int(v), backend, args.device, args.dtype, args.reps)))
        return

    results = []
    print(f"{'T':>6} {'H':>5} {'V':>7}  {'backend':<10} {'peak MB':>9} {'seconds':>8}  {'vs reference':>22}")
    for shape in args.shapes:
        t, h, v = (int(x) for x in shape.split(","))
        ref = None
        for backend in args.backends:
            cmd = [sys.executable, __file__, "--child", f"{t},{h},{v},{backend}", "--device", args.device,
                   "--dtype", args.dtype, "--reps", str(args.reps)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{t:>6} {h:>5} {v:>7}  {backend:<10} failed: {out.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results.append(r)
            if backend == "reference":
                ref = r
            ratio = ""
            if ref is not None and r is not ref:
                ratio = f"mem {r['peak_mb'] / ref['peak_mb']:.3f}x, time {r['seconds'] / ref['seconds']:.2f}x"
            print(f"{t:>6} {h:>5} {v:>7}  {backend:<10} {r['peak_mb']:>9.0f} {r['seconds']:>8.2f}  {ratio:>22}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""How exactly an adopted session continues: snapshot + replay against the uninterrupted run, on any device.

Adoption (docs/reliability.md) loads a session's automatic snapshot and applies the requests after it again.
This script does the same in one process with the worker's own session classes: a session trains ``--before``
steps, is saved (``save_state``, the snapshot's layout), trains ``--after`` more steps (the uninterrupted run);
a second session of the same kind loads the snapshot with its optimizer and replays those ``--after`` steps.
It prints the largest weight difference between the two. On the CPU it is 0 (bitwise: tests/test_adoption.py
asserts it through real workers); on a GPU, kernels may reduce in a different order from run to run, which
is what this measures, with and without ``torch.use_deterministic_algorithms``.

    .venv/bin/python benchmarks/replay_determinism.py [--device cuda] [--dtype bfloat16] [--deterministic]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from _fleet import build_llama, machine, print_table

from tinkerq import types

MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False)
ADAM = types.AdamParams(learning_rate=1e-3, weight_decay=0.01, grad_clip_norm=1.0)


def batches(n: int, seed: int) -> list[list[types.Datum]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        data = []
        for _ in range(4):
            length = int(rng.integers(64, 512))
            seq = rng.integers(0, MODEL["vocab_size"], length + 1)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                                    loss_fn_inputs={"target_tokens": seq[1:].tolist(),
                                                    "weights": np.ones(length, np.float32)}))
        out.append(data)
    return out


def make_session(kind: str, model_dir: Path, device: str, dtype: torch.dtype, name: str):
    from transformers import AutoModelForCausalLM

    from tinkerq.worker.lora.session import LoraBase, LoraSession
    from tinkerq.worker.training.logprobs import LogprobComputer
    from tinkerq.worker.training.session import TrainingSession

    def load() -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()

    model = load()
    if kind == "full":
        model.requires_grad_(True)
        return TrainingSession(name, model, base_dir=str(model_dir), microbatch_tokens=4096,
                               logprobs=LogprobComputer(model, "torch"), blank_model=load)
    base = LoraBase(model, LogprobComputer(model, "torch"), model_dir=str(model_dir), microbatch_tokens=4096)
    return LoraSession(name, base, types.LoraConfig(rank=16, seed=3), base_model="bench")


def weights(session) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in zip(session.engine.param_names, session.engine.params,
                                                                 strict=True)}


def run(kind: str, model_dir: Path, checkpoint_dir: str, args: argparse.Namespace) -> list:
    dtype = getattr(torch, args.dtype)
    plan = batches(args.before + args.after, seed=7)
    original = make_session(kind, model_dir, args.device, dtype, "a" * 32)
    for b in plan[:args.before]:
        original.run_loss(b, "cross_entropy", None, backward=True)
        original.optim_step(ADAM)
    path = original.save_state(checkpoint_dir, f"snap-{kind}", base_model="bench", seq_id=2 * args.before)
    for b in plan[args.before:]:
        original.run_loss(b, "cross_entropy", None, backward=True)
        original.optim_step(ADAM)
    adopted = make_session(kind, model_dir, args.device, dtype, "b" * 32)
    adopted.load_state(Path(path), optimizer=True)
    for b in plan[args.before:]:
        adopted.run_loss(b, "cross_entropy", None, backward=True)
        adopted.optim_step(ADAM)
    want, got = weights(original), weights(adopted)
    diff = max(float((want[n] - got[n]).abs().max()) for n in want)
    scale = max(float(want[n].abs().max()) for n in want)
    equal = all(torch.equal(want[n], got[n]) for n in want)
    return [kind, args.device, args.dtype, str(args.deterministic), args.after, f"{diff:.3g}", f"{diff / scale:.3g}",
            "yes" if equal else "no"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True) (and CUBLAS_WORKSPACE_CONFIG on CUDA)")
    parser.add_argument("--before", type=int, default=3)
    parser.add_argument("--after", type=int, default=5)
    args = parser.parse_args()
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    print(machine(), "|", torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_llama(Path(tmp) / "model", seed=0, **MODEL)
        rows = [run(kind, model_dir, tmp, args) for kind in ("full", "lora")]
    print_table(["session", "device", "dtype", "deterministic", "replayed steps", "max |diff|", "relative",
                 "bitwise"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Activation checkpointing per decoder layer (worker/training/checkpointing.py) in-process: a full session's
forward_backward with and without it, alternated rep by rep in one run: seconds per step, this process's peak RSS
growth during the step (``VmHWM``, reset before each), the estimate the worker admits it on, and whether the two
give the same loss and gradients (bitwise).

Models are built from a config with a fixed seed (no download): a dense Llama and a Qwen3-MoE, float32 on the CPU.

    .venv/bin/python benchmarks/checkpointing.py [--reps 3] [--datums 8] [--tokens 400] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

from _fleet import machine, median, peak_growth, print_table

MiB = 1 << 20
MODELS: dict[str, dict[str, Any]] = {
    "llama (8 layers, hidden 256)": dict(family="llama", hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                                          num_attention_heads=4, num_key_value_heads=2),
    "qwen3_moe (8 layers, hidden 256, 8 experts top-2)": dict(
        family="qwen3_moe", hidden_size=256, intermediate_size=768, moe_intermediate_size=256, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, head_dim=64),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--datums", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import numpy as np
    import torch

    from tinkerq import types
    from tinkerq.recipes.families import build_model
    from tinkerq.worker import memory
    from tinkerq.worker.training import checkpointing
    from tinkerq.worker.training.logprobs import LogprobComputer
    from tinkerq.worker.training.session import TrainingSession

    torch.set_num_threads(args.threads)
    print(f"machine: {machine()}; torch threads {args.threads}; {args.datums} datums of {args.tokens} tokens, "
          f"float32, one micro-batch; {args.reps} reps after a warm-up, alternated")
    rng = np.random.default_rng(0)
    rows, ratios = [], []
    for label, spec in MODELS.items():
        config = dict(spec)
        model = build_model(config.pop("family"), 0, **config)
        checkpointing.install(model)
        session = TrainingSession("bench", copy.deepcopy(model), base_dir="/nonexistent", microbatch_tokens=1 << 20,
                                  logprobs=LogprobComputer(model, "torch"),
                                  blank_model=lambda m=model: copy.deepcopy(m))
        vocab = model.config.vocab_size
        data = []
        for _ in range(args.datums):
            seq = rng.integers(1, vocab, size=args.tokens + 1)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                                    loss_fn_inputs={"target_tokens": seq[1:].tolist(),
                                                    "weights": np.ones(args.tokens, dtype=np.float32)}))
        shape = memory.ModelShape.of(model)
        got: dict[bool, list[tuple[int, float]]] = {False: [], True: []}
        grads: dict[bool, list[torch.Tensor]] = {}
        for rep in range(args.reps + 1):
            for on in ((False, True) if rep % 2 else (True, False)):
                measured = peak_growth(lambda s=session, d=data, c=on: s.run_loss(
                    d, "cross_entropy", None, backward=True, checkpointing=c))
                grads[on] = [g.clone() for g in session.engine.grads()]
                for g in session.engine.grads():
                    g.zero_()
                if rep:
                    got[on].append(measured)
        same = all(torch.equal(a, b) for a, b in zip(grads[True], grads[False], strict=True))
        for on in (False, True):
            est = memory.batch_bytes(shape, [args.tokens] * args.datums, microbatch_tokens=1 << 20, backward=True,
                                     chunk_tokens=session.logprobs.chunk_tokens, checkpointing=on)
            peak = median([p for p, _ in got[on]])
            rows.append((label, "on" if on else "off", median([s for _, s in got[on]]), peak / MiB, est / MiB,
                         est / peak))
        ratios.append((label, median([s for _, s in got[True]]) / median([s for _, s in got[False]]),
                       median([p for p, _ in got[True]]) / median([p for p, _ in got[False]]),
                       "yes" if same else "NO"))
    print()
    print_table(["model", "checkpointing", "s / forward_backward", "peak RSS growth MiB", "estimate MiB",
                 "estimate / peak"], rows)
    print()
    print_table(["model", "time on / off", "peak on / off", "same gradients"], ratios)


if __name__ == "__main__":
    main()

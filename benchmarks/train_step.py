"""One training step (forward_backward + optim_step) through the fleet vs the same step in process.

Model: a ~20M-parameter Llama (random weights, fixed seed) saved with save_pretrained; batch: 4 datums x
1024 tokens = 4096 tokens, float32. The worker runs with ``--threads T`` and one micro-batch
(TINKERQ_MICROBATCH_TOKENS=65536); the in-process baseline uses ``torch.set_num_threads(T)``, loads the
same directory with from_pretrained, and computes the same per-token logprobs (padded batch,
gather - logsumexp), the summed weighted cross-entropy, backward and a torch.optim.AdamW step. Fleet and
baseline steps alternate, so each runs while the other side is idle; both apply the same steps to the
same weights, so their losses must agree step by step (printed as a check).

The baseline always builds the full (B, T, V) logits. The worker's default loss head on CPU is chunked
(it never holds the full logits); ``--loss-backend reference`` makes the worker build full logits too,
which is the like-for-like comparison of the fleet's overhead.

    .venv/bin/python benchmarks/train_step.py [--reps 5] [--warmup 1] [--threads 2] [--loss-backend reference]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _fleet import Fleet, build_llama, machine, median, print_table
from transformers import AutoModelForCausalLM

from tinkerq import types

TARGET_RATIO = 1.05
DATUMS, SEQ = 4, 1024
LLAMA_20M: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6,
    num_key_value_heads=6, max_position_embeddings=2048, tie_word_embeddings=True,
)


def make_batch(vocab: int) -> list[types.Datum]:
    rng = np.random.default_rng(0)
    data = []
    for _ in range(DATUMS):
        seq = rng.integers(0, vocab, SEQ + 1, dtype=np.int64)
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1]),
            loss_fn_inputs={"target_tokens": seq[1:], "weights": rng.uniform(0.5, 1.5, SEQ).astype(np.float32)},
        ))
    return data


class InProcess:
    """The plain-PyTorch step the worker's forward_backward + optim_step amount to."""

    def __init__(self, model_dir: Path, adam: types.AdamParams) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=adam.learning_rate, betas=(adam.beta1, adam.beta2),
                                     eps=adam.eps, weight_decay=adam.weight_decay)

    def step(self, data: list[types.Datum]) -> float:
        # The same right-padded (B, T) batch the worker builds (all rows are full here).
        tokens = torch.from_numpy(np.stack([d.model_input.to_numpy() for d in data]))
        targets = torch.from_numpy(np.stack([d.loss_fn_inputs["target_tokens"].to_numpy() for d in data]))
        weights = torch.from_numpy(np.stack([d.loss_fn_inputs["weights"].to_numpy() for d in data]))
        mask = torch.ones_like(weights)
        logits = self.model(input_ids=tokens, attention_mask=mask.long(), use_cache=False).logits.float()
        logprobs = (logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)) * mask
        loss = (-logprobs * weights * mask).sum()
        loss.backward()
        logprobs.detach().numpy().copy()  # the per-token output the fleet returns
        self.opt.step()
        self.opt.zero_grad()
        return float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--loss-backend", help="worker loss head (TINKERQ_LOSS_BACKEND); default: the worker's")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    adam = types.AdamParams(learning_rate=1e-4)
    data = make_batch(LLAMA_20M["vocab_size"])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_llama(Path(tmp) / "llama-20m", **LLAMA_20M)
        env = {"TINKERQ_MICROBATCH_TOKENS": "65536"}  # one pass, like the baseline
        if args.loss_backend:
            env["TINKERQ_LOSS_BACKEND"] = args.loss_backend
        with Fleet(model_dir, threads=args.threads, env=env) as fleet:
            service = fleet.service()
            tc = service.create_training_client(str(fleet.model_dir)).result()
            local = InProcess(fleet.model_dir, adam)
            n_params = sum(p.numel() for p in local.model.parameters())
            fleet_s: list[float] = []
            local_s: list[float] = []
            loss_diffs: list[float] = []
            for rep in range(args.warmup + args.reps):
                t0 = time.perf_counter()
                fb, step = tc.forward_backward(data), tc.optim_step(adam)  # pipelined, as a client would
                fleet_loss = fb.result(timeout=600).metrics["loss:sum"]
                step.result(timeout=600)
                t1 = time.perf_counter()
                local_loss = local.step(data)
                t2 = time.perf_counter()
                loss_diffs.append(abs(fleet_loss - local_loss) / abs(local_loss))
                if rep >= args.warmup:
                    fleet_s.append(t1 - t0)
                    local_s.append(t2 - t1)
                print(f"  rep {rep}{' (warm-up)' if rep < args.warmup else ''}: fleet {t1 - t0:.3f} s, "
                      f"in-process {t2 - t1:.3f} s, loss {fleet_loss:.2f} vs {local_loss:.2f}", flush=True)
            backend = fleet.registration.get("loss_backend", "n/a")
            worker_fb = [ms / 1000 for ms in fleet.worker_ms("forward_backward")[-args.reps:]]
            worker_opt = [ms / 1000 for ms in fleet.worker_ms("optim_step")[-args.reps:]]
            tc.close()
            service.close()

    base = median(local_s)
    # Per rep: the fleet's wall time minus what the worker spent inside handle() for that step. This is
    # the transport + queueing cost, and it is far less sensitive to a noisy machine than the compute.
    logged = len(worker_fb) == len(worker_opt) == len(fleet_s)
    outside = [f - fb - opt for f, fb, opt in zip(fleet_s, worker_fb, worker_opt, strict=True)] if logged else []
    rows = [("fleet: forward_backward + optim_step", median(fleet_s), min(fleet_s), median(fleet_s) / base)]
    if logged:
        rows += [(name, median(t), min(t), median(t) / base) for name, t in (
            ("  worker handle() forward_backward (log)", worker_fb),
            ("  worker handle() optim_step (log)", worker_opt),
            ("  outside handle(): transport + queueing", outside),
        )]
    rows.append(("in-process: same step, plain PyTorch", base, min(local_s), 1.0))
    print(f"train_step: {n_params / 1e6:.2f}M-parameter Llama, {DATUMS}x{SEQ} = {DATUMS * SEQ} tokens, float32, "
          f"{args.threads} torch threads each side; worker loss head: {backend}; {args.reps} reps after "
          f"{args.warmup} warm-up; {machine()}")
    print_table(["path", "median s", "min s", "x in-process"], rows)
    ratio = median(fleet_s) / base
    print(f"loss agreement fleet vs in-process (max relative diff over all steps): {max(loss_diffs):.2e}")
    overhead = (f"; fleet/worker compute of the same rep: median "
                f"{median([f / (f - o) for f, o in zip(fleet_s, outside, strict=True)]):.3f}x" if logged else "")
    print(f"RATIO fleet/in-process: median {ratio:.3f}x, min {min(fleet_s) / min(local_s):.3f}x "
          f"(target <= {TARGET_RATIO}x: {'met' if ratio <= TARGET_RATIO else 'NOT met'}){overhead}")


if __name__ == "__main__":
    main()

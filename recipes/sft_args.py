"""Arguments of ``tinkerq sft`` (kept apart so ``tinkerq --help`` needs no torch)."""

from __future__ import annotations

import argparse


def add_sft_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", help="redis:// URL of a running fleet (default: an embedded fleet in this process)")
    p.add_argument("--model", help="model directory a worker serves (default: the demo model, built once)")
    p.add_argument("--train", help="JSONL of {prompt, completion} (default: the bundled data set)")
    p.add_argument("--eval", help="held-out JSONL of {prompt, completion} (default: the bundled one)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the demo's tuned value)")
    p.add_argument("--batch-size", type=int, help="examples per step")
    p.add_argument("--lr", type=float, help="peak AdamW learning rate")
    p.add_argument("--lr-schedule", choices=["linear", "constant"], default="linear",
                   help="linear: decay to 0 over the run (default)")
    p.add_argument("--eval-examples", type=int, default=100, help="held-out pairs to score (default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="run directory for metrics.jsonl and loss.png (default: runs/sft-<time>)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads of the embedded worker")

"""Arguments of ``tinkerq sft`` (kept apart so ``tinkerq --help`` needs no torch)."""

from __future__ import annotations

import argparse

from recipes.demo_model import DEFAULT_LR

# With --lora-rank the --lr defaults stay the same. LoRA usually wants about 10x a full fine-tune's rate
# (docs/lora.md), but that rule is about pretrained models' small rates (~1e-5 full, ~1e-4 LoRA); the demo's
# full-parameter rate (DEFAULT_LR, 2e-3) is already LoRA-sized. Measured on the demo model, `tinkerq sft
# --lora-rank 8 --lr X` (250 steps of 64, held-out exact match): 1e-3 22%, 2e-3 94%, 5e-3 76%, 2e-2 (10x) 0%
# (the loss stalls at 3.14, the unigram plateau), 5e-2 0%.
LORA_LR_HELP = "the same with --lora-rank (10x stalls on the demo; on a pretrained --model LoRA usually wants ~10x)"


def positive_int(text: str) -> int:
    """An argparse type: an integer > 0 (a clear usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer (> 0), got {value}")
    return value


def add_lora_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-rank", type=positive_int, metavar="R",
                   help="train a LoRA adapter of rank R over the frozen model (create_lora_training_client) "
                        "instead of every parameter (default: full-parameter); R > 0; see --lr")


def add_sft_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", help="redis:// URL of a running fleet (default: an embedded fleet in this process)")
    p.add_argument("--model", help="model directory a worker serves (default: the demo model, built once)")
    p.add_argument("--train", help="JSONL of {prompt, completion} (default: the bundled data set)")
    p.add_argument("--eval", help="held-out JSONL of {prompt, completion} (default: the bundled one)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the demo's tuned value)")
    p.add_argument("--batch-size", type=int, help="examples per step")
    p.add_argument("--lr", type=float,
                   help=f"peak AdamW learning rate (default: the demo's tuned value, {DEFAULT_LR:g}; {LORA_LR_HELP})")
    p.add_argument("--lr-schedule", choices=["linear", "constant"], default="linear",
                   help="linear: decay to 0 over the run (default)")
    add_lora_argument(p)
    p.add_argument("--eval-examples", type=int, default=100, help="held-out pairs to score (default 100)")
    p.add_argument("--seed", type=int, default=0, help="seeds the batches and a LoRA adapter's start (default 0)")
    p.add_argument("--out", help="run directory for metrics.jsonl and loss.png (default: runs/sft-<time>)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads of the embedded worker")

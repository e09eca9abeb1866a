"""Arguments of ``tinkerq sft``, and the argparse types of every command's numbers (kept apart so ``tinkerq
--help`` needs no torch). A number out of range is a usage error, never silently the default."""

from __future__ import annotations

import argparse
import math

from tinkerq.recipes.demo_model import DEFAULT_BATCH_SIZE, DEFAULT_LR, DEFAULT_STEPS

# With --lora-rank the --lr defaults stay the same. LoRA usually wants about 10x a full fine-tune's rate
# (docs/lora.md), but that rule is about pretrained models' small rates (~1e-5 full, ~1e-4 LoRA); the demo's
# full-parameter rate (DEFAULT_LR, 2e-3) is already LoRA-sized. Measured on the demo model, `tinkerq sft
# --lora-rank 8 --lr X` (250 steps of 64, held-out exact match): 1e-3 22%, 2e-3 94%, 5e-3 76%, 2e-2 (10x) 0%
# (the loss stalls at 3.14, the unigram plateau), 5e-2 0%.
LORA_LR_HELP = "the same with --lora-rank (10x stalls on the demo; on a pretrained --model LoRA usually wants ~10x)"


def positive_int(text: str) -> int:
    """An argparse type: an integer > 0 (a clear usage error otherwise)."""
    return _int_at_least(text, 1, "a positive integer (> 0)")


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    return _int_at_least(text, 0, "0 or a positive integer")


def port_or_zero(text: str) -> int:
    """An argparse type: a TCP port, or 0 for "off"."""
    value = _int_at_least(text, 0, "a port number (1-65535) or 0")
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (1-65535) or 0, got {value}")
    return value


def tcp_port(text: str) -> int:
    """An argparse type: a TCP port, 1-65535."""
    value = port_or_zero(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be a port number (1-65535), got 0")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (a learning rate, a timeout)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite positive number (> 0), got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite positive number (> 0), got {text}")
    return value


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
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
    p.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS,
                   help=f"optimizer steps (default {DEFAULT_STEPS}, tuned for the demo)")
    p.add_argument("--batch-size", type=positive_int, default=DEFAULT_BATCH_SIZE,
                   help=f"examples per step, at most the training set's size (default {DEFAULT_BATCH_SIZE})")
    p.add_argument("--lr", type=positive_float, default=DEFAULT_LR,
                   help=f"peak AdamW learning rate (default {DEFAULT_LR:g}, tuned for the demo; {LORA_LR_HELP})")
    p.add_argument("--lr-schedule", choices=["linear", "constant"], default="linear",
                   help="linear: decay to 0 over the run (default); constant: the peak rate throughout")
    add_lora_argument(p)
    p.add_argument("--eval-examples", type=positive_int, default=100,
                   help="held-out pairs to score (default 100)")
    p.add_argument("--seed", type=int, default=0, help="seeds the batches and a LoRA adapter's start (default 0)")
    p.add_argument("--out", help="run directory for metrics.jsonl and loss.png (default: runs/sft-<time>)")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads of the embedded worker (default: torch's)")

"""``tinkerq``: the command line.

    tinkerq sft                      fine-tune the demo model on the bundled data set (embedded fleet)
    tinkerq sft --broker redis://... the same job against a running fleet
    tinkerq rl                       RL with sampling and importance sampling on the demo task
    tinkerq worker --model PATH      serve a local Hugging Face model from a Redis fleet

Subcommands import their (heavy) modules only when they run, so ``tinkerq --help`` is instant.
"""

from __future__ import annotations

import argparse
import logging
import sys

from tinkerq.errors import TinkerqError
from tinkerq.settings import Settings


def _settings(args: argparse.Namespace, **extra: object) -> Settings:
    return Settings.from_env(broker_url=getattr(args, "broker", None), **extra)


def cmd_worker(args: argparse.Namespace) -> int:
    from worker.runtime import run_worker

    settings = _settings(args, device=args.device, dtype=args.dtype, max_sessions=args.max_sessions,
                         checkpoint_dir=args.checkpoint_dir, loss_backend=args.loss_backend)
    if settings.broker_url is None:
        raise TinkerqError("no broker: pass --broker redis://host:6379/0 or set TINKERQ_BROKER_URL")
    run_worker(args.model, settings, name=args.name, loglevel=args.loglevel, threads=args.threads)
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from recipes.sft import main as sft_main

    return sft_main(args)


def cmd_rl(args: argparse.Namespace) -> int:
    from recipes.rl import main as rl_main

    return rl_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinkerq", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    w = sub.add_parser("worker", help="serve a model: a Celery worker holding it")
    w.add_argument("--model", required=True, help="local Hugging Face model directory (from_pretrained)")
    w.add_argument("--name", help="name producers use for the model (default: the directory's absolute path)")
    w.add_argument("--broker", help="redis:// URL of the fleet (default: TINKERQ_BROKER_URL)")
    w.add_argument("--device", help="torch device (default: cpu, or TINKERQ_DEVICE)")
    w.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="parameter dtype (default float32)")
    w.add_argument("--max-sessions", type=int, help="training sessions held at once (default 4)")
    w.add_argument("--checkpoint-dir", help="where save_weights_for_sampler writes (default ~/.cache/tinkerq)")
    w.add_argument("--loss-backend", choices=["auto", "apex", "torch", "reference"],
                   help="loss head: auto = apex on CUDA when installed, else chunked torch (default)")
    w.add_argument("--threads", type=int, help="torch CPU threads")
    w.add_argument("--loglevel", default="INFO")
    w.set_defaults(func=cmd_worker)

    s = sub.add_parser("sft", help="supervised fine-tuning of the demo model on the bundled data set")
    from recipes.sft_args import add_sft_arguments

    add_sft_arguments(s)
    s.set_defaults(func=cmd_sft)

    r = sub.add_parser("rl", help="RL (sampling + importance sampling) on the demo task, after a short SFT warm-up")
    from recipes.rl import add_rl_arguments

    add_rl_arguments(r)
    r.set_defaults(func=cmd_rl)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except TinkerqError as exc:
        # One clear line, no traceback: these errors say what to do.
        print(f"tinkerq {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""``tinkerq``: the command line.

    tinkerq sft                      fine-tune the demo model on the bundled data set (embedded fleet)
    tinkerq sft --broker redis://... the same job against a running fleet
    tinkerq sft --lora-rank 8        the same job training a LoRA adapter (rl takes it too)
    tinkerq rl                       RL with sampling and importance sampling on the demo task
    tinkerq worker --model PATH      serve a local Hugging Face model from a Redis fleet
    tinkerq gateway                  the HTTP gateway the official tinker SDK talks to (X-API-Key: tml-...)
    tinkerq fleet up --model DIR     a local fleet: Redis, workers, Flower (and gateways: --gateway-port)
    tinkerq proxy --listen H:P --backend H:P ...   round robin over gateways (fleet up --gateways N starts one)
    tinkerq keys create NAME         a new API key for tenant NAME (printed once, alone on the last line)
    tinkerq keys update NAME --max-tokens-per-minute N ...   a tenant's quotas (create takes them too)
    tinkerq keys list | revoke NAME  the tenants, their limits; remove one's key and end its sessions
    tinkerq usage [--key NAME]       tokens, samples and checkpoints per key, hourly (--json)
    tinkerq families build DIR       tiny random models of every model family, one directory each, to serve
    tinkerq plan --model DIR|NAME    how many shards and LoRA tenants a model needs/fits per device (no weights)

Subcommands import their (heavy) modules only when they run, so ``tinkerq --help`` is instant.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from typing import NoReturn

from tinkerq.errors import TinkerqError, UserError
from tinkerq.launcher.tenant_commands import add_tenant_commands
from tinkerq.security import warn_about_broker
from tinkerq.settings import Settings

BROKER_HELP = "redis://, rediss:// or sentinel:// URL (default: TINKERQ_BROKER_URL)"
# Settings.home and Settings.checkpoint_dir: worker/checkpoints/ writes saved weights and save_state below it.
CHECKPOINT_DIR_HELP = ("where save_weights_for_sampler and save_state write; share it between workers and users "
                       "(default: TINKERQ_CHECKPOINT_DIR, else $TINKERQ_HOME/checkpoints; TINKERQ_HOME defaults to "
                       "~/.cache/tinkerq)")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line that says what to do, like every other CLI error (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {UserError(message)} (see: {self.prog} --help)\n")


def installed_version() -> str:
    """The installed distribution's version (``pip install -e .`` included)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tinkerq")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def _settings(args: argparse.Namespace, **extra: object) -> Settings:
    return Settings.from_env(broker_url=getattr(args, "broker", None), **extra)


def cmd_worker(args: argparse.Namespace) -> int:
    import os

    os.umask(0o077)  # checkpoints, saved weights and anything else this worker writes: owner-only
    # Read by OpenMP when torch loads (check_device below imports it): torch's idle CPU threads sleep instead of
    # spinning. Spinning threads on busy cores cost a decode step 10-40x (docs/benchmarks.md section 21).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    settings = _settings(args, device=args.device, dtype=args.dtype, quantized_base=args.quantized_base,
                         activation_checkpointing=args.activation_checkpointing,
                         expert_parallel=True if args.expert_parallel else None,
                         max_sessions=args.max_sessions,
                         memory_limit_mb=args.memory_limit_mb,
                         checkpoint_dir=args.checkpoint_dir, loss_backend=args.loss_backend,
                         metrics_port=args.metrics_port, shards=args.shards, shard_rank=args.rank,
                         rendezvous=args.rendezvous, rendezvous_timeout_s=args.rendezvous_timeout,
                         role=args.role)
    # Before torch loads (seconds) and before the broker is asked: a --model that is no model directory is told now.
    from tinkerq.validation import check_model_directory

    check_model_directory(args.model)
    check_device(settings.device)
    if settings.shard_rank > 0:  # a follower shard: no broker, it takes its commands from rank 0
        from tinkerq.worker.sharding.follower import run_follower

        return run_follower(args.model, settings, threads=args.threads)
    warn_about_broker(getattr(args, "broker", None), settings.require_broker())
    # Before the model loads (minutes for a large one) and before a shard group forms: an unreachable broker
    # fails the command at once, with the same message the worker itself would give.
    check_broker(settings)
    from tinkerq.worker.core.runtime import run_worker

    run_worker(args.model, settings, name=args.name, loglevel=args.loglevel, threads=args.threads)
    return 0


def check_broker(settings: Settings) -> None:
    """Connect once and let go; BrokerUnavailableError ("cannot reach Redis ...") if the broker does not answer."""
    from tinkerq.connection import Connection

    Connection.open(settings).close()


def check_device(device: str) -> None:
    """A torch device this machine has, or a UserError: otherwise the worker fails only after loading the model,
    with a traceback."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise UserError(f"--device {device!r} is not a torch device: use cpu, cuda, cuda:N, mps ...") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(f"--device {device}: this machine has no CUDA device torch can use; use --device cpu")
        if parsed.index is not None and parsed.index >= count:
            raise UserError(f"--device {device}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {device}: MPS is not available on this machine; use --device cpu")


def cmd_sft(args: argparse.Namespace) -> int:
    from tinkerq.recipes.sft import main as sft_main

    return sft_main(args)


def cmd_rl(args: argparse.Namespace) -> int:
    from tinkerq.recipes.rl import main as rl_main

    return rl_main(args)


def cmd_fleet(args: argparse.Namespace) -> int:
    from tinkerq.launcher.fleet import main as fleet_main

    return fleet_main(args)


def cmd_flower(args: argparse.Namespace) -> int:
    from tinkerq.launcher.flower import run_flower

    return run_flower(args, _settings(args))


def cmd_plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tinkerq.recipes.plotting import plot_metrics

    src = Path(args.metrics)
    out = Path(args.out) if args.out else src.with_suffix(".png")
    if out.resolve() == src.resolve():
        raise UserError(f"--out {out} is the metrics file itself; pass a .png path")
    print(plot_metrics(src, out, keys=args.keys, x=args.x, title=args.title or src.parent.name))
    return 0


def cmd_dead(args: argparse.Namespace) -> int:
    from tinkerq.launcher.dead import main as dead_main

    return dead_main(args, _settings(args))


def cmd_gateway(args: argparse.Namespace) -> int:
    from tinkerq.launcher.processes import gateway_not_installed, port_problem

    settings = _settings(args)
    warn_about_broker(getattr(args, "broker", None), settings.require_broker())
    problem = port_problem(args.port, args.host)
    if problem:  # uvicorn would log it among its start-up lines and exit 3
        raise UserError(f"cannot listen on {args.host}:{args.port} ({problem}): pass --port with a free port")
    missing = gateway_not_installed()
    if missing:  # otherwise an ImportError traceback from the import below
        raise UserError(missing)
    from tinkerq.gateway.server import serve

    return serve(settings, host=args.host, port=args.port)


def cmd_proxy(args: argparse.Namespace) -> int:
    from tinkerq.launcher.proxy import run_proxy

    return run_proxy(args)


def cmd_families(args: argparse.Namespace) -> int:
    """``families build``: each family's tiny model (recipes/families.py) saved in DIR/<family>."""
    import json
    import shlex
    from pathlib import Path

    from tinkerq.recipes.families import FAMILIES, build_family

    out = Path(args.dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a directory: pass a directory (it is created if missing)")
    if args.layout == "published":  # the makers' on-disk layouts (recipes/published.py): DIR/<layout> each
        from tinkerq.recipes.published import LAYOUTS, build_published

        if args.family:
            raise UserError("--layout published writes its own set of layouts: drop --family")
        for name in LAYOUTS:
            try:
                print(build_published(name, out / name, seed=args.seed))
            except OSError as exc:
                raise UserError(f"cannot write {out / name}: {exc.strerror or exc}") from None
        return 0
    for family in dict.fromkeys(args.family or FAMILIES):  # in the order given, each once
        target = out / family
        try:
            build_family(family, target, seed=args.seed)
        except OSError as exc:
            raise UserError(f"cannot write {target}: {exc.strerror or exc}") from None
        architecture = json.loads((target / "config.json").read_text()).get("architectures", ["?"])[0]
        print(f"{family}: wrote {target} ({architecture}, seed {args.seed}); serve it with:")
        print(f"tinkerq worker --model {shlex.quote(str(target))}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """``plan``: shards, memory per shard and LoRA tenants of a model from its config (worker/planning/planner.py)."""
    import json

    from tinkerq.worker.planning.planner import LINEUP, Workload, plan, render, render_markdown, to_json

    if bool(args.model) == bool(args.lineup):
        raise UserError("pass --model DIR|CONFIG|NAME, or --lineup for every model of the lineup "
                        f"({', '.join(LINEUP)})")
    workload = Workload(batch_tokens=args.batch_tokens, seq_len=args.seq_len, lora_rank=args.lora_rank,
                        **({"microbatch_tokens": args.microbatch_tokens} if args.microbatch_tokens else {}))
    models = list(LINEUP) if args.lineup else [args.model]
    tables = []
    for gb in args.device_memory:
        plans = [plan(m, devices=args.devices, device_gb=gb, dtype=args.dtype, headroom_gb=args.headroom,
                      workload=workload, quantized_base=args.quantized_base,
                      activation_checkpointing=args.activation_checkpointing,
                      expert_parallel=args.expert_parallel, at_shards=args.at_shards) for m in models]
        tables.append(plans)
    if args.json:
        print(json.dumps([to_json(p) for plans in tables for p in plans], indent=2))
    elif args.markdown:
        print("\n\n".join(render_markdown(plans) for plans in tables))
    else:
        print("\n\n".join(render(p) for plans in tables for p in plans))
    return 0


def cmd_healthcheck(args: argparse.Namespace) -> int:
    """Exit 0 if a worker on this host is registered (its heartbeat thread runs even during long tasks)."""
    import socket

    from tinkerq.connection import Connection

    settings = _settings(args, connect_timeout_s=3.0)
    settings.require_broker()  # without one, an empty in-process fleet would say "no worker registered"
    conn = Connection.open(settings)
    try:
        mine = [r for r in conn.workers_serving() if r.get("host") == socket.gethostname()]
    finally:
        conn.close()
    if not mine:
        print(f"no worker registered from host {socket.gethostname()}", file=sys.stderr)
        return 1
    print(", ".join(f"{r['worker']} serves {r['base_model']}" for r in mine))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from tinkerq.recipes.sft_args import non_negative_int, port_or_zero, positive_float, positive_int, tcp_port

    parser = Parser(prog="tinkerq", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}",
                        help="print the installed tinkerq's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    w = sub.add_parser("worker", help="serve a model: a Celery worker holding it")
    w.add_argument("--model", required=True, help="local Hugging Face model directory (from_pretrained)")
    w.add_argument("--served-name", "--name", dest="name", metavar="NAME",
                   help="the name producers and SDK users ask for the model by, e.g. Qwen/Qwen3-8B (default: the "
                        "directory's absolute path; `tinkerq fleet up` spells it the same, after each --model)")
    w.add_argument("--broker", help=BROKER_HELP)
    w.add_argument("--device", help="torch device: cpu, cuda, cuda:N ... (default: TINKERQ_DEVICE, else cpu)")
    w.add_argument("--quantized-base", choices=["dequantize", "keep"],
                   help="a quantized checkpoint (FP8, MXFP4, INT4): dequantize it on load (default: "
                        "TINKERQ_QUANTIZED_BASE, else dequantize), or keep it as stored, each layer dequantized when "
                        "used: LoRA sessions and sampling only; on a shard group with --expert-parallel, each shard "
                        "keeps its own experts as stored (docs/quantized.md)")
    w.add_argument("--activation-checkpointing", choices=["auto", "on", "off"],
                   help="checkpoint each decoder layer in forward_backward (one more forward, far less memory): "
                        "auto only for a batch that would not fit otherwise, on always, off never (default: "
                        "TINKERQ_ACTIVATION_CHECKPOINTING, else auto; docs/planning.md)")
    w.add_argument("--expert-parallel", action="store_true",
                   help="with --shards N, a MoE model: each shard holds 1/N of every layer's routed experts and tokens "
                        "travel to them (all-to-all) instead of every shard gathering whole MoE layers; full sessions "
                        "and LoRA bases, each tenant's expert factors with their experts (default: "
                        "TINKERQ_EXPERT_PARALLEL, else off; docs/sharding.md)")
    w.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="parameter dtype (default: TINKERQ_DTYPE, else auto: the checkpoint's own dtype, bfloat16 for "
                        "published checkpoints, on a CUDA device with bfloat16; float32 on the CPU, where "
                        "--dtype bfloat16 halves the memory)")
    w.add_argument("--max-sessions", type=positive_int, help="full-parameter training sessions held at once "
                                                             "(default 4)")
    w.add_argument("--role", choices=["trainer", "sampler"],
                   help="sampler: serve only sampling (snapshots, saved weights, the base model), hold no training "
                        "sessions (default trainer: both)")
    w.add_argument("--memory-limit-mb", type=non_negative_int,
                   help="cap on the worker's RSS, MiB; requests that would not fit are refused (default 0: no cap)")
    w.add_argument("--checkpoint-dir", help=CHECKPOINT_DIR_HELP)
    w.add_argument("--loss-backend", choices=["auto", "apex", "torch", "reference"],
                   help="loss head: auto = apex on CUDA when installed, else chunked torch (default)")
    w.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's)")
    w.add_argument("--metrics-port", type=port_or_zero,
                   help="serve Prometheus metrics on this port (default 0: off)")
    w.add_argument("--shards", type=positive_int, help="serve the model sharded over this many processes (default 1)")
    w.add_argument("--rank", type=non_negative_int,
                   help="this process's shard, 0..shards-1; rank 0 takes the requests (default 0)")
    w.add_argument("--rendezvous", help="tcp://HOST:PORT where the shards meet: rank 0's host, a free port")
    w.add_argument("--rendezvous-timeout", type=positive_float,
                   help="seconds to wait for the other shards (default 300)")
    w.add_argument("--loglevel", default="INFO", type=str.upper, choices=LOG_LEVELS,
                   help="the worker's log level (default INFO)")
    w.set_defaults(func=cmd_worker)

    s = sub.add_parser("sft", help="supervised fine-tuning of the demo model on the bundled data set")
    from tinkerq.recipes.sft_args import add_sft_arguments

    add_sft_arguments(s)
    s.set_defaults(func=cmd_sft)

    r = sub.add_parser("rl", help="RL (sampling + importance sampling) on the demo task, after a short SFT warm-up")
    from tinkerq.recipes.rl import add_rl_arguments

    add_rl_arguments(r)
    r.set_defaults(func=cmd_rl)

    f = sub.add_parser("fleet", help="a local fleet without Docker: up, status, down")
    from tinkerq.launcher.fleet import add_fleet_arguments

    add_fleet_arguments(f)
    f.set_defaults(func=cmd_fleet)

    fl = sub.add_parser("flower", help="the Flower dashboard for a fleet")
    from tinkerq.launcher.flower import add_flower_arguments

    add_flower_arguments(fl)
    fl.set_defaults(func=cmd_flower)

    pl = sub.add_parser("plot", help="draw curves from a metrics.jsonl as PNG")
    pl.add_argument("metrics", help="a metrics.jsonl written by tinkerq sft / rl")
    pl.add_argument("--keys", nargs="+", default=["loss"], help="columns to draw, one panel each (default: loss)")
    pl.add_argument("--x", default="step", help="x-axis column (default: step; rl's metrics: iteration)")
    pl.add_argument("--out", help="PNG path (default: the metrics file's path with .png)")
    pl.add_argument("--title", help="the figure's title (default: the run directory's name)")
    pl.set_defaults(func=cmd_plot)

    dl = sub.add_parser("dead", help="messages workers could not read (the dead-letter queue tinkerq.dead)")
    from tinkerq.launcher.dead import add_dead_arguments

    add_dead_arguments(dl)
    dl.set_defaults(func=cmd_dead)

    gw = sub.add_parser("gateway", help="the HTTP gateway the official tinker SDK talks to")
    gw.add_argument("--broker", help=BROKER_HELP)
    gw.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 in a "
                                                        "container)")
    gw.add_argument("--port", type=tcp_port, default=8000, help="port to listen on (default 8000)")
    gw.set_defaults(func=cmd_gateway)

    px = sub.add_parser("proxy", help="round robin over gateways, per connection (`fleet up --gateways N` starts it)")
    from tinkerq.launcher.proxy import add_proxy_arguments

    add_proxy_arguments(px)
    px.set_defaults(func=cmd_proxy)

    add_tenant_commands(sub, settings_of=_settings, broker_help=BROKER_HELP)

    from tinkerq.recipes.families import FAMILIES

    fa = sub.add_parser("families", help="tiny random models of every model family Tinker users train")
    fasub = fa.add_subparsers(dest="families_command", required=True)
    fb = fasub.add_parser("build", help="write each family's tiny model to DIR/<family> and print the line "
                                        "that serves it")
    fb.add_argument("dir", metavar="DIR", help="where to write them (created if missing; files already in "
                                                "DIR/<family> are overwritten)")
    fb.add_argument("--family", nargs="+", action="extend", choices=list(FAMILIES), metavar="NAME",
                    help=f"only these families (default: all of {', '.join(FAMILIES)})")
    fb.add_argument("--seed", type=non_negative_int, default=0, help="seed of the random weights (default 0)")
    fb.add_argument("--layout", choices=["save_pretrained", "published"], default="save_pretrained",
                    help="save_pretrained (default): each family as transformers saves it; published: tiny "
                         "checkpoints in the makers' layouts (sharded, per-expert, FP8/MXFP4/INT4: "
                         "docs/checkpoints.md)")
    fa.set_defaults(func=cmd_families)

    pn = sub.add_parser("plan", help="how many shards a model needs and how many LoRA tenants fit, per device "
                                     "(from its config on the meta device: no weights)")
    pn.add_argument("--model", help="a Hugging Face model directory (config.json only is read), a config.json, or a "
                                    "lineup name (llama-3.3-70b, gpt-oss-120b, deepseek-v3.1, ...)")
    pn.add_argument("--lineup", action="store_true", help="every model of the lineup (docs/planning.md)")
    pn.add_argument("--devices", type=positive_int, default=8, help="devices available to the group (default 8)")
    pn.add_argument("--device-memory", type=positive_float, nargs="+", default=[80.0], metavar="GB",
                    help="memory of one device, GiB; several values: one plan each (default 80)")
    pn.add_argument("--headroom", type=float, default=2.0,
                    help="GiB kept free on each device: CUDA context, allocator slack, NCCL buffers (default 2)")
    pn.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                    help="the served parameters' dtype (default auto, as the worker resolves it on a GPU with "
                         "bfloat16: the checkpoint's own dtype, bfloat16 for a quantized checkpoint, which is "
                         "dequantized to it on load)")
    pn.add_argument("--quantized-base", choices=["auto", "dequantize", "keep"], default="auto",
                    help="a quantized checkpoint's LoRA base: dequantized on load, or kept as stored on one device, "
                         "each layer dequantized when used (the worker's --quantized-base keep); with "
                         "--expert-parallel, a group whose shards each keep their own experts as stored. auto "
                         "(default): both planned, the one needing fewer devices shown, with its worker flags")
    pn.add_argument("--activation-checkpointing", choices=["auto", "on", "off"], default="auto",
                    help="the worker's TINKERQ_ACTIVATION_CHECKPOINTING: auto (default) plans a batch checkpointed "
                         "where it would not fit otherwise, on always, off never")
    pn.add_argument("--expert-parallel", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                    help="plan a MoE model on a group started with --expert-parallel (on; the flag alone): its routed "
                         "experts split by expert, not gathered, and LoRA tenants' expert factors with them "
                         "(docs/sharding.md#expert-parallelism); off: FSDP2 alone; auto (default): both planned, "
                         "the one needing fewer devices shown, with its worker flags")
    pn.add_argument("--at-shards", type=positive_int, metavar="N",
                    help="give each column's memory at N shards (a group of that size), not at the fewest that fit")
    pn.add_argument("--batch-tokens", type=positive_int, default=8192,
                    help="tokens of one forward_backward, split over the shards (default 8192)")
    pn.add_argument("--seq-len", type=positive_int, default=2048, help="tokens per datum (default 2048)")
    pn.add_argument("--microbatch-tokens", type=positive_int,
                    help="the worker's TINKERQ_MICROBATCH_TOKENS (default: the worker's default)")
    pn.add_argument("--lora-rank", type=positive_int, default=32, help="LoRA rank (default 32, Tinker's)")
    out = pn.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="machine-readable output")
    out.add_argument("--markdown", action="store_true", help="one markdown table row per model")
    pn.set_defaults(func=cmd_plan)

    hc = sub.add_parser("healthcheck", help="exit 0 if a worker on this host is registered (for containers)")
    hc.add_argument("--broker", help=BROKER_HELP)
    hc.set_defaults(func=cmd_healthcheck)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except TinkerqError as exc:
        # One clear line, no traceback: these errors say what to do (a library's message may span lines).
        print(f"tinkerq {args.command}: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", text.strip())


if __name__ == "__main__":
    sys.exit(main())

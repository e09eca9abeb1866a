"""Where tinkerq's server CPU per sampled token goes, by process and thread (issue 29, item 6).

One tinkerq server as benchmarks/skyrl_side_by_side.py starts it (a private Redis, ``tinkerq worker --threads
--threads``, ``tinkerq gateway``, an API key) on its tiny Qwen3, driven by the same SDK client (SkyRL's venv:
``bash benchmarks/skyrl_env.sh`` once); no SkyRL server. After ``--warmup`` unrecorded rounds, ``--reps`` rounds of
one load (``singles``: ``--singles`` one-sample requests; ``batch``: ``--prompts`` x ``--samples``), every request
submitted before any is awaited, ``--tokens`` new tokens each. Reported: user + system CPU of every thread of the
worker, the gateway and Redis over all recorded rounds, per generated token, from ``/proc/PID/task/*/stat``, by
OS thread name (tinkerq's threads are named: tinkerq/threads.py; others show as their process calls them).

    .venv/bin/python benchmarks/sampling_threads.py [--load singles] [--reps 20]
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
from pathlib import Path

from _fleet import machine, print_table
from skyrl_side_by_side import MODELS, SEED, Client, build_qwen3, prompts_for, tinkerq_server

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[tuple[int, str], float]:
    """CPU seconds (user + system) of each live thread of ``pid``, keyed by (thread id, its OS name)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # ended meanwhile
            continue
        out[(int(tid), name)] = (int(fields[11]) + int(fields[12])) * TICK_S
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", choices=["singles", "batch"], default="singles")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="the worker's torch threads")
    parser.add_argument("--singles", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--skyrl-venv", type=Path, default=Path(os.environ.get("SKYRL_VENV", "/work/skyrl-venv")))
    args = parser.parse_args()
    vocab = MODELS["tiny"]["vocab_size"]
    prompts, samples = ((prompts_for(args.singles, vocab, 2), 1) if args.load == "singles"
                        else (prompts_for(args.prompts, vocab, 1), args.samples))
    print(f"machine: {machine()}; tiny Qwen3, {args.load}: {len(prompts)} prompts x {samples} samples x "
          f"{args.tokens} tokens; worker --threads {args.threads}; {args.reps} rounds after {args.warmup} warm-up")
    with tempfile.TemporaryDirectory() as tmp, \
            tinkerq_server(build_qwen3(Path(tmp) / "tiny", MODELS["tiny"]), args.threads, {}) as server:
        client = Client(server, args.skyrl_venv)
        try:
            for _ in range(args.warmup):
                client.sample(prompts, samples, args.tokens, seed=SEED)
            worker, gateway, redis = server["pids"]
            processes = {"worker": worker, "gateway": gateway, "redis": redis}
            before = {who: thread_cpu(pid) for who, pid in processes.items()}
            tokens = 0
            for _ in range(args.reps):
                tokens += int(client.sample(prompts, samples, args.tokens, seed=SEED)["tokens"])
            after = {who: thread_cpu(pid) for who, pid in processes.items()}
        finally:
            client.close()
    rows = []
    for who in processes:
        by_name: dict[str, float] = collections.defaultdict(float)
        for key, seconds in after[who].items():
            by_name[key[1]] += seconds - before[who].get(key, 0.0)
        total = sum(by_name.values())
        rows.append((who, "(all threads)", 1e3 * total / tokens))
        rows += [(who, name, 1e3 * s / tokens) for name, s in sorted(by_name.items(), key=lambda kv: -kv[1]) if s > 0]
    print(f"{tokens} generated tokens; CPU per token (ms), threads of one name summed")
    print_table(["process", "thread", "CPU ms/token"], rows)


if __name__ == "__main__":
    main()

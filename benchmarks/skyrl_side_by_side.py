"""Sampling side by side: tinkerq (gateway + worker) and SkyRL's Tinker server, one official SDK, the same models.

For each model (a tiny Qwen3 and a ~29M one, each built here from a config with a fixed seed and save_pretrained, with
the demo's character tokenizer: no hub downloads) the script starts both servers:

* tinkerq: a private Redis, ``tinkerq worker --threads --threads`` and ``tinkerq gateway``, an API key;
* SkyRL: ``uv run -m skyrl.tinker.api --backend jax --backend-config '{"max_lora_adapters": 4, "max_lora_rank": 8}'``
  (tuned: the default 32 slots of rank 32 cost it ~4x per token on the CPU), from the venv benchmarks/skyrl_env.sh
  builds (``--skyrl-venv``), through that venv's ``uv`` stand-in.

The client is the official tinker SDK 0.25 (the release both servers speak), in SkyRL's venv
(benchmarks/_sdk_sampler.py), one process per server: a rank-8 LoRA training client and
``save_weights_and_get_sampling_client``, then the loads, every request submitted before any is awaited:

* batch: ``--prompts`` prompts of 16-32 tokens x ``--samples`` samples x ``--tokens`` new tokens, temperature 1;
* singles: ``--singles`` concurrent requests of one sample each (same prompt lengths and tokens);
* loaded: the batch load again with two busy processes (pure-Python loops) running beside the servers.

Load by load, each server is warmed up on the load (``--warmup`` unrecorded rounds), then the reps alternate the
servers (A B, then B A): steady state for both. Reported: tokens/s
(generated tokens over the wall time from the first submit to the last answer) and the servers' CPU per generated
token (user + system time of every process of the server, read from /proc: tinkerq's worker, gateway and Redis,
also the worker alone; SkyRL's API and engine processes), medians over reps with the range, and the ratios
tinkerq / SkyRL and loaded / quiet. Nothing is asserted. Both servers stay up for the whole model; the idle one
costs little (SkyRL's engine polls SQLite every 100 ms; tinkerq's worker beats every few seconds).

    bash benchmarks/skyrl_env.sh                      # once: SkyRL's venv (default /work/skyrl-venv)
    .venv/bin/python benchmarks/skyrl_side_by_side.py [--reps 3] [--threads 1] [--models tiny 29m]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from _fleet import Fleet, machine, median, print_table

from tinkerq.launcher.processes import free_port, gateway_command, gateway_up, http_ok, start_process, wait_for
from tinkerq.settings import Settings
from tinkerq.tenants import ApiKeys

HERE = Path(__file__).resolve().parent
SKYRL_CONFIG = {"max_lora_adapters": 4, "max_lora_rank": 8}
RANK = 8
SEED = 1  # every request's: the same work in every rep (each row still draws its own stream)
# Qwen3 configs (float32, random weights, seed 0). Vocabulary >= the demo tokenizer's 50 ids.
MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "29m": dict(vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4, head_dim=64),
}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def build_qwen3(out_dir: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """A randomly initialised Qwen3ForCausalLM (fixed seed) and the demo's tokenizer, with save_pretrained."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tinkerq.recipes.demo_model import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**config, max_position_embeddings=4096, tie_word_embeddings=False,
                                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id, dtype="float32"))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# -- CPU time of a server's processes ------------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            kids.setdefault(int(fields[1]), []).append(int(entry))
    return kids


def cpu_seconds(roots: list[int]) -> float:
    """User + system seconds of ``roots`` and all their descendants (alive ones: the servers' processes are)."""
    kids, total, todo, seen = _children(), 0.0, list(roots), set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
        todo += kids.get(pid, [])
    return total


# -- the servers -----------------------------------------------------------------------------------------------


@contextmanager
def tinkerq_server(model_dir: Path, threads: int, env: dict[str, str], name: str = "tinkerq"
                   ) -> Iterator[dict[str, Any]]:
    with Fleet(model_dir, threads=threads, env=env) as fleet:
        port = free_port()
        gateway = start_process(gateway_command(fleet.url, port), fleet.workdir / "gateway.log")
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: gateway_up(url), 60, "tinkerq gateway", gateway, fleet.workdir / "gateway.log")
            keys = ApiKeys.open(Settings(broker_url=fleet.url))
            try:
                key = keys.create("bench")
            finally:
                keys.close()
            assert fleet._worker_proc is not None and fleet._redis_proc is not None
            yield {"name": name, "url": url, "key": key, "model": str(fleet.model_dir),
                   "pids": [fleet._worker_proc.pid, gateway.pid, fleet._redis_proc.pid],
                   "worker_pid": fleet._worker_proc.pid}
        finally:
            gateway.terminate()
            gateway.wait(30)


@contextmanager
def skyrl_server(model_dir: Path, venv: Path, workdir: Path) -> Iterator[dict[str, Any]]:
    port = free_port()
    log = workdir / "skyrl.log"
    cmd = ["uv", "run", "-m", "skyrl.tinker.api", "--base-model", str(model_dir), "--backend", "jax",
           "--backend-config", json.dumps(SKYRL_CONFIG), "--host", "127.0.0.1", "--port", str(port),
           "--database-url", f"sqlite:///{workdir}/skyrl.db", "--checkpoints-base", str(workdir / "ckpt")]
    env = {"PATH": f"{venv / 'uv-shim'}:{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}
    proc = start_process(cmd, log, env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_ok(f"{url}/api/v1/healthz") and "Starting background engine" in log.read_text(),
                 300, "SkyRL's Tinker server", proc, log)
        yield {"name": "SkyRL", "url": url, "key": "tml-skyrl-has-no-auth", "model": str(model_dir),
               "pids": [proc.pid], "worker_pid": None}
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group ``proc`` leads (its own session: start_process), SIGKILL after 30 s."""
    for sig, grace in ((15, 30), (9, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


class Client:
    """benchmarks/_sdk_sampler.py in SkyRL's venv, sampling from one server."""

    def __init__(self, server: dict[str, Any], venv: Path) -> None:
        self.server = server
        self.proc = subprocess.Popen([str(venv / "bin" / "python"), str(HERE / "_sdk_sampler.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "TINKER_TELEMETRY": "0"})
        self.call({"cmd": "open", "base_url": server["url"], "api_key": server["key"], "base_model": server["model"],
                   "rank": RANK})

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the SDK client of {self.server['name']} exited ({self.proc.wait()})")
        return json.loads(line)

    def sample(self, prompts: list[list[int]], samples: int, tokens: int, seed: int) -> dict[str, float]:
        """Wall seconds, tokens, and the CPU seconds of the server (all its processes, and the worker alone)."""
        pids, worker = self.server["pids"], self.server["worker_pid"]
        cpu0, w0 = cpu_seconds(pids), cpu_seconds([worker]) if worker else 0.0
        got = self.call({"cmd": "sample", "prompts": prompts, "samples": samples, "tokens": tokens, "seed": seed})
        cpu, wcpu = cpu_seconds(pids) - cpu0, (cpu_seconds([worker]) - w0) if worker else float("nan")
        return {"seconds": got["seconds"], "tokens": got["tokens"], "cpu": cpu, "worker_cpu": wcpu,
                "submitted": got["submitted"], "first": got["answered"][0]}

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"cmd": "close"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(30)
        except Exception:
            self.proc.kill()


@contextmanager
def busy(n: int) -> Iterator[None]:
    """``n`` processes spinning a pure-Python loop (another tenant's work on the same machine)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


# -- the run ---------------------------------------------------------------------------------------------------


def prompts_for(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, min(vocab, 50)) for _ in range(rng.randint(16, 32))] for _ in range(n)]


def run_model(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, dict[str, list[dict[str, float]]]]:
    model_dir = build_qwen3(tmp / name, MODELS[name])
    vocab = MODELS[name]["vocab_size"]
    batch = prompts_for(args.prompts, vocab, 1)
    singles = prompts_for(args.singles, vocab, 2)
    loads = {"batch": (batch, args.samples), "singles": (singles, 1)}
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    worker_env = dict(kv.split("=", 1) for kv in args.worker_env)
    with ExitStack() as stack:
        servers = []
        if "tinkerq" in args.servers:
            servers.append(stack.enter_context(tinkerq_server(model_dir, args.threads, worker_env)))
        for variant in args.variant:  # A/B: another worker fleet, the same but for one environment variable
            name_value = dict([variant.split("=", 1)])
            servers.append(stack.enter_context(tinkerq_server(model_dir, args.threads, {**worker_env, **name_value},
                                                              name=f"tinkerq {variant}")))
        if "skyrl" in args.servers:
            servers.append(stack.enter_context(skyrl_server(model_dir, args.skyrl_venv, tmp / f"skyrl-{name}")))
        clients = {s["name"]: Client(s, args.skyrl_venv) for s in servers}
        for c in clients.values():
            stack.callback(c.close)
        # Load by load, so that each server's reps of a load run back to back after its warm-up on that load:
        # SkyRL compiles its whole generation loop per batch shape and, switching between the two loads' shapes,
        # compiled again (17-40 s per request in a first version of this script that interleaved the loads).
        # The figures are steady state for both servers, as in an RL loop that repeats its shapes.
        order = list(clients)
        for load, (prompts, samples) in [*loads.items(), ("loaded", loads["batch"])]:
            with busy(2) if load == "loaded" else ExitStack():
                for c in clients.values():
                    for _ in range(args.warmup):
                        c.sample(prompts, samples, args.tokens, seed=SEED)
                for rep in range(args.reps):
                    for who in (order if rep % 2 == 0 else order[::-1]):
                        got = clients[who].sample(prompts, samples, args.tokens, seed=SEED)
                        results.setdefault(load, {}).setdefault(who, []).append(got)
                        print(f"  {name} rep {rep} {load:8s} {who:8s} {got['tokens'] / got['seconds']:8.0f} tok/s  "
                              f"server CPU {1e3 * got['cpu'] / got['tokens']:.3f} ms/token  submits took "
                              f"{got['submitted']:.2f} s, first answer {got['first']:.2f} s, last "
                              f"{got['seconds']:.2f} s", flush=True)
    return results


def summarise(name: str, results: dict[str, dict[str, list[dict[str, float]]]]) -> None:
    def rate(r: dict[str, float]) -> float:
        return r["tokens"] / r["seconds"]

    def cpu(r: dict[str, float], key: str = "cpu") -> float:
        return 1e3 * r[key] / r["tokens"]

    rows = []
    for load, by in results.items():
        for who, runs in by.items():
            rates, cpus = [rate(r) for r in runs], [cpu(r) for r in runs]
            worker = [cpu(r, "worker_cpu") for r in runs] if who.startswith("tinkerq") else []
            rows.append((load, who, median(rates), f"{min(rates):.0f}-{max(rates):.0f}", median(cpus), min(cpus),
                         f"{median(worker):.3f}" if worker else "-"))
    print(f"\n{name}: tokens/s and server CPU per generated token (medians; range over reps; CPU of the best rep)")
    print_table(["load", "server", "tokens/s", "range", "CPU ms/token", "best CPU", "worker only"], rows)
    ratio_rows = []
    for load, by in results.items():
        for who in (w for w in by if w.startswith("tinkerq") and "SkyRL" in by):
            pairs = list(zip(by[who], by["SkyRL"], strict=True))
            ratios = [rate(a) / rate(b) for a, b in pairs]
            best = max(rate(a) for a in by[who]) / max(rate(b) for b in by["SkyRL"])
            best_cpu = min(cpu(a) for a in by[who]) / min(cpu(b) for b in by["SkyRL"])
            ratio_rows.append((load, who, median(ratios), f"{min(ratios):.2f}-{max(ratios):.2f}",
                               median([cpu(a) / cpu(b) for a, b in pairs]), best, best_cpu))
    if ratio_rows:
        # Best against best: SkyRL's reps that hit a compiled shape (a rep that compiles takes 15-40 s here).
        print(f"\n{name}: tinkerq / SkyRL, per rep and best rep against best rep (target: tokens/s >= 1, CPU <= 1)")
        print_table(["load", "server", "tokens/s ratio", "range", "CPU/token ratio", "best tok/s ratio",
                     "best CPU ratio"], ratio_rows)
    load_rows = []
    for who in results["batch"]:
        quiet, loaded = results["batch"][who], results["loaded"][who]
        load_rows.append((who, median([rate(r) for r in quiet]), median([rate(r) for r in loaded]),
                          median([rate(b) / rate(a) for a, b in zip(quiet, loaded, strict=True)])))
    print(f"\n{name}: batch load with two busy processes beside the servers (target: tinkerq loaded/quiet >= 0.5)")
    print_table(["server", "quiet tok/s", "loaded tok/s", "loaded / quiet"], load_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="the tinkerq worker's torch threads")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--singles", type=int, default=16, help="concurrent single-sample requests")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2, help="unrecorded rounds before each load's reps")
    parser.add_argument("--servers", nargs="*", choices=["tinkerq", "skyrl"], default=["tinkerq", "skyrl"],
                        help="run only these (the ratios need both)")
    parser.add_argument("--variant", nargs="*", default=[], metavar="NAME=VALUE",
                        help="also a tinkerq fleet whose worker has this environment variable (A/B in the same run)")
    parser.add_argument("--skyrl-venv", type=Path, default=Path(os.environ.get("SKYRL_VENV", "/work/skyrl-venv")))
    parser.add_argument("--worker-env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="extra environment of the tinkerq worker (e.g. OMP_WAIT_POLICY=ACTIVE)")
    args = parser.parse_args()
    # A SIGTERM (a background run's only stop: it ignores SIGINT) unwinds the servers' context managers too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not (args.skyrl_venv / "uv-shim" / "uv").exists():
        sys.exit(f"no SkyRL venv at {args.skyrl_venv}: run bash benchmarks/skyrl_env.sh first")
    print(f"machine: {machine()}")
    print(f"loads: batch {args.prompts} prompts x {args.samples} samples, singles {args.singles} x 1 sample, "
          f"{args.tokens} new tokens, temperature 1; tinkerq worker --threads {args.threads} "
          f"{' '.join(args.worker_env)}; SkyRL --backend jax {json.dumps(SKYRL_CONFIG)}; SDK 0.25; {args.reps} reps")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            results = run_model(name, args, Path(tmp))
            summarise(name, results)


if __name__ == "__main__":
    main()

"""Reproducibility: six tenants sharing three workers' passes, compared bitwise across two runs.

One private redis-server (AOF, everysec: it can be SIGKILLed and restarted) and three ``tinkerq worker
--threads 1`` processes serving the same small Llama (``build_llama``, fixed seed) under one name, with a
shared TINKERQ_CHECKPOINT_DIR (adoption reads the automatic snapshots there) and a 1 s heartbeat. Six tenants
open training sessions: four LoRA (``create_lora_training_client``, ranks ``--ranks``, a fixed seed each) and
two full-parameter (``create_training_client``). Each tenant, in its own thread and all at once, pipelines
``--steps`` forward_backward (cross_entropy) + optim_step pairs (``--window`` pairs in flight) on its own
fixed-seed data: variable-length datums whose prompt positions weigh zero; AdamW with Tinker's default
eps 1e-12. So LoRA tenants placed on the same worker share its passes, in combinations that depend on timing:
before a random fifth of its pairs a tenant waits for its pipeline to drain and pauses a random 0..``--pause``
s (unseeded: timing only), so a request meets different partners, or none, from pass to pass and from run to
run (without pauses, tenants on one worker kept their queues full and ran every pass together, in lockstep).
At the end each tenant runs a forward on one fixed probe batch (per-token logprobs) and a ``save_state``,
whose safetensors (weights, AdamW moments) are read back here.

The whole thing runs twice, each time on a fresh fleet (new Redis, new workers, new checkpoint directory), with
the same seeds and data. With ``--faults`` the second run also SIGKILLs, once ``--kill-at`` of all steps
are answered, the worker holding the most sessions, as soon as each of its sessions has journaled
``--min-journal`` requests since its automatic snapshot (another worker adopts them: automatic snapshot +
journal replay, docs/reliability.md; right after a snapshot there would be nothing to replay), and, once
``--redis-at`` are answered, SIGKILLs Redis and restarts it from its AOF after ``--redis-down`` seconds
(producers and workers ride through).

Per tenant it prints the largest |difference| between the two runs of the probe's logprobs, of the weights and
of the AdamW moments, the first step whose loss differs, and whether everything is bitwise equal. Timings are
printed as figures only; nothing asserts on them, and the exit status is 0 whether or not the runs are bitwise.

    .venv/bin/python benchmarks/reproducibility.py [--steps 150] [--faults] [--hidden 128 --layers 4 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis
from _fleet import build_llama, machine, print_table

from tinkerq import keys, types
from tinkerq.launcher.processes import free_port, start_process, start_redis, wait_for, worker_command

NAME = "repro-llama"  # the name the three workers serve the model under
PROBE_SEED = 424242


@dataclass
class Tenant:
    name: str
    rank: int | None  # None: full-parameter
    seed: int  # the LoRA adapter's seed
    data_seed: int
    lr: float

    @property
    def kind(self) -> str:
        return "full" if self.rank is None else f"LoRA r{self.rank}"


@dataclass
class Outcome:
    """What one tenant ended a run with."""

    losses: list[float] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    moments: dict[str, np.ndarray] = field(default_factory=dict)
    first_worker: str = ""
    last_worker: str = ""
    seconds: float = float("nan")
    error: str = ""


def tenants(args: argparse.Namespace) -> list[Tenant]:
    out = [Tenant(f"lora{i}", rank, seed=100 + i, data_seed=1000 + i, lr=args.lora_lr)
           for i, rank in enumerate(args.ranks)]
    out += [Tenant(f"full{i}", None, seed=0, data_seed=2000 + i, lr=args.full_lr) for i in range(args.full)]
    return out


def datum(rng: np.random.Generator, vocab: int, length: int) -> types.Datum:
    """``length`` positions; the first 1..length/2 (the prompt) weigh zero, the rest one."""
    tokens = rng.integers(0, vocab, length + 1, dtype=np.int64)
    prompt = int(rng.integers(1, max(2, length // 2 + 1)))
    weights = (np.arange(length) >= prompt).astype(np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
                       loss_fn_inputs={"target_tokens": tokens[1:].tolist(), "weights": weights})


def tenant_data(tenant: Tenant, args: argparse.Namespace) -> list[list[types.Datum]]:
    """The tenant's ``--steps`` batches: ``--datums`` (min max) datums of ``--lengths`` (min max) tokens each."""
    rng = np.random.default_rng(tenant.data_seed)
    batches = []
    for _ in range(args.steps):
        n = int(rng.integers(args.datums[0], args.datums[1] + 1))
        batches.append([datum(rng, args.vocab, int(rng.integers(args.lengths[0], args.lengths[1] + 1)))
                        for _ in range(n)])
    return batches


def probe_batch(args: argparse.Namespace) -> list[types.Datum]:
    rng = np.random.default_rng(PROBE_SEED)
    return [datum(rng, args.vocab, length) for length in (7, args.lengths[1], 23, args.lengths[0], 40)]


def adam(tenant: Tenant) -> types.AdamParams:
    return types.AdamParams(learning_rate=tenant.lr, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.01,
                            grad_clip_norm=1.0)


# -- the fleet ----------------------------------------------------------------------------------------------


class Fleet:
    """A private durable Redis and ``--workers`` workers serving NAME; killed and restarted by the fault run."""

    def __init__(self, model_dir: Path, args: argparse.Namespace) -> None:
        self.model_dir, self.args = model_dir, args
        self.work = Path(tempfile.mkdtemp(prefix="tinkerq-repro-"))
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.redis_proc: subprocess.Popen | None = None
        self.procs: dict[int, subprocess.Popen] = {}  # pid -> worker process
        self.metrics_ports: dict[int, int] = {}  # pid -> its Prometheus port
        self.index: dict[int, int] = {}  # pid -> w0, w1, ...
        self.lora_passes: dict[int, tuple[int, int]] = {}  # pid -> (passes, requests), the latest scrape

    def start(self) -> None:
        self.redis_proc = start_redis(self.port, self.work / "redis", durable=True)
        client = redis.Redis(port=self.port)
        started = []
        for i in range(self.args.workers):  # started together, waited for together
            port = free_port()
            env = {"TINKERQ_CHECKPOINT_DIR": str(self.work / "ckpt"), "TINKERQ_HEARTBEAT_S": "1",
                   "TINKERQ_AUTO_SNAPSHOT_STEPS": str(self.args.snapshot_steps), "TINKERQ_METRICS_PORT": str(port)}
            log = self.work / f"w{i}.log"
            proc = start_process(worker_command(str(self.model_dir), self.url, threads=self.args.threads,
                                                extra=["--name", NAME]), log, env)
            self.procs[proc.pid], self.metrics_ports[proc.pid], self.index[proc.pid] = proc, port, i
            started.append((proc, log))
        try:
            for proc, log in started:
                wait_for(lambda p=proc.pid: any(json.loads(client.get(k) or b"{}").get("pid") == p
                                                for k in client.scan_iter(keys.serving_pattern(NAME))),
                         300, f"worker {proc.pid}", proc, log)
        finally:
            client.close()

    def log(self, pid: int) -> Path:
        return self.work / f"w{self.index[pid]}.log"

    def label(self, worker_id: str) -> str:
        """w0, w1, ... for a worker id (``host-pid-hex``)."""
        try:
            return f"w{self.index[int(worker_id.rsplit('-', 2)[1])]}"
        except (ValueError, IndexError, KeyError):
            return worker_id or "?"

    def scrape(self) -> None:
        """Note each live worker's LoRA pass counters (tinkerq_lora_passes / tinkerq_lora_pass_requests)."""
        for pid, port in self.metrics_ports.items():
            if self.procs[pid].poll() is not None:
                continue
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                    text = response.read().decode()
            except OSError:
                continue
            found = {m.group(1): float(m.group(2))
                     for m in re.finditer(r"^(tinkerq_lora_pass(?:es|_requests)) ([0-9.e+]+)$", text, re.M)}
            if "tinkerq_lora_passes" in found:
                self.lora_passes[pid] = (int(found["tinkerq_lora_passes"]),
                                         int(found.get("tinkerq_lora_pass_requests", 0)))

    def kill_worker(self, worker_id: str) -> None:
        pid = int(worker_id.rsplit("-", 2)[1])
        self.scrape()  # its pass counters, while it is alive
        os.kill(pid, signal.SIGKILL)
        self.procs[pid].wait(30)

    def restart_redis(self, down_s: float) -> float:
        """SIGKILL redis-server, wait ``down_s``, start it again on the same port from its AOF; seconds down."""
        assert self.redis_proc is not None
        self.redis_proc.send_signal(signal.SIGKILL)
        self.redis_proc.wait(10)
        t = time.monotonic()
        time.sleep(down_s)
        self.redis_proc = start_redis(self.port, self.work / "redis", durable=True)
        return time.monotonic() - t

    def log_lines(self, pattern: str) -> list[str]:
        out = []
        for pid in self.procs:
            out += [f"w{self.index[pid]}: {line.strip()}" for line in self.log(pid).read_text(errors="replace")
                    .splitlines() if re.search(pattern, line)]
        return out

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self.redis_proc is not None and self.redis_proc.poll() is None:
            self.redis_proc.terminate()
            self.redis_proc.wait(10)
        shutil.rmtree(self.work, ignore_errors=True)


# -- one run ------------------------------------------------------------------------------------------------


class Progress:
    """Optimizer steps answered, over all tenants; the fault thread waits on it."""

    def __init__(self) -> None:
        self.done = 0
        self.cond = threading.Condition()

    def step(self) -> None:
        with self.cond:
            self.done += 1
            self.cond.notify_all()

    def wait(self, count: int, stop: threading.Event) -> bool:
        with self.cond:
            while self.done < count and not stop.is_set():
                self.cond.wait(0.5)
            return not stop.is_set()


def home(r: redis.Redis, model_id: str) -> str:
    try:
        raw = r.get(keys.session_home(model_id))
        return str(json.loads(raw)["worker"]) if raw else ""
    except (redis.RedisError, ValueError, KeyError):
        return ""


def train(tc: Any, tenant: Tenant, batches: list[list[types.Datum]], probe: list[types.Datum],
          args: argparse.Namespace, start: threading.Barrier, progress: Progress, out: Outcome) -> None:
    """One tenant: pipelined pairs, then the probe's forward and a save_state read back from disk."""
    from safetensors.numpy import load_file

    try:
        pace = random.Random()  # unseeded: timing only (which requests meet in a pass), never the data
        start.wait()
        t0 = time.monotonic()
        inflight: list[tuple[Any, Any]] = []

        def finish(fb: Any, opt: Any) -> None:
            out.losses.append(float(fb.result(timeout=args.timeout).metrics["loss:sum"]))
            opt.result(timeout=args.timeout)
            progress.step()

        for b in batches:
            if args.pause and pace.random() < 0.2:  # now and then a tenant drains its pipeline and pauses
                while inflight:
                    finish(*inflight.pop(0))
                time.sleep(pace.uniform(0, args.pause))
            inflight.append((tc.forward_backward(b, "cross_entropy"), tc.optim_step(adam(tenant))))
            while len(inflight) >= args.window:
                finish(*inflight.pop(0))
        for pair in inflight:
            finish(*pair)
        out.seconds = time.monotonic() - t0
        fwd = tc.forward(probe, "cross_entropy").result(timeout=args.timeout)
        out.logprobs = [o["logprobs"].to_numpy().copy() for o in fwd.loss_fn_outputs]
        path = Path(tc.save_state(f"repro-{tenant.name}").result(timeout=args.timeout).path)
        for file in sorted(path.glob("*.safetensors")):
            if file.name == "gradients.safetensors":
                continue  # pending gradients: none after an optim_step
            target = out.moments if file.name == "optimizer.safetensors" else out.weights
            target.update({k: np.array(v) for k, v in load_file(str(file)).items()})
    except Exception as exc:  # reported in the table
        out.error = f"{type(exc).__name__}: {str(exc)[:200]}"


def faults(fleet: Fleet, clients: dict[str, Any], total: int, args: argparse.Namespace,
           progress: Progress, stop: threading.Event, events: list[str]) -> None:
    """Kill the busiest worker at ``--kill-at`` of the steps, then Redis at ``--redis-at``."""
    r = redis.Redis(port=fleet.port)
    try:
        if not progress.wait(int(args.kill_at * total), stop):
            return
        homes = {name: home(r, tc.model_id) for name, tc in clients.items()}
        counts: dict[str, int] = {}
        for worker in homes.values():
            if worker:
                counts[worker] = counts.get(worker, 0) + 1
        lost = min(counts, key=lambda w: (-counts[w], fleet.label(w)))
        moved = sorted(name for name, w in homes.items() if w == lost)
        # Kill once each of its sessions has journaled requests since its automatic snapshot (right after a
        # snapshot an adoption replays nothing, which would test less); at most 30 s later.
        ids = [clients[n].model_id for n in moved]
        deadline = time.monotonic() + 30
        while (time.monotonic() < deadline and not stop.is_set()
               and min(r.llen(keys.journal(i)) for i in ids) < args.min_journal):
            time.sleep(0.02)
        journals = [r.llen(keys.journal(i)) for i in ids]
        fleet.kill_worker(lost)
        events.append(f"SIGKILL {fleet.label(lost)} (holding {', '.join(moved)}; journals of "
                      f"{', '.join(map(str, journals))} requests) after {progress.done}/{total} steps")
        t = time.monotonic()
        wait_for(lambda: stop.is_set() or all(home(r, i) not in ("", lost) for i in ids), 120, "adoption")
        events.append(f"adopted within {time.monotonic() - t:.1f} s: "
                      + ", ".join(f"{n} -> {fleet.label(home(r, clients[n].model_id))}" for n in moved))
        if not progress.wait(max(int(args.redis_at * total), progress.done + 1), stop):
            return
        at = progress.done
        down = fleet.restart_redis(args.redis_down)
        events.append(f"SIGKILL redis-server after {at}/{total} steps, restarted from its AOF after {down:.1f} s")
    except Exception as exc:
        events.append(f"fault injection failed: {type(exc).__name__}: {exc}")
    finally:
        r.close()


def run(label: str, model_dir: Path, args: argparse.Namespace, with_faults: bool) -> tuple[dict[str, Outcome],
                                                                                            dict[str, Any]]:
    from tinkerq.producer import ServiceClient
    from tinkerq.settings import Settings

    plan = tenants(args)
    data = {t.name: tenant_data(t, args) for t in plan}
    probe = probe_batch(args)
    outcomes = {t.name: Outcome() for t in plan}
    events: list[str] = []
    fleet = Fleet(model_dir, args)
    t0 = time.monotonic()
    try:
        fleet.start()
        with ServiceClient(settings=Settings(broker_url=fleet.url, heartbeat_s=1.0)) as sc:
            futures = {}
            for t in plan:  # opened in a fixed order, all at once; whichever worker is free takes each
                futures[t.name] = (sc.create_training_client(NAME) if t.rank is None else
                                   sc.create_lora_training_client(NAME, rank=t.rank, seed=t.seed))
            clients = {name: f.result(timeout=args.timeout) for name, f in futures.items()}
            for name, tc in clients.items():
                outcomes[name].first_worker = fleet.label(tc.info.worker)
            progress, stop = Progress(), threading.Event()
            barrier = threading.Barrier(len(plan))
            threads = [threading.Thread(target=train, args=(clients[t.name], t, data[t.name], probe, args, barrier,
                                                            progress, outcomes[t.name]), name=t.name)
                       for t in plan]
            injector = None
            if with_faults:
                injector = threading.Thread(target=faults, args=(fleet, clients, args.steps * len(plan), args,
                                                                 progress, stop, events), daemon=True)
                injector.start()
            started = time.monotonic()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            train_s = time.monotonic() - started
            stop.set()
            if injector is not None:
                injector.join(60)
            r = redis.Redis(port=fleet.port)
            for name, tc in clients.items():
                outcomes[name].last_worker = fleet.label(home(r, tc.model_id))
            r.close()
            fleet.scrape()
            for tc in clients.values():
                tc.close()
        replays = fleet.log_lines(r"adopted session|differs from the lost worker")
        passes = sum(p for p, _ in fleet.lora_passes.values())
        requests = sum(q for _, q in fleet.lora_passes.values())
        info = {"label": label, "seconds": time.monotonic() - t0, "train_s": train_s, "events": events,
                "replays": replays, "lora_passes": passes, "lora_requests": requests,
                "by_worker": {f"w{fleet.index[pid]}": pr for pid, pr in sorted(fleet.lora_passes.items(),
                                                                             key=lambda kv: fleet.index[kv[0]])}}
    finally:
        fleet.stop()
    return outcomes, info


# -- comparing ----------------------------------------------------------------------------------------------


def max_diff(a: dict[str, np.ndarray] | list[np.ndarray], b: dict[str, np.ndarray] | list[np.ndarray]
             ) -> tuple[float, bool]:
    """Largest |a - b| over matching arrays, and whether all are bitwise equal (inf if they do not match up)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return float("inf"), False
        pairs = [(a[k], b[k]) for k in a]
    else:
        if len(a) != len(b):
            return float("inf"), False
        pairs = list(zip(a, b, strict=True))
    if not pairs:
        return float("inf"), False
    diff, equal = 0.0, True
    for x, y in pairs:
        if x.shape != y.shape:
            return float("inf"), False
        equal = equal and x.dtype == y.dtype and x.tobytes() == y.tobytes()
        if x.size:
            diff = max(diff, float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))))
    return diff, equal


def first_loss_difference(a: list[float], b: list[float]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"{i} ({abs(x - y):.2g})"
    return "-" if len(a) == len(b) else f"{min(len(a), len(b))} (length)"


def fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150, help="forward_backward + optim_step pairs per tenant")
    p.add_argument("--window", type=int, default=4, help="pairs each tenant keeps in flight")
    p.add_argument("--pause", type=float, default=0.4,
                   help="before a fifth of its pairs (random, unseeded) a tenant drains its pipeline and pauses "
                        "0..PAUSE s: varying pass partners")
    p.add_argument("--faults", action="store_true", help="second run: SIGKILL a worker, then Redis")
    p.add_argument("--kill-at", type=float, default=0.4, help="fraction of all steps answered before the worker kill")
    p.add_argument("--min-journal", type=int, default=4,
                   help="the worker kill waits (up to 30 s) until each of its sessions journaled this many requests")
    p.add_argument("--redis-at", type=float, default=0.7, help="... before the Redis kill")
    p.add_argument("--redis-down", type=float, default=2.0, help="seconds Redis stays down")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="each worker's torch threads")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16], help="one LoRA tenant per rank")
    p.add_argument("--full", type=int, default=2, help="full-parameter tenants")
    p.add_argument("--lora-lr", type=float, default=1e-3)
    p.add_argument("--full-lr", type=float, default=3e-4)
    p.add_argument("--datums", type=int, nargs=2, default=[2, 4], metavar=("MIN", "MAX"), help="datums per batch")
    p.add_argument("--lengths", type=int, nargs=2, default=[8, 48], metavar=("MIN", "MAX"), help="tokens per datum")
    p.add_argument("--snapshot-steps", type=int, default=10, help="TINKERQ_AUTO_SNAPSHOT_STEPS")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any one answer may take")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--model-seed", type=int, default=0)
    args = p.parse_args()
    command = shlex.join([".venv/bin/python", "benchmarks/reproducibility.py", *sys.argv[1:]])
    config = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  max_position_embeddings=2048, tie_word_embeddings=False)
    print(machine(), flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="tinkerq-repro-model-"))
    try:
        model_dir = build_llama(tmp / "model", seed=args.model_seed, **config)
        from safetensors.numpy import load_file

        n_params = sum(v.size for f in model_dir.glob("*.safetensors") for v in load_file(str(f)).values())
        plan = tenants(args)
        print(f"model: Llama, {n_params / 1e6:.2f}M parameters ({config}); {len(plan)} tenants x {args.steps} "
              f"steps, {args.window} pairs in flight each (pauses up to {args.pause:g} s), {args.workers} workers "
              f"--threads {args.threads}",
              flush=True)
        runs = []
        for i, label in enumerate(("run 1", "run 2 (faults)" if args.faults else "run 2")):
            outcomes, info = run(label, model_dir, args, with_faults=args.faults and i == 1)
            runs.append((outcomes, info))
            mean = info["lora_requests"] / info["lora_passes"] if info["lora_passes"] else float("nan")
            print(f"{label}: {info['seconds']:.1f} s in all, training {info['train_s']:.1f} s "
                  f"({args.steps * len(plan) / info['train_s']:.1f} steps/s over all tenants); LoRA passes "
                  f"{info['lora_passes']} for {info['lora_requests']} requests ({mean:.2f} per pass; "
                  + ", ".join(f"{w} {p_}/{q}" for w, (p_, q) in info["by_worker"].items() if p_)
                  + f"); {machine()}", flush=True)
            for line in info["events"] + info["replays"]:
                print(f"  {line}")
            for name, o in outcomes.items():
                if o.error:
                    print(f"  {name}: ERROR {o.error}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    (a, _), (b, _) = runs
    rows, differ = [], []
    for t in plan:
        x, y = a[t.name], b[t.name]
        probe_d, probe_eq = max_diff(x.logprobs, y.logprobs)
        weight_d, weight_eq = max_diff(x.weights, y.weights)
        moment_d, moment_eq = max_diff(x.moments, y.moments)
        losses_eq = x.losses == y.losses and len(x.losses) == args.steps
        bitwise = probe_eq and weight_eq and moment_eq and losses_eq and not x.error and not y.error
        if not bitwise:
            differ.append(t.name)
        params = sum(v.size for v in x.weights.values())
        moved = y.first_worker if y.first_worker == y.last_worker else f"{y.first_worker}->{y.last_worker}"
        rows.append([t.name, t.kind, f"{params:,}", x.first_worker, moved, fmt(probe_d), fmt(weight_d),
                     fmt(moment_d), first_loss_difference(x.losses, y.losses),
                     "yes" if bitwise else ("ERROR" if x.error or y.error else "NO")])
    print()
    print_table(["tenant", "kind", "trained params", "run 1 on", "run 2 on", "probe max|dlogprob|",
                 "weights max|d|", "AdamW max|d|", "first loss diff (step)", "bitwise"], rows)
    print()
    if differ:
        print(f"NOT BITWISE: {len(differ)} of {len(plan)} tenants differ between the runs: {', '.join(differ)}")
    else:
        print(f"BITWISE: all {len(plan)} tenants equal across the two runs (probe logprobs, weights, AdamW "
              f"moments, every step's loss)")
    print(machine())
    print(f"command: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

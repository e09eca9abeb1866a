"""Tenants through two gateways: many SDK clients per API key, mixed training and sampling, a gateway restarted.

Issue 22, item 5: ``--keys`` (3) API keys x ``--clients`` (16) official SDK clients (tinker 0.38.0, one thread each)
for ``--duration`` (300) seconds through two ``tinkerq gateway`` processes behind ``tinkerq proxy`` (round robin per
TCP connection), with one gateway killed and started again on the same port half-way. It starts, as
``tinkerq fleet up --gateways 2`` does and with the same command lines (``tinkerq.launcher.processes``): a private
``redis-server``, ``--workers`` (2) ``tinkerq worker --threads 1`` serving a tiny Llama (built here, seed 0; served
as ``tinkerq-bench/tiny-llama``), the two gateways and the proxy; then creates the keys with ``tinkerq keys create``
(``--max-training-clients`` and ``--max-sampling-inflight`` set to the clients per key: the limits are exercised but
never reached).

Each client: ``tinker.ServiceClient(base_url=<proxy>, api_key=<its key>)``, one rank-4 LoRA training client, then a
loop until the deadline: ``forward_backward`` (2 datums of 8-24 tokens, cross_entropy) + ``optim_step`` (AdamW);
every 4th round a ``forward`` of the same batch; every 5th round a new sampler from
``save_weights_and_get_sampling_client``, every 5th round (offset) ``save_weights_for_sampler(name)`` (a checkpoint)
and ``create_sampling_client(model_path=...)`` on it; every round one ``sample`` (2 samples of up to 8 tokens, a
4-12-token prompt) from its latest sampler. Every call is waited for (``.result()``) before the next: its latency is
from submit to result. Every exception a call raises is an error, printed.

At ``--duration``/2 gateway 2 gets SIGKILL (``--restart-signal TERM`` for a graceful stop) and is started again on
its port. A call with no answer within ``--call-timeout`` (120 s) is an error and ends its client (a stuck training
run would otherwise hold the benchmark past its duration). Printed: per call kind p50/p99/max latency and counts
(and the calls in flight at the kill or started in the 30 s after it); the gateways' RSS (psutil) after warm-up,
before the restart and at the end, with the growth and slope; per key, the usage the fleet recorded (``tinkerq usage
--json``) against what the clients counted they sent, by the rules of docs/operations.md: training tokens (datum
lengths of their forward_backward and forward calls), prefill tokens (sample prompt lengths; cached_prefill the
part a sample's answer says was cached), sampled tokens (tokens returned), checkpoints (save_weights_for_sampler
calls) and ``requests_<op>`` per kind. Exit status 1 if any call failed or any usage counter differs. Nothing is
asserted on timings.

    .venv/bin/python benchmarks/tenants.py [--keys 3] [--clients 16] [--duration 300] [--workers 2]
                                           [--restart-signal KILL|TERM] [--call-timeout 120] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TINKER_TELEMETRY", "0")

from _fleet import TINY_LLAMA, build_llama, machine, percentile, print_table

from tinkerq.launcher.processes import (
    free_port,
    gateway_command,
    gateway_up,
    proxy_command,
    start_process,
    start_redis,
    wait_for,
    worker_command,
)

NAME = "tinkerq-bench/tiny-llama"
RANK = 4
DATUMS, MIN_LEN, MAX_LEN = 2, 8, 24
PROMPT_MIN, PROMPT_MAX, NUM_SAMPLES, MAX_TOKENS = 4, 12, 2, 8
SNAPSHOT_EVERY, CHECKPOINT_AT, FORWARD_EVERY = 5, 3, 4  # rounds: save_weights_and_get_sampling_client on i % 5 == 0,
#                                                         a named checkpoint + create_sampling_client on i % 5 == 3
AROUND_RESTART_S = 30.0
KINDS = ("create_lora_training_client", "forward_backward", "optim_step", "forward",
         "save_weights_and_get_sampling_client", "save_weights_for_sampler", "create_sampling_client", "sample")
COUNTERS = ("training_tokens", "prefill_tokens", "cached_prefill_tokens", "sampled_tokens", "checkpoints",
            "requests_forward_backward", "requests_forward", "requests_optim_step", "requests_create_sampler",
            "requests_save_weights_for_sampler", "requests_sample")
MIB = 1024 * 1024


# -- what the clients did -----------------------------------------------------------------------------------------


@dataclass
class Call:
    kind: str
    start: float  # time.monotonic() at submit
    seconds: float
    ok: bool


@dataclass
class Tally:
    """One key's clients' own count of what they sent and got (successful calls only), by the usage rules of
    docs/operations.md (gateway/jobs.py): forward and forward_backward datum lengths are training tokens, a sample's
    prompt is prefill (cached_prefill for the part its answer says came from the prompt cache), its returned
    tokens are sampled tokens, a save_weights_for_sampler is a checkpoint, and each answered request counts under
    ``requests_<op>`` (save_weights_and_get_sampling_client is op create_sampler; creates are not counted)."""

    counts: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)  # kind -> calls that raised (their usage is unknown)


class Book:
    """Every call of every client, the errors, and per key the client-side tally (thread-safe)."""

    def __init__(self, keys: list[str]) -> None:
        self.lock = threading.Lock()
        self.calls: list[Call] = []
        self.errors: list[tuple[float, str, str, str]] = []  # (when, client, kind, error)
        self.tally = {k: Tally() for k in keys}
        self.t0 = time.monotonic()  # reset when the clients start
        self.stopped: list[str] = []  # clients that stopped early: a call had no answer within --call-timeout

    def timed(self, client: str, key: str, kind: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """(True, what ``fn()`` returned), or (False, the exception it raised: an error, recorded and printed)."""
        t0 = time.monotonic()
        try:
            out = fn()
        except Exception as exc:
            seconds = time.monotonic() - t0
            text = f"{type(exc).__name__}: {exc}"
            with self.lock:
                self.calls.append(Call(kind, t0, seconds, False))
                self.errors.append((t0, client, kind, text + "\n" + traceback.format_exc(limit=6)))
                failed = self.tally[key].failed
                failed[kind] = failed.get(kind, 0) + 1
            print(f"  ERROR {client} {kind} after {seconds:.1f} s: {text[:300]}", flush=True)
            return False, exc
        with self.lock:
            self.calls.append(Call(kind, t0, time.monotonic() - t0, True))
        return True, out

    def add(self, key: str, **counts: int) -> None:
        with self.lock:
            tally = self.tally[key].counts
            for name, value in counts.items():
                tally[name] = tally.get(name, 0) + value


class SdkLog(logging.Handler):
    """Counts what the SDK logs at WARNING and above (its retries after a connection reset, a 5xx ...)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.first: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        if len(self.first) < 5:
            self.first.append(f"{record.name}: {record.getMessage()[:200]}")


def sdk_datums(rng: random.Random, vocab: int) -> tuple[list[Any], int]:
    import numpy as np
    import tinker

    data, tokens = [], 0
    for _ in range(DATUMS):
        length = rng.randint(MIN_LEN, MAX_LEN)
        seq = [rng.randrange(vocab) for _ in range(length + 1)]
        weights = np.array([0.0] * (length // 2) + [1.0] * (length - length // 2), dtype=np.float32)
        data.append(tinker.Datum(model_input=tinker.ModelInput.from_ints(seq[:-1]), loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_numpy(np.array(seq[1:], dtype=np.int64)),
            "weights": tinker.TensorData.from_numpy(weights)}))
        tokens += length
    return data, tokens


class ClientStuck(Exception):
    """A call had no answer within --call-timeout: the client stops."""


def run_client(book: Book, key_name: str, api_key: str, index: int, base_url: str, deadline: float,
               vocab: int, timeout: float) -> int:
    """One SDK client's loop until ``deadline`` (monotonic); returns the rounds it completed. A call with no answer
    within ``timeout`` s is an error that ends this client (its training run is stuck, e.g. on a missing request)."""
    import concurrent.futures

    import tinker

    me = f"{key_name}/c{index:02d}"
    rng = random.Random(f"{key_name}-{index}")
    adam = tinker.AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8)

    def call(kind: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
        ok, out = book.timed(me, key_name, kind, fn)
        if not ok and isinstance(out, concurrent.futures.TimeoutError):
            print(f"  {me} stops: a {kind} had no answer within {timeout:g} s (--call-timeout)", flush=True)
            raise ClientStuck
        return ok, out

    rounds = 0
    try:
        ok, sc = call("ServiceClient", lambda: tinker.ServiceClient(base_url=base_url, api_key=api_key))
        tc = None
        while ok and tc is None and time.monotonic() < deadline:
            ok_tc, tc = call("create_lora_training_client", lambda: sc.create_lora_training_client(
                NAME, rank=RANK, seed=index).result(timeout))
            if not ok_tc:
                tc = None
                time.sleep(1.0)
        if tc is None:
            return 0
        sampler = None
        while time.monotonic() < deadline:
            data, tokens = sdk_datums(rng, vocab)
            ok, _ = call("forward_backward", lambda d=data: tc.forward_backward(d, "cross_entropy").result(timeout))
            if ok:
                book.add(key_name, training_tokens=tokens, requests_forward_backward=1)
            ok, _ = call("optim_step", lambda: tc.optim_step(adam).result(timeout))
            if ok:
                book.add(key_name, requests_optim_step=1)
            if rounds % FORWARD_EVERY == 0:
                ok, _ = call("forward", lambda d=data: tc.forward(d, "cross_entropy").result(timeout))
                if ok:
                    book.add(key_name, training_tokens=tokens, requests_forward=1)
            if rounds % SNAPSHOT_EVERY == 0 or sampler is None:
                ok, new = call("save_weights_and_get_sampling_client",
                               lambda: tc.save_weights_and_get_sampling_client().result(timeout))
                if ok:
                    book.add(key_name, requests_create_sampler=1)
                sampler = new if ok else sampler
            elif rounds % SNAPSHOT_EVERY == CHECKPOINT_AT:
                name = f"c{index:02d}-r{rounds:04d}"
                ok, saved = call("save_weights_for_sampler",
                                 lambda n=name: tc.save_weights_for_sampler(n).result(timeout))
                if ok:
                    book.add(key_name, checkpoints=1, requests_save_weights_for_sampler=1)
                    ok, new = call("create_sampling_client",
                                   lambda p=saved.path: sc.create_sampling_client(model_path=p).result(timeout))
                    sampler = new if ok else sampler
            if sampler is not None:
                prompt = [rng.randrange(vocab) for _ in range(rng.randint(PROMPT_MIN, PROMPT_MAX))]
                params = tinker.SamplingParams(max_tokens=rng.randint(MAX_TOKENS // 2, MAX_TOKENS), temperature=1.0)
                ok, out = call("sample", lambda s=sampler, p=prompt, q=params: s.sample(
                    prompt=tinker.ModelInput.from_ints(p), num_samples=NUM_SAMPLES, sampling_params=q).result(timeout))
                if ok:
                    cached = int(getattr(out, "prompt_cache_hit_tokens", 0) or 0)
                    book.add(key_name, prefill_tokens=len(prompt) - cached, cached_prefill_tokens=cached,
                             sampled_tokens=sum(len(seq.tokens) for seq in out.sequences), requests_sample=1)
            rounds += 1
        return rounds
    except ClientStuck:
        with book.lock:
            book.stopped.append(me)
        return rounds


# -- the fleet ------------------------------------------------------------------------------------------------------


class Processes:
    """Redis, workers, two gateways and the proxy, as `tinkerq fleet up --gateways 2` starts them."""

    def __init__(self, workdir: Path, workers: int, samplers_cached: int) -> None:
        self.workdir = workdir
        self.logs = workdir / "logs"
        self.redis_port = free_port()
        self.broker = f"redis://127.0.0.1:{self.redis_port}/0"
        self.gateway_ports = [free_port(), free_port()]
        self.proxy_port = free_port()
        self.url = f"http://127.0.0.1:{self.proxy_port}"
        self.n_workers = workers
        self.samplers_cached = samplers_cached
        self.redis: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self.gateways: list[subprocess.Popen] = []
        self.proxy: subprocess.Popen | None = None

    def start(self, model_dir: Path) -> None:
        from tinkerq.connection import Connection
        from tinkerq.settings import Settings

        self.redis = start_redis(self.redis_port, self.workdir / "redis")
        env = {"TINKERQ_CHECKPOINT_DIR": str(self.workdir / "checkpoints"),
               "TINKERQ_SAMPLER_CACHE_SIZE": str(self.samplers_cached)}
        for i in range(self.n_workers):
            cmd = worker_command(str(model_dir), self.broker, threads=1, extra=["--served-name", NAME])
            self.workers.append(start_process(cmd, self.logs / f"worker-{i}.log", env))
        conn = Connection.open(Settings(broker_url=self.broker))
        try:
            wait_for(lambda: len(conn.workers_serving(NAME)) >= self.n_workers, 240, f"{self.n_workers} workers",
                     self.workers[0], self.logs / "worker-0.log")
        finally:
            conn.close()
        for i in range(2):
            self.gateways.append(self.start_gateway(i))
        self.proxy = start_process(proxy_command(self.proxy_port, self.gateway_ports), self.logs / "proxy.log")
        wait_for(lambda: gateway_up(self.url), 60, "tinkerq proxy", self.proxy, self.logs / "proxy.log")

    def start_gateway(self, i: int) -> subprocess.Popen:
        log = self.logs / f"gateway-{i}.log"
        proc = start_process(gateway_command(self.broker, self.gateway_ports[i]), log)
        wait_for(lambda: gateway_up(f"http://127.0.0.1:{self.gateway_ports[i]}"), 120, f"gateway {i}", proc, log)
        return proc

    def restart_gateway(self, i: int, sig: signal.Signals) -> tuple[float, float]:
        """Stop gateway ``i`` with ``sig`` and start it again on its port: (seconds to exit, seconds down)."""
        proc = self.gateways[i]
        t0 = time.monotonic()
        proc.send_signal(sig)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        exited = time.monotonic() - t0
        with (self.logs / f"gateway-{i}.log").open("a") as f:
            f.write(f"\n===== benchmark: stopped with {sig.name}, starting again =====\n")
        self.gateways[i] = self.start_gateway(i)
        return exited, time.monotonic() - t0

    def cli(self, *args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "tinkerq.launcher.main", *args], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "TINKERQ_BROKER_URL": self.broker})
        if out.returncode != 0:
            raise RuntimeError(f"tinkerq {' '.join(args)} failed: {out.stderr[-2000:]}")
        return out.stdout

    def stop(self) -> None:
        """The proxy and gateways, then the workers, then Redis (as `tinkerq fleet down`: the broker last)."""
        for stage in ([self.proxy, *self.gateways], self.workers, [self.redis]):
            for proc in stage:
                if proc is not None and proc.poll() is None:
                    proc.terminate()
            for proc in stage:
                if proc is None:
                    continue
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


def rss_bytes(pid: int) -> int | None:
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except ImportError:
        pass
    except Exception:  # gone (being restarted)
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class RssSampler(threading.Thread):
    """Every ``every`` s: the RSS of each gateway slot (the restarted one's new process after the restart)."""

    def __init__(self, fleet: Processes, t0: float, every: float) -> None:
        super().__init__(name="rss", daemon=True)
        self.fleet, self.t0, self.every = fleet, t0, every
        self.samples: list[tuple[float, str, int]] = []  # (seconds since t0, process, bytes)
        self.stop = threading.Event()

    def sample(self) -> None:
        t = time.monotonic() - self.t0
        procs = [(f"gateway-{i}", p) for i, p in enumerate(self.fleet.gateways)]
        procs += [("proxy", self.fleet.proxy)] + [(f"worker-{i}", p) for i, p in enumerate(self.fleet.workers)]
        for name, proc in procs:
            value = None if proc is None or proc.poll() is not None else rss_bytes(proc.pid)
            if value is not None:
                self.samples.append((t, name, value))

    def run(self) -> None:
        while not self.stop.wait(self.every):
            self.sample()

    def at(self, name: str, t: float, after: bool = True) -> tuple[float, int] | None:
        """The first sample of ``name`` at or after ``t`` (or the last at or before it)."""
        found = [(s, v) for s, n, v in self.samples if n == name and (s >= t if after else s <= t)]
        if not found:
            return None
        return found[0] if after else found[-1]

    def slope_mib_per_min(self, name: str, start: float, end: float) -> float | None:
        points = [(s, v / MIB) for s, n, v in self.samples if n == name and start <= s <= end]
        if len(points) < 3:
            return None
        mx = sum(s for s, _ in points) / len(points)
        my = sum(v for _, v in points) / len(points)
        den = sum((s - mx) ** 2 for s, _ in points)
        return 60 * sum((s - mx) * (v - my) for s, v in points) / den if den else None


# -- the run --------------------------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=3, help="API keys (tenants); default 3")
    p.add_argument("--clients", type=int, default=16, help="SDK clients per key; default 16")
    p.add_argument("--duration", type=float, default=300.0, help="seconds the clients run; default 300")
    p.add_argument("--workers", type=int, default=2, help="`tinkerq worker --threads 1` processes; default 2")
    p.add_argument("--restart-signal", choices=("KILL", "TERM"), default="KILL",
                   help="how gateway 2 is stopped half-way (default KILL, i.e. kill -9)")
    p.add_argument("--call-timeout", type=float, default=120.0,
                   help="seconds a call may take; one that takes longer is an error and ends its client (default 120)")
    p.add_argument("--rss-every", type=float, default=5.0, help="seconds between RSS samples; default 5")
    p.add_argument("--keep", action="store_true", help="keep the work folder (logs) and print where it is")
    args = p.parse_args()
    import tinker

    sdk_log = SdkLog()
    logging.getLogger("tinker").addHandler(sdk_log)
    print(f"machine: {machine()}")
    print(f"tinker {tinker.__version__}; {args.keys} keys x {args.clients} SDK clients for {args.duration:g} s through "
          f"2 gateways behind tinkerq proxy; {args.workers} worker(s) --threads 1; gateway 2 restarted "
          f"({args.restart_signal}) at {args.duration / 2:g} s", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="tinkerq-tenants-"))
    total_clients = args.keys * args.clients
    fleet = Processes(workdir, args.workers, samplers_cached=total_clients)
    status = 1
    try:
        model_dir = build_llama(workdir / "model", **TINY_LLAMA)
        t_up = time.monotonic()
        fleet.start(model_dir)
        print(f"fleet up in {time.monotonic() - t_up:.1f} s: redis {fleet.broker}, workers "
              f"{[w.pid for w in fleet.workers]}, gateways on {fleet.gateway_ports} behind proxy {fleet.url}",
              flush=True)
        keys: dict[str, str] = {}
        for k in range(args.keys):
            name = f"tenant-{k}"
            out = fleet.cli("keys", "create", name, "--max-training-clients", str(args.clients),
                            "--max-sampling-inflight", str(args.clients))
            keys[name] = out.strip().splitlines()[-1]
        status = run(args, fleet, keys, sdk_log, TINY_LLAMA["vocab_size"])
    finally:
        fleet.stop()
        if args.keep:
            print(f"work folder (logs): {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return status


def run(args: argparse.Namespace, fleet: Processes, keys: dict[str, str], sdk_log: SdkLog, vocab: int) -> int:
    book = Book(list(keys))
    t0 = book.t0 = time.monotonic()
    deadline = t0 + args.duration
    restart_at = t0 + args.duration / 2
    rss = RssSampler(fleet, t0, args.rss_every)
    rss.sample()
    rss.start()
    rounds: dict[str, int] = {}
    threads = []
    for key_name, api_key in keys.items():
        for i in range(args.clients):
            def body(k: str = key_name, a: str = api_key, i: int = i) -> None:
                rounds[f"{k}/{i}"] = run_client(book, k, a, i, fleet.url, deadline, vocab, args.call_timeout)
            threads.append(threading.Thread(target=body, name=f"{key_name}-{i}", daemon=True))
    for t in threads:
        t.start()
    restarted: tuple[float, float] | None = None
    kill_t = None
    next_report = t0 + min(15.0, args.duration / 4)
    while any(t.is_alive() for t in threads):
        now = time.monotonic()
        if restarted is None and now >= restart_at:
            kill_t = now - t0
            print(f"  [{kill_t:5.0f} s] restarting gateway 2 ({args.restart_signal}) ...", flush=True)
            restarted = fleet.restart_gateway(1, signal.Signals[f"SIG{args.restart_signal}"])
            print(f"  [{time.monotonic() - t0:5.0f} s] gateway 2 exited {restarted[0]:.1f} s after the signal and "
                  f"serves again {restarted[1]:.1f} s after it", flush=True)
        if now >= next_report:
            with book.lock:
                n, errors = len(book.calls), len(book.errors)
            last = {name: v for _, name, v in rss.samples[-6:]}
            print(f"  [{now - t0:5.0f}/{args.duration:.0f} s] {n} calls ({n / (now - t0):.1f}/s), {errors} errors, "
                  f"gateway RSS {last.get('gateway-0', 0) / MIB:.1f} / {last.get('gateway-1', 0) / MIB:.1f} MiB",
                  flush=True)
            next_report = now + 30.0
        time.sleep(0.2)
    t_end = time.monotonic() - t0
    rss.stop.set()
    rss.sample()
    time.sleep(1.0)  # answers are accounted before they are stored, so every answered call is counted by now
    usage = json.loads(fleet.cli("usage", "--json", "--by", "key"))
    return report(args, fleet, book, rss, rounds, usage, sdk_log, t_end, kill_t, restarted)


def latency_rows(calls: list[Call]) -> list[list[Any]]:
    rows = []
    for kind in KINDS:
        ms = [1000 * c.seconds for c in calls if c.kind == kind and c.ok]
        failed = sum(1 for c in calls if c.kind == kind and not c.ok)
        if ms or failed:
            rows.append([kind, len(ms), failed, *(
                (percentile(ms, 50), percentile(ms, 99), max(ms)) if ms else ("-", "-", "-"))])
    return rows


def report(args: argparse.Namespace, fleet: Processes, book: Book, rss: RssSampler, rounds: dict[str, int],
           usage: dict[str, Any], sdk_log: SdkLog, t_end: float, kill_t: float | None,
           restarted: tuple[float, float] | None) -> int:
    calls = book.calls
    total_rounds = sum(rounds.values())
    print(f"\nclients done after {t_end:.1f} s: {len(calls)} calls ({len(calls) / t_end:.1f}/s), {total_rounds} rounds "
          f"({min(rounds.values(), default=0)}-{max(rounds.values(), default=0)} per client); {machine()}")
    print("\nlatency per call kind, submit to result (ms; p99 nearest rank):")
    print_table(["kind", "ok", "errors", "p50", "p99", "max"], latency_rows(calls))
    if kill_t is not None and restarted is not None:
        around = [c for c in calls if kill_t <= c.start - book.t0 + c.seconds
                  and c.start - book.t0 < kill_t + AROUND_RESTART_S]
        print(f"\ncalls in flight at the kill (t = {kill_t:.0f} s) or started in the {AROUND_RESTART_S:g} s after it "
              f"(gateway 2 exited {restarted[0]:.1f} s after the signal, served again after {restarted[1]:.1f} s):")
        print_table(["kind", "ok", "errors", "p50", "p99", "max"], latency_rows(around))
    print(f"\nSDK log lines at WARNING or above (retries): {sdk_log.count}")
    for line in sdk_log.first:
        print(f"  {line}")

    # -- memory
    warm = min(60.0, args.duration * 0.2)
    mid = args.duration / 2 if kill_t is None else kill_t
    print(f"\ngateway RSS (MiB; sampled every {args.rss_every:g} s; 'from' is {warm:g} s after the process's clients "
          f"started, to let it warm up):")
    spans = [("gateway-0 (kept)", "gateway-0", warm, mid, t_end)]
    if kill_t is None:
        spans.append(("gateway-1", "gateway-1", warm, mid, t_end))
    else:
        spans += [("gateway-1 before the restart", "gateway-1", warm, None, mid),
                  ("gateway-1 after the restart (new process)", "gateway-1", mid + warm, None, t_end)]
    rows = []
    for label, name, start, middle, end in spans:
        first, last = rss.at(name, start), rss.at(name, end, after=False)
        between = None if middle is None else rss.at(name, middle, after=False)
        slope = rss.slope_mib_per_min(name, start, end)
        if first is None or last is None or last[0] < first[0]:
            rows.append([label, "-", "-", "-", "-", "-", "-"])
            continue
        growth = (last[1] - first[1]) / MIB
        rows.append([label, f"{first[1] / MIB:.1f} @{first[0]:.0f}s",
                     "-" if between is None else f"{between[1] / MIB:.1f} @{between[0]:.0f}s",
                     f"{last[1] / MIB:.1f} @{last[0]:.0f}s", f"{growth:+.1f}",
                     f"{100 * growth / (first[1] / MIB):+.1f}%", "-" if slope is None else f"{slope:+.2f}"])
    print_table(["process", "from", "middle", "to", "growth MiB", "growth", "slope MiB/min"], rows)
    others = []
    for name in ["proxy", *(f"worker-{i}" for i in range(len(fleet.workers)))]:
        first, last = rss.at(name, warm), rss.at(name, t_end, after=False)
        if first is not None and last is not None:
            others.append(f"{name} {first[1] / MIB:.1f} -> {last[1] / MIB:.1f}")
    print("  others (MiB, after warm-up -> end): " + "; ".join(others))

    # -- usage
    print("\nusage per key: the fleet's record (tinkerq usage --json) vs what the clients counted they sent")
    recorded = {row["key"]: row["counts"] for row in usage["rows"]}
    rows, differ = [], 0
    for key_name, tally in book.tally.items():
        got = recorded.get(key_name, {})
        extra = sorted(set(got) - set(COUNTERS) - {"checkpoint_bytes"})  # a counter the clients do not know of
        for counter in [*COUNTERS, *extra]:
            want, have = tally.counts.get(counter, 0), int(got.get(counter, 0))
            same = want == have
            differ += not same
            rows.append([key_name, counter, want, have, "equal" if same else f"NOT EQUAL ({have - want:+d})"])
        rows.append([key_name, "checkpoint_bytes", "-", int(got.get("checkpoint_bytes", 0)), "(not known to clients)"])
        if tally.failed:
            rows.append([key_name, "calls that raised", sum(tally.failed.values()), "-", json.dumps(tally.failed)])
    print_table(["key", "counter", "clients sent", "fleet recorded", "check"], rows)

    # -- gateways' logs
    for i in range(2):
        text = (fleet.logs / f"gateway-{i}.log").read_text(errors="replace")
        adopted = text.count("adopting ")
        bad = [line for line in text.splitlines() if "Traceback" in line or " ERROR " in line or "ERROR:" in line]
        print(f"gateway-{i} log: {adopted} futures adopted, {len(bad)} error/traceback lines"
              + "".join(f"\n  {line[:240]}" for line in bad[:5]))
    proxy_log = (fleet.logs / "proxy.log").read_text(errors="replace")
    print(f"proxy log: {proxy_log.count('skipped for the next')} connections skipped a backend, "
          f"{proxy_log.count('answered 502')} answered 502")

    errors = len(book.errors)
    if errors:
        print(f"\nERRORS ({errors}):")
        for when, client, kind, text in book.errors[:20]:
            print(f"--- t={when - book.t0:.1f} s {client} {kind}\n{text}")
    if book.stopped:
        print(f"\nclients stopped early (a call had no answer within {args.call_timeout:g} s): {book.stopped}")
    verdict = "OK" if errors == 0 and differ == 0 else "FAILED"
    print(f"\nRESULT {verdict}: {errors} errors, {differ} usage counters differ, {len(calls)} calls, "
          f"{args.keys}x{args.clients} clients, {t_end:.0f} s")
    return 0 if verdict == "OK" else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        code = main()
        sys.stdout.flush()
        os._exit(code)  # the SDK's background threads (session heartbeats) would keep the process alive
    os._exit(130)

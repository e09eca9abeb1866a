"""Adoption: the time from a SIGKILLed worker to the first answer of its training session on another worker.

One private Redis; for each heartbeat period (TINKERQ_HEARTBEAT_S, the producer's too), two
``tinkerq worker --threads 1`` processes serve the same model under one name with a shared
TINKERQ_CHECKPOINT_DIR. Each repetition opens a training session (full, or rank-8 LoRA), runs ``--pairs``
pipelined forward_backward + optim_step pairs (so the session has an automatic snapshot and a journal
after it), submits ``--pending`` more pairs, and SIGKILLs the worker holding the session (the session record
names it) as soon as the first of those is answered. The other worker adopts the session (snapshot + journal
replay, docs/reliability.md) and the producer re-posts the pending requests there. Measured from the kill:

* the first answer after it (answers arriving in the first 0.3 s were already on their way from the lost
  worker and are not counted), and the last;
* when the adopter's claim (``tinkerq:adopting:<id>``) and then the rewritten session record appear in Redis
  (polled every 5 ms by this script): detection, then load + replay;
* the adopter's own log line "adopted session ... + N journaled request(s) replayed in X s".

A replacement worker is started after each kill (two are alive at every kill), and each kill waits until the
worker that will adopt has been up for 4 heartbeat periods (a worker adopts nothing before that: after an
outage every heartbeat looks old). Nothing asserts on timings.

    .venv/bin/python benchmarks/adoption.py [--periods 1 2 5] [--reps 3] [--kinds full lora] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis
from _fleet import TINY_LLAMA, build_llama, machine, median, print_table
from train_step import LLAMA_20M

from tinkerq import keys, types
from tinkerq.launcher.processes import free_port, start_process, start_redis, wait_for, worker_command

ADAM = types.AdamParams(learning_rate=1e-3)
GRACE_S = 0.3  # answers this soon after the kill were sent by the lost worker before it died
LORA_RANK = 8


def batch(rng: np.random.Generator, vocab: int, datums: int, seq: int) -> list[types.Datum]:
    out = []
    for _ in range(datums):
        tokens = rng.integers(0, vocab, seq + 1, dtype=np.int64)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:], "weights": np.ones(seq, np.float32)}))
    return out


class Workers:
    """The workers serving one name; started, killed and replaced here."""

    def __init__(self, model_dir: Path, url: str, name: str, env: dict[str, str], logs: Path) -> None:
        self.model_dir, self.url, self.name, self.env, self.logs = model_dir, url, name, env, logs
        self.redis = redis.Redis.from_url(url)
        self.procs: dict[int, Any] = {}  # pid -> Popen
        self.up_at: dict[int, float] = {}  # pid -> monotonic time its registration was first seen
        self.count = 0

    def log(self, pid: int) -> Path:
        return self.logs / f"{self.name}-{pid}.log"

    def start(self, n: int = 1) -> None:
        started = []
        for _ in range(n):  # started together, waited for together
            tmp_log = self.logs / f"{self.name}-new{self.count}.log"
            self.count += 1
            proc = start_process(worker_command(str(self.model_dir), self.url, threads=1,
                                                extra=["--name", self.name]), tmp_log, self.env)
            self.procs[proc.pid] = proc
            started.append((proc, tmp_log))
        for proc, tmp_log in started:
            wait_for(lambda p=proc.pid: self._registered(p), 180, f"worker {proc.pid}", proc, tmp_log)
            self.up_at[proc.pid] = time.monotonic()
            tmp_log.rename(self.log(proc.pid))  # the open file follows the rename

    def _registered(self, pid: int) -> bool:
        return any(json.loads(self.redis.get(k) or b"{}").get("pid") == pid
                   for k in self.redis.scan_iter(keys.serving_pattern(self.name)))

    def settle(self, heartbeat_s: float, holder: str) -> None:
        """Wait until the live workers other than ``holder`` may adopt: up for 4 heartbeat periods (a worker
        adopts nothing before that, worker/core/service.py)."""
        pid = int(holder.rsplit("-", 2)[1])
        ready = max(self.up_at[p] for p, proc in self.procs.items() if proc.poll() is None and p != pid)
        ready += 4 * heartbeat_s + 0.5
        time.sleep(max(0.0, ready - time.monotonic()))

    def kill(self, worker_id: str) -> None:
        pid = int(worker_id.rsplit("-", 2)[1])
        os.kill(pid, signal.SIGKILL)
        self.procs[pid].wait(30)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except Exception:
                proc.kill()
        self.redis.close()


def holder(r: redis.Redis, model_id: str) -> str:
    return json.loads(r.get(keys.session_home(model_id)))["worker"]


def watch(r: redis.Redis, model_id: str, lost: str, out: dict[str, float], stop: threading.Event) -> None:
    """Note when an adopter claims the session and when its record names another worker (monotonic)."""
    claim_key, home_key = keys.adopting(model_id), keys.session_home(model_id)
    while not stop.is_set():
        if "claim" not in out and r.exists(claim_key):
            out["claim"] = time.monotonic()
        raw = r.get(home_key)
        if raw and json.loads(raw)["worker"] != lost:
            out["record"] = time.monotonic()
            out.setdefault("claim", out["record"])  # claim and replay fell between two polls
            return
        stop.wait(0.005)


ADOPTED = re.compile(r"adopted session (\S+) of lost worker \S+: snapshot after request (\d+) \+ (\d+) journaled "
                     r"request\(s\) replayed in ([0-9.]+) s")


def adopted_line(log: Path, model_id: str) -> tuple[int, int, float] | None:
    for m in ADOPTED.finditer(log.read_text(errors="replace")):
        if m.group(1) == model_id:
            return int(m.group(2)), int(m.group(3)), float(m.group(4))
    return None


def one_kill(sc: Any, workers: Workers, kind: str, args: argparse.Namespace, vocab: int,
             rng: np.random.Generator) -> dict[str, Any]:
    if kind == "lora":
        tc = sc.create_lora_training_client(workers.name, rank=LORA_RANK, seed=0).result(timeout=300)
    else:
        tc = sc.create_training_client(workers.name).result(timeout=300)
    warm = []
    for _ in range(args.pairs):
        warm += [tc.forward_backward(batch(rng, vocab, args.datums, args.seq), "cross_entropy"), tc.optim_step(ADAM)]
    for f in warm:
        f.result(timeout=300)
    lost = holder(workers.redis, tc.model_id)
    workers.settle(args.heartbeat, lost)
    done_at: dict[int, float] = {}
    first_answer = threading.Event()
    pending = []
    for _ in range(args.pending):
        pending += [tc.forward_backward(batch(rng, vocab, args.datums, args.seq), "cross_entropy"),
                    tc.optim_step(ADAM)]
    for i, f in enumerate(pending):
        def note(_f: Any, i: int = i) -> None:
            done_at[i] = time.monotonic()
            first_answer.set()
        f.add_done_callback(note)
    first_answer.wait(120)  # the lost worker is busy with the batch when it dies
    seen: dict[str, float] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(redis.Redis.from_url(workers.url), tc.model_id, lost, seen, stop),
                               daemon=True)
    killed = time.monotonic()
    workers.kill(lost)
    watcher.start()
    errors = 0
    for f in pending:
        try:
            f.result(timeout=120 + 10 * args.heartbeat)
        except Exception:  # counted and reported
            errors += 1
    stop.set()
    watcher.join(10)
    after = sorted(t - killed for t in done_at.values() if t - killed > GRACE_S)
    adopter = holder(workers.redis, tc.model_id)
    line = adopted_line(workers.log(int(adopter.rsplit("-", 2)[1])), tc.model_id)
    tc.close()
    return {"first": after[0] if after else float("nan"), "last": after[-1] if after else float("nan"),
            "before": len(pending) - len(after), "pending": len(pending), "errors": errors,
            "claim": seen.get("claim", float("nan")) - killed, "record": seen.get("record", float("nan")) - killed,
            "snapshot_seq": line[0] if line else -1, "replayed": line[1] if line else -1,
            "replay_s": line[2] if line else float("nan")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--periods", type=float, nargs="+", default=[1.0, 2.0, 5.0], help="TINKERQ_HEARTBEAT_S")
    parser.add_argument("--reps", type=int, default=3, help="kills per period and session kind")
    parser.add_argument("--kinds", nargs="+", choices=["full", "lora"], default=["full"])
    parser.add_argument("--pairs", type=int, default=14, help="fb + optim pairs before the kill")
    parser.add_argument("--pending", type=int, default=6, help="pairs submitted just before the kill")
    parser.add_argument("--snapshot-steps", type=int, default=10, help="TINKERQ_AUTO_SNAPSHOT_STEPS")
    parser.add_argument("--datums", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--model", choices=["tiny", "20m"], default="tiny",
                        help="tiny: _fleet.TINY_LLAMA; 20m: benchmarks/train_step.py's model")
    parser.add_argument("--quick", action="store_true", help="smoke run: one period (1 s), one kill per kind")
    args = parser.parse_args()
    if args.quick:
        args.periods, args.reps, args.pairs, args.pending = [1.0], 1, 12, 3
    print(machine())
    config = LLAMA_20M if args.model == "20m" else TINY_LLAMA
    tmp = Path(tempfile.mkdtemp(prefix="tinkerq-adoption-"))
    rng = np.random.default_rng(0)
    rows = []
    redis_proc = None
    try:
        model_dir = build_llama(tmp / "model", **config)
        port = free_port()
        redis_proc = start_redis(port, tmp / "redis")
        url = f"redis://127.0.0.1:{port}/0"
        from tinkerq.producer import ServiceClient
        from tinkerq.settings import Settings

        for heartbeat in args.periods:
            args.heartbeat = heartbeat
            env = {"TINKERQ_HEARTBEAT_S": f"{heartbeat:g}", "TINKERQ_CHECKPOINT_DIR": str(tmp / "ckpt"),
                   "TINKERQ_AUTO_SNAPSHOT_STEPS": str(args.snapshot_steps)}
            workers = Workers(model_dir, url, f"adopt-hb{heartbeat:g}", env, tmp / "logs")
            sc = ServiceClient(settings=Settings(broker_url=url, heartbeat_s=heartbeat))
            try:
                workers.start(2)
                results: dict[str, list[dict[str, Any]]] = {k: [] for k in args.kinds}
                for rep in range(args.reps):
                    for kind in args.kinds:
                        r = one_kill(sc, workers, kind, args, config["vocab_size"], rng)
                        results[kind].append(r)
                        print(f"heartbeat {heartbeat:g} s, {kind}, kill {rep + 1}: first answer {r['first']:.2f} s, "
                              f"last {r['last']:.2f} s, claim {r['claim']:.2f} s, record {r['record']:.2f} s, "
                              f"{r['replayed']} replayed in {r['replay_s']:.1f} s "
                              f"(snapshot after request {r['snapshot_seq']}), "
                              f"{r['before']}/{r['pending']} answered before the kill, {r['errors']} errors",
                              flush=True)
                        workers.start(1)  # two alive at the next kill
                for kind, rs in results.items():
                    first = [r["first"] for r in rs]
                    rows.append([f"{heartbeat:g}", kind, len(rs), median(first), max(first),
                                 median(first) / heartbeat, median([r["last"] for r in rs]),
                                 median([r["claim"] for r in rs]),
                                 median([r["record"] - r["claim"] for r in rs]),
                                 median([r["first"] - r["record"] for r in rs]),
                                 f"{median([r['replayed'] for r in rs]):g}", median([r["replay_s"] for r in rs]),
                                 sum(r["errors"] for r in rs)])
            finally:
                sc.close()
                workers.stop()
        print(f"\n{args.model} model, {args.pairs} pairs then {args.pending} pending pairs of {args.datums} x "
              f"{args.seq} tokens, TINKERQ_AUTO_SNAPSHOT_STEPS={args.snapshot_steps}; seconds from the SIGKILL")
        print_table(["heartbeat s", "session", "kills", "first answer med", "max", "RATIO med/heartbeat",
                     "last answer med", "claim med", "claim->record med", "record->first med", "replayed entries",
                     "replay s (log)", "errors"], rows)
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

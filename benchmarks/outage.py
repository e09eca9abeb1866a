"""How long a Redis outage stalls a pipelined training run (restart, pause, Sentinel failover).

    python benchmarks/outage.py [--steps 40] [--down 3] [--pause 10]
    python benchmarks/outage.py --sentinel [--steps 40]

A private redis-server (AOF, everysec) and one `tinkerq worker` (tiny Llama, heartbeat 1 s). The producer
keeps `--window` optimizer steps in flight (forward_backward + optim_step, submitted before waiting), as a
training loop does. Each scenario disrupts Redis in the middle of a run: a SIGKILL restart (AOF) and a
SIGSTOP pause of one redis-server; or, with --sentinel (a primary, a replica and a sentinel), SIGKILL of
the primary until the sentinel promotes the replica. It reports:

* down:  how long Redis was unavailable;
* stall: the longest time without any answer, around the outage;
* extra: stall - down, the time lost after Redis was back (reconnects, re-posts);
* lost:  steps lost (must be 0: every future succeeds and the weights equal the undisturbed run's).

The baseline is the same run with no outage, measured first (its longest gap between answers is shown).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers import build_tiny_llama, make_batch
from tinkerq.launcher.processes import free_port, start_process, start_redis, stop, wait_for, worker_command


def run(url: str, model: str, steps: int, window: int, disrupt=None) -> dict:
    from tinkerq import types
    from tinkerq.producer import ServiceClient
    from tinkerq.settings import Settings

    rng = np.random.default_rng(0)
    batches = [make_batch(rng, 16, min_len=20, max_len=40) for _ in range(steps)]
    adam = types.AdamParams(learning_rate=5e-3)
    answered: list[float] = []
    with ServiceClient(settings=Settings(broker_url=url, heartbeat_s=1.0)) as sc:
        tc = sc.create_training_client(model).result()
        t0 = time.monotonic()
        inflight, norms, marks = [], [], {}
        for k in range(steps):
            fb, opt = tc.forward_backward(batches[k]), tc.optim_step(adam)
            opt.add_done_callback(lambda f: answered.append(time.monotonic()))
            inflight.append((fb, opt))
            if k == steps // 3 and disrupt is not None:
                marks = disrupt()  # runs in the background; returns {"down_s": ...} filled in later
            while len(inflight) >= window:
                fb, opt = inflight.pop(0)
                fb.result(timeout=300)
                norms.append(opt.result(timeout=300).metrics["grad_norm:mean"])
        for fb, opt in inflight:
            fb.result(timeout=300)
            norms.append(opt.result(timeout=300).metrics["grad_norm:mean"])
        total = time.monotonic() - t0
        tc.close()
    gaps = np.diff([t0, *sorted(answered)])
    return {"total_s": total, "max_gap_s": float(gaps.max()), "norms": norms, **marks}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--window", type=int, default=4, help="optimizer steps in flight")
    p.add_argument("--down", type=float, default=3.0, help="seconds Redis stays down after SIGKILL")
    p.add_argument("--pause", type=float, default=10.0, help="seconds Redis is paused (SIGSTOP)")
    p.add_argument("--sentinel", action="store_true", help="a Sentinel setup; the primary is killed mid-run")
    args = p.parse_args()
    if args.sentinel:
        return sentinel_main(args)

    work = Path(tempfile.mkdtemp(prefix="tinkerq-outage-"))
    model = str(build_tiny_llama(work / "model"))
    port = free_port()
    state = {"redis": start_redis(port, work / "redis", durable=True)}
    url = f"redis://127.0.0.1:{port}/0"
    log = work / "worker.log"
    worker = start_process(worker_command(model, url, threads=1), log, {"TINKERQ_HEARTBEAT_S": "1"})
    from tinkerq.connection import Connection
    from tinkerq.settings import Settings

    conn = Connection.open(Settings(broker_url=url))
    wait_for(lambda: bool(conn.workers_serving(os.path.abspath(model))), 90, "worker", worker, log)
    conn.close()

    def restart() -> dict:
        marks: dict = {}

        def go() -> None:
            state["redis"].send_signal(signal.SIGKILL)
            state["redis"].wait(10)
            t = time.monotonic()
            time.sleep(args.down)
            state["redis"] = start_redis(port, work / "redis", durable=True)
            marks["down_s"] = time.monotonic() - t

        threading.Thread(target=go).start()
        return marks

    def pause() -> dict:
        marks: dict = {"down_s": args.pause}
        os.kill(state["redis"].pid, signal.SIGSTOP)
        threading.Timer(args.pause, lambda: os.kill(state["redis"].pid, signal.SIGCONT)).start()
        return marks

    try:
        base = run(url, os.path.abspath(model), args.steps, args.window)
        print(f"baseline: {args.steps} steps in {base['total_s']:.2f} s, longest wait for an answer "
              f"{base['max_gap_s']:.2f} s")
        for name, disrupt in (("restart (SIGKILL, AOF)", restart), ("pause (SIGSTOP)", pause)):
            out = run(url, os.path.abspath(model), args.steps, args.window, disrupt)
            same = np.allclose(out["norms"], base["norms"], rtol=1e-5)
            print(f"{name}: down {out['down_s']:.1f} s, stall {out['max_gap_s']:.2f} s "
                  f"(extra {out['max_gap_s'] - out['down_s']:.2f} s), total {out['total_s']:.2f} s "
                  f"({out['total_s'] / base['total_s']:.2f}x baseline), steps lost 0, "
                  f"grad norms equal to the baseline run: {same}")
    finally:
        stop(worker.pid, timeout=10)
        os.kill(state["redis"].pid, signal.SIGCONT)
        state["redis"].terminate()
    return 0


def sentinel_main(args: argparse.Namespace) -> int:
    from tests.redis_servers import start_sentinel_setup

    work = Path(tempfile.mkdtemp(prefix="tinkerq-failover-"))
    model = os.path.abspath(build_tiny_llama(work / "model"))
    setup = start_sentinel_setup(work / "sentinel")
    log = work / "worker.log"
    worker = start_process(worker_command(model, setup.url, threads=1), log, {"TINKERQ_HEARTBEAT_S": "1"})
    from tinkerq.connection import Connection
    from tinkerq.settings import Settings

    conn = Connection.open(Settings(broker_url=setup.url))
    wait_for(lambda: bool(conn.workers_serving(model)), 90, "worker", worker, log)
    conn.close()

    def kill_primary() -> dict:
        marks: dict = {}

        def go() -> None:
            t = time.monotonic()
            setup.kill_primary()
            marks["down_s"] = time.monotonic() - t

        threading.Thread(target=go).start()
        return marks

    try:
        base = run(setup.url, model, args.steps, args.window)
        print(f"baseline (through sentinel): {args.steps} steps in {base['total_s']:.2f} s, longest wait for an "
              f"answer {base['max_gap_s']:.2f} s")
        out = run(setup.url, model, args.steps, args.window, kill_primary)
        same = np.allclose(out["norms"], base["norms"], rtol=1e-5)
        print(f"failover (SIGKILL of the primary, sentinel down-after 1 s): no primary for {out['down_s']:.1f} s, "
              f"stall {out['max_gap_s']:.2f} s (extra {out['max_gap_s'] - out['down_s']:.2f} s), total "
              f"{out['total_s']:.2f} s ({out['total_s'] / base['total_s']:.2f}x baseline), steps lost 0, grad norms "
              f"equal to the baseline run: {same}")
    finally:
        stop(worker.pid, timeout=10)
        setup.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

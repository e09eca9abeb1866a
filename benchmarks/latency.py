"""Round-trip latency of the smallest requests, beside raw Redis round trips measured in the same run.

Fleet: ``tc.echo({})`` and ``tc.forward`` of a 1-token datum (tiny model), each ~500 sequential calls.
Baselines: redis-py PING, SET + GET of 8 bytes, and a hand-rolled request/reply through Redis lists to
another process (LPUSH + BRPOP both ways), i.e. the floor for any queue-based round trip.

    .venv/bin/python benchmarks/latency.py [--calls 500] [--warmup 50]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _fleet import TINY_LLAMA, Fleet, build_llama, machine, median, percentile, print_table

from tinkerq import types

# A second process that answers every request pushed on bench:req by pushing it back on bench:rep.
LIST_ECHO = """
import sys, redis
r = redis.Redis(port=int(sys.argv[1]))
while True:
    _, body = r.brpop("bench:req")
    if body == b"stop":
        break
    r.lpush("bench:rep", body)
"""


def sample(fn: Callable[[], object], calls: int, warmup: int) -> list[float]:
    """Milliseconds per call of ``fn`` over ``calls`` sequential calls after ``warmup`` unrecorded ones."""
    out = []
    for i in range(warmup + calls):
        t0 = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t0
        if i >= warmup:
            out.append(1000 * elapsed)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=50)
    args = parser.parse_args()

    one_token = [types.Datum(model_input=types.ModelInput.from_ints([1]),
                             loss_fn_inputs={"target_tokens": [2], "weights": [1.0]})]
    with tempfile.TemporaryDirectory() as tmp, Fleet(build_llama(Path(tmp) / "tiny", **TINY_LLAMA)) as fleet:
        service = fleet.service()
        tc = service.create_training_client(str(fleet.model_dir)).result()
        r = fleet.redis
        echo_proc = subprocess.Popen([sys.executable, "-c", LIST_ECHO, str(fleet.port)])

        def list_echo() -> None:
            r.lpush("bench:req", b"12345678")
            r.brpop("bench:rep", timeout=10)

        try:
            times = {
                "redis PING": sample(r.ping, args.calls, args.warmup),
                "redis SET + GET (8 bytes)": sample(lambda: (r.set("bench:k", b"12345678"), r.get("bench:k")),
                                                    args.calls, args.warmup),
                "LPUSH/BRPOP echo via 2nd process": sample(list_echo, args.calls, args.warmup),
                "fleet: tc.echo({})": sample(lambda: tc.echo({}).result(timeout=30), args.calls, args.warmup),
                "fleet: tc.forward(1 token)": sample(lambda: tc.forward(one_token).result(timeout=30), args.calls,
                                                     args.warmup),
            }
        finally:
            r.lpush("bench:req", b"stop")
            echo_proc.wait(10)
        worker_echo = fleet.worker_ms("echo")[-args.calls:]
        worker_fwd = fleet.worker_ms("forward")[-args.calls:]
        tc.close()
        service.close()

    ping = median(times["redis PING"])
    ping99 = percentile(times["redis PING"], 99)
    rows = [(name, median(t), percentile(t, 99), median(t) / ping) for name, t in times.items()]
    for name, t in (("  worker handle() echo (log)", worker_echo), ("  worker handle() forward (log)", worker_fwd)):
        if t:
            rows.append((name, median(t), percentile(t, 99), median(t) / ping))
    print(f"latency: {args.calls} sequential calls after {args.warmup} warm-up; {machine()}")
    print_table(["round trip", "p50 ms", "p99 ms", "x PING p50"], rows)
    echo = times["fleet: tc.echo({})"]
    setget = times["redis SET + GET (8 bytes)"]
    lists = times["LPUSH/BRPOP echo via 2nd process"]
    print(f"RATIO echo/PING: p50 {median(echo) / ping:.1f}x, p99 {percentile(echo, 99) / ping99:.1f}x; "
          f"echo/SET+GET p50 {median(echo) / median(setget):.1f}x; "
          f"echo/list-echo p50 {median(echo) / median(lists):.1f}x")


if __name__ == "__main__":
    main()

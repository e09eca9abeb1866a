"""A worker's memory and speed under hostile messages: RSS before and after, and the drain rate.

    python benchmarks/fuzz_rss.py [--messages 5200] [--large 20]

Starts a private redis-server and one `tinkerq worker` (tiny Llama, one session open), measures its RSS
(VmRSS) after a warm-up, then pushes `--messages` seeded hostile messages of every kind in
tests/fuzz_messages.py (half into the worker's own queue, half into its model queue), then `--large`
requests near the message-size limit. It prints RSS at each stage as a ratio to the warm baseline, the
drain rate of hostile messages against the rate of valid `echo` round trips measured in the same run, and
whether the session's outputs are bitwise unchanged.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fuzz_messages import fuzz_messages
from tests.helpers import build_tiny_llama, make_batch
from tinkerq.launcher.processes import free_port, start_process, start_redis, stop, wait_for, worker_command
from tinkerq.worker import memory


def rss_mb(pid: int) -> float:
    return memory.rss_bytes(pid) / 2**20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=5200)
    p.add_argument("--large", type=int, default=20, help="requests near the message-size limit afterwards")
    args = p.parse_args()

    import redis

    from tinkerq import keys
    from tinkerq.producer import ServiceClient
    from tinkerq.settings import Settings

    work = Path(tempfile.mkdtemp(prefix="tinkerq-fuzz-"))
    model = os.path.abspath(build_tiny_llama(work / "model"))
    port = free_port()
    server = start_redis(port, work / "redis")
    url = f"redis://127.0.0.1:{port}/0"
    log = work / "worker.log"
    limit = 64 * 1024 * 1024
    worker = start_process(worker_command(model, url, threads=1), log,
                           {"TINKERQ_HEARTBEAT_S": "1", "TINKERQ_MAX_MESSAGE_BYTES": str(limit)})
    r = redis.Redis(port=port)
    try:
        with ServiceClient(settings=Settings(broker_url=url)) as sc:
            wait_for(lambda: bool(sc.connection.workers_serving(model)), 90, "worker", worker, log)
            tc = sc.create_training_client(model).result()
            probe = make_batch(np.random.default_rng(1), 4)
            before = tc.forward(probe).result(timeout=60)
            for _ in range(50):  # warm-up: code paths, allocator pools
                tc.echo({"x": 1}).result(timeout=30)
            t = time.perf_counter()
            for _ in range(200):
                tc.echo({"x": 1}).result(timeout=30)
            echo_per_s = 200 / (time.perf_counter() - t)
            base = rss_mb(worker.pid)
            print(f"warm worker: RSS {base:.0f} MB; valid echo round trips {echo_per_s:.0f}/s (one at a time)")

            half = args.messages // 2
            batch = (fuzz_messages(0, half, sc._dispatch.inbox, tc._queue)
                     + fuzz_messages(1, args.messages - half, sc._dispatch.inbox, keys.model_queue(model)))
            t = time.perf_counter()
            pipe = r.pipeline(transaction=False)
            for i, (_, raw) in enumerate(batch):
                pipe.lpush(tc._queue if i < half else keys.model_queue(model), raw)
            pipe.execute()
            wait_for(lambda: r.llen(tc._queue) == 0 and r.llen(keys.model_queue(model)) == 0, 300, "drain")
            rate = len(batch) / (time.perf_counter() - t)
            after_fuzz = rss_mb(worker.pid)
            print(f"{len(batch)} hostile messages: drained at {rate:.0f}/s ({rate / echo_per_s:.2f}x the valid "
                  f"echo rate); RSS {after_fuzz:.0f} MB ({after_fuzz / base:.3f}x), worker alive: "
                  f"{worker.poll() is None}")

            from tinkerq.wire import messages

            # One datum near the limit, too long for the model: the worker fetches and decodes all of it, then
            # refuses it (sent raw, past the producer's own checks, which would refuse it before sending).
            n = limit // 8 // 3
            body = {"loss_fn": "cross_entropy", "loss_fn_config": None, "data": [
                {"tokens": np.ones(n, np.int64), "inputs": {"target_tokens": np.ones(n, np.int64),
                                                           "weights": np.zeros(n, np.float32)}}]}
            peak = after_fuzz
            for _ in range(args.large):
                err = tc._submit("forward", body, messages.decode_forward_backward_output,
                                 argsrepr="large").exception(timeout=120)
                assert err is not None and err.category == "user", err
                peak = max(peak, rss_mb(worker.pid))
            time.sleep(2)
            after_large = rss_mb(worker.pid)
            print(f"{args.large} requests of {limit // 2**20} MiB: peak RSS {peak:.0f} MB, after {after_large:.0f} MB "
                  f"({after_large / base:.3f}x the warm baseline)")
            after = tc.forward(probe).result(timeout=60)
            same = all(np.array_equal(a["logprobs"].to_numpy(), b["logprobs"].to_numpy())
                       for a, b in zip(before.loss_fn_outputs, after.loss_fn_outputs, strict=True))
            print(f"session outputs bitwise unchanged: {same}; dead letters kept: {r.llen(keys.DEAD_LETTERS)}")
    finally:
        stop(worker.pid, timeout=10)
        server.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())

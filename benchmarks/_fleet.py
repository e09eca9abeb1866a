"""Shared benchmark plumbing: a private Redis, a model directory, one real worker process, and tables.

``with Fleet(model_dir, threads=2) as fleet:`` starts ``redis-server`` on a free port, starts
``python -m tinkerq.launcher.main worker`` against it, waits until the worker has registered the model (the same
check producers make), and tears both down on exit. Nothing here asserts on timings.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/x.py` puts benchmarks/ first, not the repo root
    sys.path.insert(0, str(ROOT))

from tinkerq.launcher.processes import free_port, start_process, start_redis, wait_for, worker_command  # noqa: E402


def build_llama(out_dir: Path, seed: int = 0, **config: Any) -> Path:
    """Save a randomly initialised LlamaForCausalLM (fixed seed) with save_pretrained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(out_dir)
    return out_dir


TINY_LLAMA: dict[str, Any] = dict(
    vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=False,
)


class Fleet:
    """A private redis-server plus one ``tinkerq worker`` process serving ``model_dir``."""

    def __init__(self, model_dir: Path, *, threads: int = 1, env: dict[str, str] | None = None,
                 worker_url: Callable[[int], str] | None = None) -> None:
        self.model_dir = Path(model_dir).resolve()
        # The worker's own Redis URL from Redis's port (default: the producers' URL), e.g. through a slow link.
        self.worker_url = worker_url
        self.threads = threads
        self.env = env or {}
        self.workdir = Path(tempfile.mkdtemp(prefix="tinkerq-bench-"))
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.worker_log = self.workdir / "worker.log"
        self.redis: redis.Redis = redis.Redis(port=self.port)
        self._redis_proc: subprocess.Popen | None = None
        self._worker_proc: subprocess.Popen | None = None
        self.registration: dict[str, Any] = {}  # the worker's heartbeat record, once it is up

    def __enter__(self) -> Fleet:
        try:
            self._start_redis()
            self._start_worker()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_redis(self) -> None:
        self._redis_proc = start_redis(self.port, self.workdir)

    def _start_worker(self) -> None:
        from tinkerq.connection import Connection
        from tinkerq.settings import Settings

        env = {"TINKERQ_CHECKPOINT_DIR": str(self.workdir / "ckpt"), **self.env}
        url = self.worker_url(self.port) if self.worker_url is not None else self.url
        cmd = worker_command(str(self.model_dir), url, threads=self.threads)
        self._worker_proc = start_process(cmd, self.worker_log, env)
        conn = Connection.open(Settings(broker_url=self.url))

        def registered() -> bool:
            found = conn.workers_serving(str(self.model_dir))
            if found:
                self.registration = found[0]
            return bool(found)

        try:
            wait_for(registered, 180, "tinkerq worker", self._worker_proc, self.worker_log)
        finally:
            conn.close()

    def service(self) -> Any:
        """A ServiceClient on this fleet (the caller closes it)."""
        from tinkerq.producer import ServiceClient

        return ServiceClient(broker_url=self.url)

    def worker_ms(self, op: str) -> list[float]:
        """Worker-side handling times of ``op`` (ms), from the worker's ``<op> ok in X ms`` log lines.

        Empty if the worker stops logging that line; callers then leave those rows out.
        """
        pattern = re.compile(rf"\b{re.escape(op)} ok in ([0-9.]+) ms")
        return [float(m.group(1)) for m in pattern.finditer(self.worker_log.read_text())]

    def close(self) -> None:
        for proc, grace in ((self._worker_proc, 30), (self._redis_proc, 10)):
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.redis.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


# -- figures ------------------------------------------------------------------------------------------------


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), nearest-rank on sorted samples."""
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain aligned text table (floats with 3 significant decimals)."""
    cells = [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    for row in [list(headers), ["-" * w for w in widths], *cells]:
        first, *rest = zip(row, widths, strict=True)
        print("  ".join([first[0].ljust(first[1]), *(c.rjust(w) for c, w in rest)]))


def machine() -> str:
    """One line naming the host: CPU count and load average (the machine may be shared)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"


def peak_growth(fn: Any) -> tuple[int, float]:
    """(peak RSS growth in bytes, wall seconds) of ``fn`` in this process (Linux: ``VmHWM``, reset through
    ``clear_refs`` after giving freed memory back)."""
    from tinkerq.worker import memory

    memory.release_memory()
    Path("/proc/self/clear_refs").write_text("5")
    before = memory.rss_bytes()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 - before, seconds
    raise RuntimeError("no VmHWM")


class RankGroup:
    """What worker/sharding/fsdp.shard uses of a ShardGroup: the device mesh of a gloo group on the CPU."""

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh


def join_group(rank: int, world: int, port: int) -> RankGroup:
    """In a rank started by :func:`spawn_ranks`: join the gloo group (one torch thread per rank)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    return RankGroup(init_device_mesh("cpu", (world,)))


def leave_group(rank: int, out: str, found: Any) -> None:
    """Write this rank's findings to ``<out>/rank<r>.json`` (read by :func:`spawn_ranks`), then leave the group."""
    import json

    import torch.distributed as dist

    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()


def spawn_ranks(fn: Callable[..., None], ranks: int, args: tuple[Any, ...], out: str) -> list[Any]:
    """Run ``fn(rank, ranks, port, *args)`` in ``ranks`` processes (torch.multiprocessing.spawn; ``port``: a free
    one for the group's rendezvous) and return what each wrote with :func:`leave_group` into ``out``."""
    import json

    import torch

    torch.multiprocessing.spawn(fn, args=(ranks, free_port(), *args), nprocs=ranks)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(ranks)]

"""What automatic snapshots cost a training step: time paused and bytes written, full and LoRA sessions.

Two workers on one private Redis serve the same ~20M-parameter Llama (benchmarks/train_step.py's model)
under two names: one writes an automatic snapshot after every optimizer step (TINKERQ_AUTO_SNAPSHOT_STEPS=1,
the most it can cost), the other never (0). The same forward_backward + optim_step pairs (4 x 256 tokens)
alternate between a session on each, so both run under the same load; the ratio of their step times is
the cost of snapshotting every step. The paused time comes from the snapshotting worker's own
``tinkerq_auto_snapshot_seconds`` histogram, the bytes from the snapshot directory on disk.

    .venv/bin/python benchmarks/auto_snapshot.py [--steps 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
from _fleet import Fleet, build_llama, machine, median, print_table
from train_step import LLAMA_20M

from tinkerq import types
from tinkerq.launcher.processes import free_port, start_process, wait_for, worker_command

ADAM = types.AdamParams(learning_rate=1e-4)
DATUMS, SEQ = 4, 256


def batch(vocab: int, seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(DATUMS):
        seq = rng.integers(0, vocab, SEQ + 1, dtype=np.int64)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                               loss_fn_inputs={"target_tokens": seq[1:], "weights": np.ones(SEQ, np.float32)}))
    return out


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, flags=re.M)
    return float(found.group(1)) if found else 0.0


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    print(machine())
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_llama(Path(tmp) / "llama-20m", **LLAMA_20M)
        checkpoints = Path(tmp) / "ckpt"
        port = free_port()
        # The Fleet's own worker never snapshots; a second one, started here, snapshots every step.
        with Fleet(model_dir, threads=args.threads, env={"TINKERQ_AUTO_SNAPSHOT_STEPS": "0"}) as fleet:
            log = fleet.workdir / "snapshotting-worker.log"
            cmd = worker_command(str(model_dir), fleet.url, threads=args.threads,
                                 extra=["--name", "snapshotting", "--metrics-port", str(port)])
            proc = start_process(cmd, log, {"TINKERQ_AUTO_SNAPSHOT_STEPS": "1",
                                            "TINKERQ_CHECKPOINT_DIR": str(checkpoints)})
            sc = fleet.service()
            try:
                wait_for(lambda: bool(sc.connection.workers_serving("snapshotting")), 180, "worker", proc, log)
                metrics_url = f"http://127.0.0.1:{port}/metrics"
                rows = []
                for kind in ("full", "lora"):
                    def open_client(name: str, kind: str = kind):
                        if kind == "lora":
                            return sc.create_lora_training_client(name, rank=16, seed=0).result(timeout=300)
                        return sc.create_training_client(name).result(timeout=300)

                    clients = {"off": open_client(str(model_dir)), "every step": open_client("snapshotting")}
                    times: dict[str, list[float]] = {k: [] for k in clients}
                    count0 = metric(metrics_url, "tinkerq_auto_snapshot_seconds_count")
                    sum0 = metric(metrics_url, "tinkerq_auto_snapshot_seconds_sum")
                    for step in range(args.steps + 1):  # the first step of each warms up (not counted)
                        data = batch(LLAMA_20M["vocab_size"], step)
                        order = list(clients) if step % 2 == 0 else list(reversed(clients))
                        for key in order:
                            tc = clients[key]
                            started = time.perf_counter()
                            tc.forward_backward(data, "cross_entropy")
                            tc.optim_step(ADAM).result(timeout=600)
                            if step:
                                times[key].append(time.perf_counter() - started)
                    paused = metric(metrics_url, "tinkerq_auto_snapshot_seconds_sum") - sum0
                    snaps = metric(metrics_url, "tinkerq_auto_snapshot_seconds_count") - count0
                    written = directory_bytes(checkpoints / clients["every step"].model_id / "state" / ".auto")
                    off, on = median(times["off"]), median(times["every step"])
                    rows.append([kind, 1000 * off, 1000 * on, on / off, 1000 * paused / max(snaps, 1),
                                 written / 2**20, int(snaps)])
                    for tc in clients.values():
                        tc.close()
                print(f"\nfb + optim_step of {DATUMS} x {SEQ} tokens, {args.steps} steps each, medians (ms)")
                print_table(["session", "no snapshots", "snapshot every step", "RATIO", "paused per snapshot",
                             "MiB per snapshot", "snapshots"], rows)
            finally:
                sc.close()
                proc.terminate()
                proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())

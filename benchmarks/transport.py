"""Transport cost of a forward_backward-sized body: producer -> worker -> producer, untouched.

The body is the encoded loss request of a 16 x 4096 batch (int64 tokens and target_tokens, float32
weights), the same bytes a ``forward_backward`` carries, sent with ``TrainingClient.echo``. The baseline,
measured in the same run and interleaved with it, is msgpack encode + raw redis-py SET + GET + decode of
the same body; raw SET + GET alone is shown too, and the baseline done twice (an echo carries the body
both ways, so that is the floor for any echo).

    .venv/bin/python benchmarks/transport.py [--reps 30] [--warmup 5]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _fleet import TINY_LLAMA, Fleet, build_llama, machine, median, percentile, print_table

from tinkerq import types
from tinkerq.wire import codec, messages

DATUMS, TOKENS = 16, 4096
TARGET_RATIO = 1.5


def make_body(vocab: int) -> dict[str, Any]:
    """The encoded loss request of a DATUMS x TOKENS batch (what forward_backward sends)."""
    rng = np.random.default_rng(0)
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(rng.integers(0, vocab, TOKENS, dtype=np.int64)),
            loss_fn_inputs={
                "target_tokens": rng.integers(0, vocab, TOKENS, dtype=np.int64),
                "weights": rng.random(TOKENS, dtype=np.float32),
            },
        )
        for _ in range(DATUMS)
    ]
    return messages.encode_loss_request(data, "cross_entropy", None)


def same_body(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """True when the echoed body equals the sent one, array for array."""
    if a["loss_fn"] != b["loss_fn"] or len(a["data"]) != len(b["data"]):
        return False
    for x, y in zip(a["data"], b["data"], strict=True):
        if not np.array_equal(x["tokens"], y["tokens"]) or x["tokens"].dtype != y["tokens"].dtype:
            return False
        for key in x["inputs"]:
            a_in, b_in = x["inputs"][key], y["inputs"][key]
            if not np.array_equal(a_in, b_in) or a_in.dtype != b_in.dtype:
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()

    body = make_body(TINY_LLAMA["vocab_size"])
    payload = codec.packb(body)
    with tempfile.TemporaryDirectory() as tmp, Fleet(build_llama(Path(tmp) / "tiny", **TINY_LLAMA)) as fleet:
        service = fleet.service()
        tc = service.create_training_client(str(fleet.model_dir)).result()
        r = fleet.redis
        key = "bench:transport"

        def fleet_echo() -> None:
            out = tc.echo(body).result(timeout=120)
            assert out["loss_fn"] == "cross_entropy"

        def baseline() -> None:
            r.set(key, codec.packb(body))
            codec.unpackb(r.get(key))

        def there_and_back() -> None:
            for _ in range(2):  # what an echo moves at least: the body both ways
                r.set(key, codec.packb(body))
                codec.unpackb(r.get(key))

        def raw() -> None:
            r.set(key, payload)
            r.get(key)

        def encode() -> None:
            codec.packb(body)

        def decode() -> None:
            codec.unpackb(payload)

        assert same_body(body, tc.echo(body).result(timeout=120)), "echo changed the body"
        cases = {
            "fleet: tc.echo(body)": fleet_echo,
            "baseline: packb + SET + GET + unpackb": baseline,
            "baseline x2 (there and back)": there_and_back,
            "raw SET + GET (pre-encoded bytes)": raw,
            "msgpack encode only": encode,
            "msgpack decode only": decode,
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for rep in range(args.warmup + args.reps):
            for name, fn in cases.items():  # interleaved: slow drifts of a shared machine hit all alike
                t0 = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - t0
                if rep >= args.warmup:
                    times[name].append(1000 * elapsed)
        worker_echo = fleet.worker_ms("echo")[-args.reps:]
        tc.close()
        service.close()

    base = median(times["baseline: packb + SET + GET + unpackb"])
    base90 = percentile(times["baseline: packb + SET + GET + unpackb"], 90)
    rows = [(name, median(t), percentile(t, 90), median(t) / base) for name, t in times.items()]
    if worker_echo:
        rows.append(("  of which worker handle() (log)", median(worker_echo), percentile(worker_echo, 90),
                     median(worker_echo) / base))
    print(f"transport: {DATUMS}x{TOKENS} int64 tokens + int64 targets + float32 weights; "
          f"payload {len(payload)} bytes ({len(payload) / 2**20:.2f} MiB); {args.reps} reps after "
          f"{args.warmup} warm-up; {machine()}")
    print_table(["path", "median ms", "p90 ms", "x baseline"], rows)
    fleet_t = times["fleet: tc.echo(body)"]
    ratio, ratio90 = median(fleet_t) / base, percentile(fleet_t, 90) / base90
    raw_ratio = median(fleet_t) / median(times["raw SET + GET (pre-encoded bytes)"])
    both_ratio = median(fleet_t) / median(times["baseline x2 (there and back)"])
    print(f"RATIO fleet/baseline: median {ratio:.2f}x, p90 {ratio90:.2f}x (target <= {TARGET_RATIO}x: "
          f"{'met' if ratio <= TARGET_RATIO else 'NOT met'}); fleet/raw SET+GET {raw_ratio:.2f}x; "
          f"fleet/baseline x2 {both_ratio:.2f}x")


if __name__ == "__main__":
    main()

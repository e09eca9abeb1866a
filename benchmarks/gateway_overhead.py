"""Per-request overhead of ``tinkerq gateway`` (the official tinker SDK over HTTP) against the producer library.

One private Redis, one ``tinkerq worker --threads 1`` serving a tiny Llama (built here, seed 0), one
``tinkerq gateway`` process and an API key. Two rank-8 LoRA training clients on the same base, the same
seed: one opened with ``producer.ServiceClient`` (Redis directly), one with ``tinker.ServiceClient`` pointed
at the gateway. Each request kind is sent sequentially (result fetched before the next), alternating the two
paths call by call (A B, then B A on the next rep, so drift and "who goes first" hit both alike):

* large: ``forward_backward`` of 16 datums x 512 tokens (cross_entropy), then ``optim_step`` (AdamW);
* small: ``forward`` of 1 datum x 1 token (the smallest body the SDK can send, on the same protobuf route as
  the large one) and ``optim_step`` (the smallest JSON request), ``--small-repeats`` times.

Reports p50/p99 per path (nearest rank: with 30 samples the p99 is the slowest call), gateway/producer ratios
and the absolute overhead. The worker's compute time of each call (its ``tinkerq_compute_seconds`` counter,
scraped from ``TINKERQ_METRICS_PORT`` between calls) gives the time each call spent outside the worker, which
compute noise on a shared machine does not blur. Where the overhead goes: the CPU this process (producer or
SDK) and the gateway process use per call, one bare HTTP round trip to the gateway, and in-process timings of
each conversion of the large request. Nothing asserts on timings.

    .venv/bin/python benchmarks/gateway_overhead.py [--repeats 30] [--small-repeats 500] [--warmup 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _fleet import TINY_LLAMA, Fleet, build_llama, machine, median, percentile, print_table

from tinkerq import types
from tinkerq.launcher.processes import free_port, gateway_command, gateway_up, start_process, wait_for
from tinkerq.settings import Settings
from tinkerq.tenants import ApiKeys

DATUMS, TOKENS = 16, 512
RANK, SEED = 8, 1
TARGET_RATIO = 1.2  # gateway / producer, large request
ADAM = dict(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)
LARGE, OPTIM_L, SMALL, OPTIM_S = ("forward_backward 16x512", "optim_step (after it)", "forward 1x1",
                                  "optim_step (small loop)")
PATHS = ("producer", "gateway")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class GatewayProcess:
    """``python -m tinkerq.launcher.main gateway`` on a free port, up (``/healthz``) when entered."""

    def __init__(self, broker_url: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._cmd = gateway_command(broker_url, self.port)
        self.proc: Any = None

    def __enter__(self) -> GatewayProcess:
        self.proc = start_process(self._cmd, self.log)
        try:
            wait_for(lambda: gateway_up(self.url), 60, "tinkerq gateway", self.proc, self.log)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def batches(vocab: int) -> dict[str, tuple[list[types.Datum], list[Any]]]:
    """The large and the small batch, as producer Datums and as the same data in SDK Datums."""
    import tinker

    rng = np.random.default_rng(0)

    def both(n: int, length: int) -> tuple[list[types.Datum], list[Any]]:
        ours, sdk = [], []
        for _ in range(n):
            seq = rng.integers(0, vocab, length + 1, dtype=np.int64)
            tokens, targets = seq[:-1], seq[1:].copy()
            weights = rng.uniform(0.5, 1.5, length).astype(np.float32)
            ours.append(types.Datum(model_input=types.ModelInput.from_ints(tokens.tolist()),
                                    loss_fn_inputs={"target_tokens": targets, "weights": weights}))
            sdk.append(tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens.tolist()),
                                    loss_fn_inputs={"target_tokens": tinker.TensorData.from_numpy(targets),
                                                    "weights": tinker.TensorData.from_numpy(weights)}))
        return ours, sdk

    return {"large": both(DATUMS, TOKENS), "small": both(1, 1)}


def compute_seconds(metrics_url: str) -> dict[str, float]:
    """The worker's ``tinkerq_compute_seconds_sum`` per op (Prometheus): the time it spent applying requests."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^tinkerq_compute_seconds_sum\{op="([^"]+)"\} (\S+)$', text, re.MULTILINE)}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid``, all its threads (Linux /proc; 10 ms ticks: use means)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


Samples = dict[str, dict[str, dict[str, list[float]]]]  # measure -> request kind -> path -> one value per call


def run_loop(calls: dict[str, tuple[str, dict[str, Callable[[], Any]]]], reps: int, warmup: int, metrics_url: str,
             gateway_pid: int, label: str) -> Samples:
    """``reps`` (+ ``warmup``) rounds; each round runs every kind on both paths, the paths' order flipping every
    round. Per kind and path, per recorded call (ms): ``e2e``; ``worker``, the time the worker spent applying
    that very call (the growth of its compute-seconds counter, read between calls, outside the timed span);
    ``client_cpu``, the CPU this process used during the call (all threads: the SDK's or the producer's);
    ``gateway_cpu``, the CPU the gateway process used during the call."""
    out: Samples = {m: {k: {p: [] for p in PATHS} for k in calls} for m in ("e2e", "worker", "client_cpu",
                                                                             "gateway_cpu")}
    every = max(1, (warmup + reps) // 5)
    t_loop = time.perf_counter()
    before = compute_seconds(metrics_url)
    for rep in range(warmup + reps):
        paths = PATHS if rep % 2 == 0 else PATHS[::-1]
        for kind, (op, fns) in calls.items():
            for path in paths:
                g0, c0 = process_cpu_s(gateway_pid), time.process_time()
                t0 = time.perf_counter()
                fns[path]()
                elapsed = time.perf_counter() - t0
                c1, g1 = time.process_time(), process_cpu_s(gateway_pid)
                after = compute_seconds(metrics_url)
                if rep >= warmup:
                    for measure, value in (("e2e", elapsed), ("worker", after.get(op, 0.0) - before.get(op, 0.0)),
                                           ("client_cpu", c1 - c0), ("gateway_cpu", g1 - g0)):
                        out[measure][kind][path].append(1000 * value)
                before = after
        if (rep + 1) % every == 0 or rep + 1 == warmup + reps:
            print(f"  {label}: {rep + 1}/{warmup + reps} rounds ({warmup} warm-up), "
                  f"{time.perf_counter() - t_loop:.0f} s", flush=True)
    return out


def conversions(ours: list[types.Datum], sdk: list[Any], out: types.ForwardBackwardOutput, model_id: str,
                tc: Any, reps: int) -> list[tuple[str, float]]:
    """Median ms, in this process, of each conversion of the large request and its reply on either path."""
    import tinker
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output

    from tinkerq.gateway import proto  # the package: _fleet put the repo root ahead of benchmarks/ (this file's name)
    from tinkerq.validation import validate_loss_request
    from tinkerq.wire import codec, messages

    request = tinker.types.ForwardBackwardRequest(
        forward_backward_input=tinker.types.ForwardBackwardInput(data=sdk, loss_fn="cross_entropy"),
        model_id=model_id, seq_id=1)
    body = forward_backward_request_to_proto(request).SerializeToString()
    reply = proto.encode_forward_backward_output(out)
    packed_reply = codec.packb(messages.encode_forward_backward_output(out))  # what the worker sends back
    steps: dict[str, Callable[[], Any]] = {
        "SDK: request -> protobuf (client)": lambda: forward_backward_request_to_proto(request).SerializeToString(),
        "gateway: protobuf -> Datums": lambda: proto.decode_forward_backward_request(body),
        "both: validate_loss_request": lambda: validate_loss_request(
            ours, "cross_entropy", None, limits=tc._limits, vocab_size=tc.info.vocab_size,
            max_seq_len=tc.info.max_seq_len),
        "both: Datums -> msgpack (encode_loss_request + packb)": lambda: codec.packb(
            messages.encode_loss_request(ours, "cross_entropy", None)),
        "both: msgpack -> reply (unpackb + decode)": lambda: messages.decode_forward_backward_output(
            codec.unpackb(packed_reply)),
        "gateway: reply -> protobuf": lambda: proto.encode_forward_backward_output(out),
        "SDK: protobuf -> reply (client)": lambda: deserialize_forward_backward_output(reply),
    }
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(reps + 2):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(1000 * (time.perf_counter() - t0))
    rows = [(name, median(t[2:])) for name, t in times.items()]
    rows.append((f"request body: {len(body):,} B protobuf; reply: {len(reply):,} B protobuf", float("nan")))
    return rows


def summarize(samples: Samples) -> list[tuple[Any, ...]]:
    e2e, worker = samples["e2e"], samples["worker"]
    rows: list[tuple[Any, ...]] = []
    for kind in e2e:
        out = {p: [t - w for t, w in zip(e2e[kind][p], worker[kind][p], strict=True)] for p in PATHS}
        for path in PATHS:
            t = e2e[kind][path]
            rows.append((f"{kind}: {path}", len(t), percentile(t, 50), percentile(t, 99),
                         percentile(worker[kind][path], 50), percentile(out[path], 50), percentile(out[path], 99),
                         statistics.fmean(samples["client_cpu"][kind][path]),
                         statistics.fmean(samples["gateway_cpu"][kind][path])))
        g, p = e2e[kind]["gateway"], e2e[kind]["producer"]
        rows.append(("  gateway / producer", "", f"{percentile(g, 50) / percentile(p, 50):.3f}x",
                     f"{percentile(g, 99) / percentile(p, 99):.3f}x", "", "", "", "", ""))
        rows.append(("  gateway - producer (ms)", "", f"{percentile(g, 50) - percentile(p, 50):+.2f}",
                     f"{percentile(g, 99) - percentile(p, 99):+.2f}", "",
                     f"{percentile(out['gateway'], 50) - percentile(out['producer'], 50):+.2f}",
                     f"{percentile(out['gateway'], 99) - percentile(out['producer'], 99):+.2f}", "", ""))
    return rows


def http_floor(url: str, key: str, calls: int) -> list[float]:
    """ms per authenticated POST /api/v1/client/config (constant JSON answer) on one keep-alive httpx client:
    the floor of one HTTP round trip to the gateway, of which the SDK makes two per request."""
    import httpx

    out = []
    with httpx.Client(base_url=url, headers={"X-API-Key": key}) as client:
        for i in range(calls + 20):
            t0 = time.perf_counter()
            client.post("/api/v1/client/config").raise_for_status()
            if i >= 20:
                out.append(1000 * (time.perf_counter() - t0))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30, help="recorded rounds of the large request")
    parser.add_argument("--small-repeats", type=int, default=500, help="recorded rounds of the small requests")
    parser.add_argument("--warmup", type=int, default=3, help="unrecorded rounds before each loop")
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 large and 10 small rounds, 1 warm-up")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.small_repeats, args.warmup = 3, 10, 1
    os.environ["TINKER_TELEMETRY"] = "0"  # the SDK would otherwise post telemetry to the gateway

    import tinker
    import torch

    started = time.perf_counter()
    metrics_port = free_port()
    with tempfile.TemporaryDirectory() as tmp, \
            Fleet(build_llama(Path(tmp) / "tiny", seed=0, **TINY_LLAMA), threads=1,
                  env={"TINKERQ_METRICS_PORT": str(metrics_port)}) as fleet, \
            GatewayProcess(fleet.url, fleet.workdir / "gateway.log") as gw:
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        keys = ApiKeys.open(Settings(broker_url=fleet.url))
        try:
            key = keys.create("bench")
        finally:
            keys.close()
        base = str(fleet.model_dir)
        service = fleet.service()
        sdk = tinker.ServiceClient(base_url=gw.url, api_key=key)
        ptc = service.create_lora_training_client(base, rank=RANK, seed=SEED).result()
        gtc = sdk.create_lora_training_client(base, rank=RANK, seed=SEED).result()
        (large_p, large_g), (small_p, small_g) = batches(TINY_LLAMA["vocab_size"]).values()
        adam_p, adam_g = types.AdamParams(**ADAM), tinker.AdamParams(**ADAM)
        print(f"gateway: rank-{RANK} LoRA on a tiny Llama ({_param_count(base):,} params, seed 0); worker --threads "
              f"1; this process {torch.get_num_threads()} torch threads; gateway: 1 process; {machine()}", flush=True)

        last: dict[str, Any] = {}
        losses: dict[str, list[float]] = {path: [] for path in PATHS}

        def keep(path: str, submit: Callable[[], Any]) -> Callable[[], None]:
            def call() -> None:
                last[path] = submit().result(timeout=300) if path == "producer" else submit().result()
                losses[path].append(last[path].metrics["loss:sum"])
            return call

        large = {"producer": keep("producer", lambda: ptc.forward_backward(large_p, "cross_entropy")),
                 "gateway": keep("gateway", lambda: gtc.forward_backward(large_g, "cross_entropy"))}
        optim = {"producer": lambda: ptc.optim_step(adam_p).result(timeout=300),
                 "gateway": lambda: gtc.optim_step(adam_g).result()}
        small = {"producer": lambda: ptc.forward(small_p, "cross_entropy").result(timeout=300),
                 "gateway": lambda: gtc.forward(small_g, "cross_entropy").result()}

        samples = run_loop({LARGE: ("forward_backward", large), OPTIM_L: ("optim_step", optim)}, args.repeats,
                           args.warmup, metrics_url, gw.proc.pid, "large")
        more = run_loop({SMALL: ("forward", small), OPTIM_S: ("optim_step", optim)}, args.small_repeats,
                        args.warmup, metrics_url, gw.proc.pid, "small")
        samples = {measure: {**samples[measure], **more[measure]} for measure in samples}
        floor = http_floor(gw.url, key, args.small_repeats)
        convert = conversions(large_p, large_g, last["producer"], gtc.model_id, ptc, max(5, args.repeats))
        sdk.close("success").result(timeout=60)
        ptc.close()
        service.close()

    # Both sessions got the same requests in the same order, so their losses must agree at every step.
    diff = max(abs(a - b) / abs(a) for a, b in zip(losses["producer"], losses["gateway"], strict=True))
    print(f"\nloss:sum of the {len(losses['producer'])} large steps, producer vs gateway session: max relative "
          f"difference {diff:.1e} (last: {losses['producer'][-1]:.6f} vs {losses['gateway'][-1]:.6f})")
    print(f"\n[requests] {args.repeats} large rounds, {args.small_repeats} small rounds, after {args.warmup} warm-up "
          f"rounds each; producer and gateway alternating call by call; ms (p99: nearest rank)")
    print_table(["request: path", "n", "p50", "p99", "worker compute p50", "outside worker p50",
                 "outside worker p99", "client CPU/call", "gateway CPU/call"], summarize(samples))
    print("(outside worker: each call's time minus the worker's compute for it; CPU/call: means, ms)")
    e2e, worker = samples["e2e"], samples["worker"]
    print(f"\n[http] one authenticated POST /api/v1/client/config to the gateway (httpx, keep-alive), "
          f"{len(floor)} calls: p50 {percentile(floor, 50):.3f} ms, p99 {percentile(floor, 99):.3f} ms")
    print("\n[conversions] in this process, median ms of each step of the large request and its reply")
    print_table(["step", "ms"], [(n, "" if v != v else v) for n, v in convert])
    for kind in (LARGE, SMALL):
        p, g = e2e[kind]["producer"], e2e[kind]["gateway"]
        r50, r99 = percentile(g, 50) / percentile(p, 50), percentile(g, 99) / percentile(p, 99)
        outside = {path: percentile([t - w for t, w in zip(e2e[kind][path], worker[kind][path], strict=True)], 50)
                   for path in PATHS}
        w = percentile(worker[kind]["producer"] + worker[kind]["gateway"], 50)
        steady = (w + outside["gateway"]) / (w + outside["producer"])
        verdict = ""
        if kind == LARGE:
            verdict = (f"; target <= {TARGET_RATIO}x: {'met' if r50 <= TARGET_RATIO else 'NOT met'} (p50), "
                       f"{'met' if steady <= TARGET_RATIO else 'NOT met'} (at the median worker compute)")
        print(f"RATIO {kind} gateway/producer: p50 {r50:.3f}x, p99 {r99:.3f}x; at the median worker compute "
              f"({w:.1f} ms) {steady:.3f}x; overhead p50 {percentile(g, 50) - percentile(p, 50):+.2f} ms end to end, "
              f"{outside['gateway'] - outside['producer']:+.2f} ms outside the worker{verdict}")
    print(f"total {time.perf_counter() - started:.0f} s; {machine()}")


def _param_count(model_dir: str) -> int:
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), "np") as f:
        return sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())  # noqa: SIM118


if __name__ == "__main__":
    main()

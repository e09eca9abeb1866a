"""Bounded memory: free-memory probes, estimators against real measurements, admission, RSS after large requests."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.conftest import start_named_worker
from tests.helpers import make_batch, peak_rss_growth
from tinkerq import types
from tinkerq.errors import CapacityError, ServerError
from tinkerq.settings import Settings
from tinkerq.worker import memory
from tinkerq.worker.core.ordering import ENTRY_OVERHEAD_BYTES, Ordering, envelope_bytes
from tinkerq.worker.core.scheduler import Caller, Request
from tinkerq.worker.sampling import StopRule, sample
from tinkerq.worker.training.batching import pad_batch
from tinkerq.worker.training.logprobs import LogprobComputer
from tinkerq.worker.training.session import TrainingSession

pytestmark = pytest.mark.timeout(300)

MiB = memory.MiB


def _llama(hidden: int, intermediate: int, layers: int, *, max_len: int = 2048) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len)
    return LlamaForCausalLM(config).eval()


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied tensors counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _session(model: LlamaForCausalLM, microbatch_tokens: int = 16384) -> TrainingSession:
    return TrainingSession("m", copy.deepcopy(model), base_dir="/nonexistent", microbatch_tokens=microbatch_tokens,
                           logprobs=LogprobComputer(model, "torch"), blank_model=lambda: copy.deepcopy(model))


# -- what is free ----------------------------------------------------------------------------------------------


def test_meminfo_and_cgroup_limits_are_read_from_proc_and_sys(tmp_path):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:  1000 kB\nMemFree:  10 kB\nMemAvailable:  512 kB\n")
    assert memory.meminfo_available(proc) == 512 * 1024
    assert memory.cgroup_available(proc, root) is None  # no /proc/self/cgroup: no limit known

    # cgroup v2: the tightest level on the way up counts; page cache (inactive_file) is reclaimable.
    (proc / "self" / "cgroup").write_text("0::/a/b\n")
    leaf, parent = root / "a" / "b", root / "a"
    leaf.mkdir(parents=True)
    (leaf / "memory.max").write_text("max\n")
    (leaf / "memory.current").write_text("100\n")
    assert memory.cgroup_available(proc, root) is None  # "max" everywhere: no limit
    (parent / "memory.max").write_text(f"{1000 * MiB}\n")
    (parent / "memory.current").write_text(f"{900 * MiB}\n")
    (parent / "memory.stat").write_text(f"anon 1\ninactive_file {50 * MiB}\nactive_file 7\n")
    assert memory.cgroup_available(proc, root) == 150 * MiB
    (leaf / "memory.max").write_text(f"{120 * MiB}\n")
    (leaf / "memory.current").write_text(f"{100 * MiB}\n")
    assert memory.cgroup_available(proc, root) == 20 * MiB

    # cgroup v1: "no limit" is a huge number; a real limit counts, with total_inactive_file.
    (proc / "self" / "cgroup").write_text("5:cpu:/x\n4:memory:/docker/c1\n0::/\n")
    v1 = root / "memory" / "docker" / "c1"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory.usage_in_bytes").write_text("5\n")
    (root / "memory.max").write_text("max\n")
    assert memory.cgroup_available(proc, root) is None
    (v1 / "memory.limit_in_bytes").write_text(f"{2048 * MiB}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{2000 * MiB}\n")
    (v1 / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {8 * MiB}\n")
    assert memory.cgroup_available(proc, root) == 56 * MiB


def test_the_operator_cap_bounds_this_process_rss():
    rss = memory.rss_bytes()
    assert rss > 50 * MiB  # this process has torch loaded
    free = memory.host_free(limit_mb=rss // MiB + 100)
    assert "TINKERQ_MEMORY_LIMIT_MB" in free.limited_by
    assert 90 * MiB < free.nbytes < 110 * MiB
    assert memory.host_free(0).nbytes > free.nbytes  # no cap: the host's (or cgroup's) room
    assert Settings.from_env({"TINKERQ_MEMORY_LIMIT_MB": "512"}).memory_limit_mb == 512
    assert Settings().memory_limit_mb == 0


def test_require_refuses_before_allocating_and_says_what_to_do():
    memory.require(MiB, "a small thing", "cpu")  # fits: nothing happens
    with pytest.raises(memory.CapacityError) as info:
        memory.require(1 << 60, "sampling 1024 sequences", "cpu", advice="ask for fewer samples")
    err = info.value
    assert isinstance(err, ServerError) and err.category == "server"
    assert "sampling 1024 sequences needs about" in err.message and "is free (limited by" in err.message
    assert "nothing was allocated" in err.message and "Ask for fewer samples" in err.message
    assert err.to_wire()["type"] == "CapacityError" and err.to_wire()["details"]["needed_bytes"] == 1 << 60


def test_admission_checks_use_the_cap():
    """Each admit_* refuses what does not fit under TINKERQ_MEMORY_LIMIT_MB and admits what does."""
    medium = _llama(256, 768, 4)  # 12.8 MB of weights: a session is estimated at ~77 MB
    shape = memory.ModelShape.of(medium)
    tight = Settings(memory_limit_mb=(memory.rss_bytes() + memory.HOST_HEADROOM_BYTES) // MiB + 40)
    with pytest.raises(memory.CapacityError, match="a new training session"):
        memory.admit_session(medium, tight, [])
    with pytest.raises(memory.CapacityError, match="a sampling snapshot"):
        memory.admit_snapshot(medium, tight, [_session(medium)])  # its AdamW state is still to come
    with pytest.raises(memory.CapacityError, match="KV cache"):
        memory.admit_sample(medium, tight, 100, 1900, 64)
    with pytest.raises(memory.CapacityError, match="forward_backward on 64 datum"):
        memory.admit_batch(medium, tight, [1000] * 64, backward=True, logprobs=None)
    memory.admit_sample(medium, tight, 10, 10, 2)
    memory.admit_batch(medium, tight, [50] * 4, backward=False, logprobs=None)
    roomy = Settings(memory_limit_mb=memory.rss_bytes() // MiB + 1024)
    memory.admit_session(medium, roomy, [])
    assert memory.session_state_bytes(shape) + memory.training_working_bytes(shape) < 1024 * MiB


# -- estimators against real measurements ------------------------------------------------------------------------


def test_session_and_snapshot_estimates_match_the_tensors_they_hold(model_dir):
    from tests.helpers import load_reference

    base = load_reference(model_dir)
    shape = memory.ModelShape.of(base)
    session = _session(base)
    # Before the first optim_step the AdamW moments are promised, not allocated.
    assert memory.unallocated_state_bytes([session]) == 2 * shape.param_bytes
    session.run_loss(make_batch(np.random.default_rng(0), 3), "cross_entropy", None, backward=True)
    session.optim_step(types.AdamParams(learning_rate=1e-3))
    assert memory.unallocated_state_bytes([session]) == 0
    held = _storage_bytes([*session.model.parameters(), *session.model.buffers(),
                           *(p.grad for p in session.params),
                           *(v for state in session.optimizer.state.values() for v in state.values())])
    estimate = memory.session_state_bytes(shape)
    steps = 4 * len(session.params)  # AdamW's 0-dim float32 step per parameter: not estimated
    print(f"\nsession state: held {held} B, estimated {estimate} B (+{steps} B of step counters)")
    assert held == estimate + steps
    snapshot = session.snapshot()
    snap = _storage_bytes([*snapshot.parameters(), *snapshot.buffers()])
    print(f"sampler snapshot: held {snap} B, estimated {memory.snapshot_bytes(shape)} B")
    assert snap == memory.snapshot_bytes(shape)


def test_kv_cache_estimate_is_the_cache_the_model_builds():
    model = _llama(64, 128, 3)
    shape = memory.ModelShape.of(model)
    S, T = 5, 37
    with torch.no_grad():
        out = model(input_ids=torch.ones(S, T, dtype=torch.long), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    held = _storage_bytes([t for layer in cache.layers for t in (layer.keys, layer.values)])
    assert held == 2 * shape.layers * shape.kv_heads * shape.head_dim * T * S * shape.dtype_bytes
    assert memory.sample_bytes(shape, T - 1, 1, S) > held


def test_batch_estimate_covers_the_activations_saved_for_backward():
    model = _llama(128, 384, 3)
    shape = memory.ModelShape.of(model)
    session = _session(model)
    data = make_batch(np.random.default_rng(1), 12, min_len=20, max_len=200)
    lengths = [d.model_input.length for d in data]
    batch = pad_batch(data, torch.device("cpu"))
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        session.logprobs(session.model, batch["tokens"], batch["mask"].long(), batch["target_tokens"])
    weights = {p.untyped_storage().data_ptr() for p in session.model.parameters()}
    activations = sum(n for ptr, n in saved.items() if ptr not in weights)
    estimate = memory.batch_bytes(shape, lengths, microbatch_tokens=16384, backward=True,
                                  chunk_tokens=session.logprobs.chunk_tokens)
    estimate -= memory.training_working_bytes(shape) + memory.REQUEST_BYTES_PER_TOKEN * sum(lengths)
    estimate -= memory.REQUEST_BYTES_PER_DATUM * len(lengths)
    print(f"\nsaved activations {activations / MiB:.1f} MiB, estimated {estimate / MiB:.1f} MiB "
          f"({estimate / activations:.2f}x)")
    assert activations <= estimate <= 3 * activations


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak RSS reset")
def test_estimates_cover_the_measured_peak_memory_of_real_requests():
    """Peak RSS of real forward, forward_backward and sample calls stays under their estimates."""
    model = _llama(256, 768, 4)
    shape = memory.ModelShape.of(model)
    session = _session(model)
    data = make_batch(np.random.default_rng(2), 8, min_len=50, max_len=400)
    lengths = [d.model_input.length for d in data]
    session.run_loss(data[:2], "cross_entropy", None, backward=True)  # first-call allocations out of the way
    rows = []
    for backward in (True, False):
        peak = peak_rss_growth(lambda b=backward: session.run_loss(data, "cross_entropy", None, backward=b))
        est = memory.batch_bytes(shape, lengths, microbatch_tokens=16384, backward=backward,
                                 chunk_tokens=session.logprobs.chunk_tokens)
        rows.append(("forward_backward" if backward else "forward", peak, est))
    snapshot = session.snapshot()
    for prompt, new, n in ((100, 1, 16), (1, 300, 16), (100, 200, 8)):
        params = types.SamplingParams(max_tokens=new, temperature=1.0, seed=0)
        peak = peak_rss_growth(lambda p=prompt, m=new, s=n, sp=params: sample(
            snapshot, [i % 90 + 1 for i in range(p)], s, sp, StopRule([], [], None), m))
        rows.append((f"sample P={prompt} new={new} S={n}", peak, memory.sample_bytes(shape, prompt, new, n)))
    print()
    for what, peak, est in rows:
        print(f"{what}: peak RSS +{peak / MiB:.1f} MiB, estimated {est / MiB:.1f} MiB ({est / max(peak, 1):.2f}x)")
    for what, peak, est in rows:
        assert peak <= est, what


def test_microbatches_follow_run_loss():
    assert memory.microbatches([10, 30, 20, 5], 60) == [(2, 30), (2, 20)]
    assert memory.microbatches([100], 60) == [(1, 100)]  # a datum longer than the budget runs alone


# -- ordering bounds ---------------------------------------------------------------------------------------------


def _envelope(seq: int, inline: int = 0, blob: bool = False) -> dict:
    payload = {"blob": "tinkerq:blob:x", "size": 10 << 20} if blob else {"inline": b"x" * inline}
    return {"v": 1, "op": "forward", "model_id": "m", "seq_id": seq, "payload": payload}


def _waiting(seq: int, inline: int = 0, blob: bool = False) -> Request:
    return Request("forward", _envelope(seq, inline, blob), [Caller(f"t{seq}", None)], model_id="m", seq_id=seq)


def test_buffered_requests_are_bounded_in_bytes_as_well_as_count():
    ordering = Ordering(max_buffered=10, max_buffered_bytes=3 * ENTRY_OVERHEAD_BYTES + 300_000)
    assert ordering.buffer(2, _waiting(2, 100_000))
    assert ordering.buffer(3, _waiting(3, blob=True))  # a claim-checked payload stays in Redis
    assert ordering.buffer(4, _waiting(4, 150_000))
    assert ordering.buffered_bytes == sum(envelope_bytes(e) for e in (_envelope(2, 100_000), _envelope(3, blob=True),
                                                                      _envelope(4, 150_000)))
    assert not ordering.buffer(5, _waiting(5, 60_000))
    assert "byte bound" in ordering.refusal
    assert ordering.buffer(6, _waiting(6, 10))  # small ones still fit
    ordering.applied(1, ("ok", b"", {}))
    assert ordering.pop_ready().seq_id == 2
    assert ordering.buffered_bytes == 2 * ENTRY_OVERHEAD_BYTES + 150_000 + 10 + ENTRY_OVERHEAD_BYTES
    assert len(ordering.drop_buffered()) == 3 and ordering.buffered_bytes == 0

    by_count = Ordering(max_buffered=2)
    assert by_count.buffer(2, _waiting(2)) and by_count.buffer(3, _waiting(3))
    assert not by_count.buffer(4, _waiting(4)) and "at most 2" in by_count.refusal


def test_kept_replies_are_bounded_in_bytes_and_the_newest_is_always_kept():
    ordering = Ordering(kept_replies=100, kept_reply_bytes=10_000_000)
    for seq in range(1, 6):
        ordering.applied(seq, ("ok", b"r" * 3_000_000, {"compute_s": 1.0}))
    assert list(ordering.replies) == [3, 4, 5]  # 3 x 3 MB fit in 10 MB, a fourth does not
    assert ordering.reply_for(2) is None and ordering.reply_for(5)[1][:1] == b"r"
    assert ordering.reply_bytes == 3 * (3_000_000 + ENTRY_OVERHEAD_BYTES)
    ordering.applied(6, ("ok", b"h" * 50_000_000, {}))  # larger than the bound alone: kept, alone
    assert list(ordering.replies) == [6]
    ordering.applied(7, ("error", {"type": "ValidationError", "message": "m"}, {}))
    assert list(ordering.replies) == [7] and ordering.reply_bytes == ENTRY_OVERHEAD_BYTES
    by_count = Ordering(kept_replies=2)
    for seq in range(1, 5):
        by_count.applied(seq, ("ok", b"x", {}))
    assert list(by_count.replies) == [3, 4]


def test_large_requests_and_replies_are_recognised():
    assert memory.is_large({"blob": "k", "size": memory.LARGE_BYTES + 1}, ("ok", b"", {}))
    assert memory.is_large({"inline": b""}, ("ok", b"x" * (memory.LARGE_BYTES + 1), {}))
    assert not memory.is_large({"blob": "k", "size": 1000}, ("error", {"message": "m"}, {}))
    assert not memory.is_large(None, None)
    assert not memory.is_large({"blob": "k", "size": "huge"}, ("ok", b"x", {}))  # a hostile ref: no error


def test_release_memory_returns_freed_heap_to_the_os():
    if memory._LIBC is None:
        pytest.skip("malloc_trim is glibc's")
    # Freed small blocks stay in glibc's heap (below the mmap threshold); trim gives them back.
    # ~190 MiB in 64 KiB heap blocks, each followed by a small block that stays: the freed space is holes
    # in the heap, not its top, so free() cannot shrink the heap by itself.
    blocks, keep = [], []
    for _ in range(3000):
        blocks.append(bytearray(64 * 1024))
        keep.append(bytearray(1024))  # above pymalloc's 512 bytes: from glibc's heap too
    del blocks
    before = memory.rss_bytes()
    released = memory.release_memory()
    print(f"\nRSS {before / MiB:.0f} MiB -> {memory.rss_bytes() / MiB:.0f} MiB after release_memory")
    assert released > 100 * MiB
    del keep


# -- a real worker process -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def capacity_worker(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A worker capped at 1200 MiB serving a 7M-parameter model (a session is estimated at ~170 MB), with
    micro-batches of up to 1 Mi tokens so that a large batch is one large pass."""
    from tinkerq.launcher.processes import stop
    from tinkerq.recipes.demo_model import build_tokenizer

    root = tmp_path_factory.mktemp("memory")
    model_dir = root / "medium-llama"
    _llama(384, 1152, 4).save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    name = "memory-capacity-model"
    # A 5 s heartbeat (the default), not the tests' 1 s: this is about admission, not liveness. With 1 s a worker
    # silent for 1.5 s is taken for lost, and one CI run on a loaded machine failed here that way (WorkerLostError
    # instead of the refusal, right after six sessions were closed).
    proc = start_named_worker(model_dir, redis_url, name, root / "worker.log",
                              {"TINKERQ_MEMORY_LIMIT_MB": "1200", "TINKERQ_MICROBATCH_TOKENS": str(1 << 20),
                               "TINKERQ_HEARTBEAT_S": "5"},
                              extra=["--max-sessions", "64"])
    yield name
    stop(proc.pid, timeout=20)


def _refusal(future) -> ServerError:
    err = future.exception(timeout=120)
    # Typed on the producer's side too (tinkerq.errors), and a server error: the request was fine.
    assert isinstance(err, CapacityError) and isinstance(err, ServerError), err
    assert "needs about" in err.message and "is free" in err.message and "nothing was allocated" in err.message, err
    return err


def test_requests_that_do_not_fit_are_refused_and_the_worker_keeps_serving(capacity_worker, redis_url):
    from tinkerq.producer import ServiceClient

    with ServiceClient(broker_url=redis_url) as sc:
        tc = sc.create_training_client(capacity_worker)
        data = make_batch(np.random.default_rng(7), 3)
        before = tc.forward(data).result(timeout=120)
        sampler = tc.save_weights_and_get_sampling_client()
        prompt = types.ModelInput.from_ints([5, 6, 7, 8])
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
        sampled = sampler.sample(prompt, 2, params).result(timeout=120)

        # Sessions until the worker is full: the next one is refused with a clear server error.
        extra, refused = [], None
        for _ in range(40):
            try:
                extra.append(sc.create_training_client(capacity_worker).result())
            except ServerError as exc:
                refused = exc
                break
        assert refused is not None, f"{len(extra) + 1} sessions were all admitted under a 1200 MiB cap"
        assert "a new training session" in refused.message and "TINKERQ_MEMORY_LIMIT_MB=1200" in refused.message
        assert "close unused training clients" in refused.message.lower()
        # ... and what sharding would do (the planner's answer, docs/planning.md): how many shards it would need.
        assert "--shards" in refused.message or "no number of shards makes room" in refused.message, refused.message
        print(f"\n{len(extra) + 1} sessions admitted, the next refused: {refused.message}")
        for other in extra:
            other.close()

        # A KV cache of ~3 GB: refused.
        huge = _refusal(sampler.sample(prompt, 256, types.SamplingParams(max_tokens=2000, temperature=1.0)))
        assert "sampling 256 sequence(s)" in huge.message and "fewer samples" in huge.message
        # One pass over 1000 x 200 tokens (the worker's micro-batches allow it): tens of GB of activations.
        big = make_batch(np.random.default_rng(8), 1000, min_len=200, max_len=200)
        for fut in (tc.forward_backward(big), tc.forward(big)):
            err = _refusal(fut)
            assert "1000 datum(s)" in err.message and "smaller batch" in err.message

        # Nothing changed and the worker serves on: same outputs, same samples, training works.
        after = tc.forward(data).result(timeout=120)
        for a, b in zip(before.loss_fn_outputs, after.loss_fn_outputs, strict=True):
            np.testing.assert_array_equal(a["logprobs"].to_numpy(), b["logprobs"].to_numpy())
        again = sampler.sample(prompt, 2, params).result(timeout=120)
        assert [s.tokens for s in again.sequences] == [s.tokens for s in sampled.sequences]
        tc.forward_backward(data).result(timeout=120)
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120)
        replacement = sc.create_training_client(capacity_worker).result()  # room again after the closes
        replacement.close()
        tc.close()


def _settled_rss(pid: int, quiet_s: float = 2.0, limit_s: float = 20.0) -> int:
    """A process's RSS once it has not fallen for ``quiet_s`` (at most ``limit_s``): the lowest reading."""
    lowest, since, deadline = memory.rss_bytes(pid), time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.25)
        now = memory.rss_bytes(pid)
        if now < lowest:
            lowest, since = now, time.monotonic()
    return lowest


def test_worker_rss_returns_near_its_baseline_after_large_requests(model_dir, redis_url, tmp_path):
    """Large forward / forward_backward requests (10 MB each) leave RSS near where it started."""
    from tinkerq.launcher.processes import stop
    from tinkerq.producer import ServiceClient

    proc = start_named_worker(model_dir, redis_url, "memory-rss-model", tmp_path / "worker.log",
                              {"TINKERQ_MAX_MESSAGE_BYTES": str(32 << 20)}, extra=["--max-sessions", "64"])
    try:
        with ServiceClient(broker_url=redis_url) as sc:
            tc = sc.create_training_client("memory-rss-model")
            rng = np.random.default_rng(9)
            small = make_batch(rng, 4)
            # Warm every code path with small requests, then take the baseline.
            tc.forward_backward(small).result(timeout=60)
            tc.optim_step(types.AdamParams(learning_rate=1e-4)).result(timeout=60)
            tc.forward(small).result(timeout=60)
            time.sleep(0.5)
            baseline = memory.rss_bytes(proc.pid)
            big = make_batch(rng, 2000, min_len=245, max_len=250)  # ~495k tokens, a ~10 MB request
            tokens = sum(d.model_input.length for d in big)
            after = []
            for i in range(5):
                fut = tc.forward_backward(big) if i == 4 else tc.forward(big)
                assert len(fut.result(timeout=240).loss_fn_outputs) == len(big)
                time.sleep(0.5)
                after.append(memory.rss_bytes(proc.pid))
            tc.close()
        # The worker gives freed memory back (gc + malloc_trim) after it has sent a large reply, so under load
        # the last reading can come before that release: wait until RSS has stopped falling.
        after[-1] = _settled_rss(proc.pid)
        # The worker keeps the answers of its last requests for retries (8 bytes a token: logprobs and
        # elementwise_loss), bounded by KEPT_REPLY_BYTES; beyond them, RSS must come back.
        kept = 5 * 8 * tokens
        growth = after[-1] - baseline
        print(f"\nworker RSS: baseline {baseline / MiB:.0f} MiB, after each large request "
              f"{[round(a / MiB) for a in after]} MiB; growth {growth / MiB:.0f} MiB, of which kept replies "
              f"{kept / MiB:.0f} MiB")
        # Beyond the kept replies, allocator fragmentation: 53-64 MiB measured on 2026-12-03 (this tree and the
        # session's first commit alike; 50 MiB the day before). Leaking the five decoded bodies (~36 MiB each as
        # Python lists) would hold ~180 MiB: the bound is between the two.
        assert growth <= kept + 96 * MiB, "worker RSS did not come back after large requests"
    finally:
        stop(proc.pid, timeout=20)


def test_a_merged_save_that_does_not_fit_is_refused_and_the_session_serves_on(redis_url, tmp_path):
    """save_weights_for_sampler(merged=True) on a real worker whose cap leaves room for a LoRA tenant but not for
    the merged copies (a 94M-parameter base, 377 MB in float32; about 0.8 GB for its merged save): one
    CapacityError naming the fix reaches the caller, nothing is written, and the tenant trains and saves on."""
    from tinkerq.launcher.processes import stop
    from tinkerq.producer import ServiceClient
    from tinkerq.recipes.demo_model import build_tokenizer

    model_dir = tmp_path / "large-llama"
    _llama(1024, 2816, 8).save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    checkpoints = tmp_path / "checkpoints"
    name = "merged-capacity-model"
    proc = start_named_worker(model_dir, redis_url, name, tmp_path / "worker.log",
                              {"TINKERQ_MEMORY_LIMIT_MB": "1200", "TINKERQ_HEARTBEAT_S": "5",
                               "TINKERQ_CHECKPOINT_DIR": str(checkpoints)})
    try:
        with ServiceClient(broker_url=redis_url) as sc:
            tc = sc.create_lora_training_client(name, rank=4)
            data = make_batch(np.random.default_rng(3), 2)
            tc.forward_backward(data, "cross_entropy").result(timeout=120)
            err = tc.save_weights_for_sampler("too-big", merged=True).exception(timeout=120)
            assert isinstance(err, CapacityError) and isinstance(err, ServerError), err
            assert "a merged save" in err.message and "nothing was allocated" in err.message, err.message
            assert "without merged=True" in err.message, err.message
            print(f"\nrefused: {err.message}")
            assert not list(checkpoints.rglob("too-big*"))  # nothing written
            # The session is untouched: it steps, and saves its adapter (the suggested fix).
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120)
            path = tc.save_weights_for_sampler("adapter-only").result(timeout=120).path
            assert Path(path, "adapter_model.safetensors").is_file()
    finally:
        stop(proc.pid, timeout=20)

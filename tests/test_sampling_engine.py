"""The continuous-batching sampling engine, in process: logprobs equal to a plain forward whatever the batch,
seeds independent of the batch, per-row stop rules, jobs joining a running batch, several weights, errors."""

from __future__ import annotations

import contextlib
import copy
import functools
import threading

import numpy as np
import pytest
import torch

from tests.helpers import VOCAB, load_reference
from tinkerq import errors, types
from tinkerq.worker.sampling import EngineClosed, SampleJob, StopRule, TorchEngine, run_jobs, sample

pytestmark = pytest.mark.timeout(60)

NO_STOP = StopRule([], [], None)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_reference(model_dir)


def make_job(model, prompt, num_samples=1, max_tokens=8, *, key="base", stop=NO_STOP, on_done=None, **params):
    job = SampleJob(model=model, model_key=key, prompt=list(prompt), num_samples=num_samples,
                    params=types.SamplingParams(**params), stop=stop, max_tokens=max_tokens)
    if on_done is not None:
        job.on_done = on_done
    return job


def prompt_of(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=length).tolist()


def forward_logprobs(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """log p(token) at temperature 1 from one unpadded full forward of prompt + completion."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()  # (N, V)
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]  # the positions predicting the completion
    return lp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).numpy()


def assert_logprobs_match(model, job: SampleJob, seqs: list[types.SampledSequence]) -> None:
    assert len(seqs) == job.num_samples
    for seq in seqs:
        assert len(seq.tokens) == len(seq.logprobs) >= 1
        np.testing.assert_allclose(seq.logprobs, forward_logprobs(model, job.prompt, seq.tokens), atol=1e-4, rtol=0)


class PausingGate:
    """Holds the engine inside its ``pause_at``-th model forward until ``go`` is set (a forward pre-hook that
    ``stepping`` puts on the model)."""

    def __init__(self, pause_at: int) -> None:
        self.forwards = 0
        self.pause_at = pause_at
        self.reached = threading.Event()
        self.go = threading.Event()

    def __call__(self, module, args) -> None:
        self.forwards += 1
        if self.forwards == self.pause_at:
            self.reached.set()
            assert self.go.wait(30)


@contextlib.contextmanager
def stepping(engine: TorchEngine, model=None, gate: PausingGate | None = None):
    """Step ``engine`` on a thread of the test until the block ends (as a worker's compute loop does: the engine
    has no thread of its own), with ``gate`` on ``model``'s forwards. On exit the gate lets go, the thread
    stops, the engine is closed and the hook removed."""
    handle = model.register_forward_pre_hook(gate) if gate is not None else None
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            if not engine.step():
                stop.wait(0.001)

    thread = threading.Thread(target=loop, name="test-stepping", daemon=True)
    thread.start()
    try:
        yield
    finally:
        if gate is not None:
            gate.go.set()
        stop.set()
        thread.join(30)
        engine.close()
        if handle is not None:
            handle.remove()


def test_mixed_concurrent_jobs_report_forward_logprobs(model):
    stop_ids = {5, 17, 40}
    specs = [  # (prompt length, num_samples, max_tokens, params)
        (3, 2, 20, dict(temperature=0.0)),
        (40, 3, 7, dict(temperature=0.7, top_k=5, seed=1)),
        (12, 4, 30, dict(temperature=1.0, top_p=0.9, seed=2)),
        (25, 1, 15, dict(temperature=1.0)),
        (8, 2, 25, dict(temperature=0.7, top_k=10, top_p=0.8, seed=4)),
        (17, 4, 12, dict(temperature=1.0, top_k=3, seed=5)),
        (31, 3, 18, dict(temperature=1.0, seed=6)),
    ]
    jobs = [make_job(model, prompt_of(p, i), n, m, stop=StopRule(sorted(stop_ids), [], None), **params)
            for i, (p, n, m, params) in enumerate(specs)]
    results = run_jobs(None, jobs, timeout=30)
    reasons = set()
    for job, seqs in zip(jobs, results, strict=True):
        assert_logprobs_match(model, job, seqs)
        for seq in seqs:
            reasons.add(seq.stop_reason)
            assert not stop_ids & set(seq.tokens[:-1])
            if seq.stop_reason == "stop":
                assert seq.tokens[-1] in stop_ids and len(seq.tokens) <= job.max_tokens
            else:
                assert len(seq.tokens) == job.max_tokens and seq.tokens[-1] not in stop_ids
    assert reasons == {"stop", "length"}
    greedy = results[0]
    assert greedy[0].tokens == greedy[1].tokens  # temperature 0 is the argmax, every row the same
    top1 = run_jobs(None, [make_job(model, jobs[0].prompt, 1, 20, temperature=1.0, top_k=1, seed=9)])[0]
    assert top1[0].tokens == greedy[0].tokens[:len(top1[0].tokens)]


def test_seeded_tokens_do_not_depend_on_the_batch(model):
    target = make_job(model, prompt_of(10, 100), 3, 12, temperature=1.0, seed=7)
    rows: list[int] = []
    target.on_rows = rows.append  # run_jobs submits a copy: it keeps the callback
    alone = run_jobs(None, [target])[0]
    others = [make_job(model, prompt_of(length, length), 2, 20, temperature=0.8, seed=length) for length in (4, 33)]
    batched = run_jobs(None, [others[0], target, others[1]])[1]
    assert rows == [3, 7]  # alone its 3 rows; then in one batch with the others' 2 + 2
    target.on_rows = None

    gate = PausingGate(pause_at=4)  # hold the engine in its 3rd decode step of the other job
    engine = TorchEngine()
    with stepping(engine, model, gate):
        first = threading.Event()
        engine.submit(make_job(model, prompt_of(27, 3), 2, 40, temperature=1.0, seed=3,
                               on_done=lambda *_: first.set()))
        assert gate.reached.wait(30)
        joined = []
        late = copy.copy(target)
        late.on_done = lambda seqs, err: joined.append((seqs, err, first.is_set()))
        engine.submit(late)
        gate.go.set()
        assert first.wait(30)
    (joined_seqs, err, first_done_before), = joined
    assert err is None and not first_done_before  # it really joined a running batch

    tokens = [s.tokens for s in alone]
    assert [s.tokens for s in batched] == tokens
    assert [s.tokens for s in joined_seqs] == tokens
    for seqs in (batched, joined_seqs):
        np.testing.assert_allclose([s.logprobs for s in seqs], [s.logprobs for s in alone], atol=1e-5, rtol=0)
    assert len({tuple(t) for t in tokens}) == 3  # the rows of one seeded job differ
    # Row r's tokens depend on (seed, r) only: not on num_samples, and another seed gives others.
    assert run_jobs(None, [make_job(model, target.prompt, 1, 12, temperature=1.0, seed=7)])[0][0].tokens == tokens[0]
    assert run_jobs(None, [make_job(model, target.prompt, 1, 12, temperature=1.0, seed=8)])[0][0].tokens != tokens[0]


def test_stop_rules_apply_per_row(model, model_dir):
    from transformers import AutoTokenizer

    prompts = [prompt_of(6, 11), prompt_of(19, 12), [1, 10, 11, 12, 13]]
    greedy = [s[0].tokens for s in run_jobs(None, [make_job(model, p, 1, 12, temperature=0.0) for p in prompts])]

    def first_new(tokens: list[int], start: int) -> int:  # an index whose token did not occur before it
        return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])

    cut_a, cut_b = first_new(greedy[0], 2), first_new(greedy[1], 5)
    assert cut_a != cut_b
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.decode(greedy[2][:3])
    jobs = [
        make_job(model, prompts[0], 2, 12, stop=StopRule([greedy[0][cut_a]], [], None), temperature=0.0),
        make_job(model, prompts[1], 1, 12, stop=StopRule([greedy[1][cut_b], 96], [], None), temperature=0.0),
        make_job(model, prompts[2], 1, 12, stop=StopRule(text[-1], [], tokenizer), temperature=0.0),
        make_job(model, prompts[0], 2, 12, stop=StopRule([96], [], None), temperature=0.0),  # never stops
        make_job(model, prompt_of(9, 13), 3, 12, stop=StopRule([96], [], None), temperature=1.0, seed=1),
    ]
    a, b, s, c, d = run_jobs(None, jobs, timeout=30)
    assert [(x.stop_reason, x.tokens) for x in a] == [("stop", greedy[0][:cut_a + 1])] * 2
    assert (b[0].stop_reason, b[0].tokens) == ("stop", greedy[1][:cut_b + 1])
    assert s[0].stop_reason == "stop" and len(s[0].tokens) <= 3 and s[0].tokens == greedy[2][:len(s[0].tokens)]
    assert text[-1] in tokenizer.decode(s[0].tokens)
    assert [(x.stop_reason, x.tokens) for x in c] == [("length", greedy[0])] * 2
    assert all(x.stop_reason == "length" and len(x.tokens) == 12 for x in d)
    for job, seqs in zip(jobs, (a, b, s, c, d), strict=True):
        assert_logprobs_match(model, job, seqs)


def test_a_job_joins_a_running_batch(model):
    gate = PausingGate(pause_at=4)  # prefill + 2 decode steps done, the 3rd decode forward in progress
    engine = TorchEngine()
    order, out, steps, loads = [], {}, {}, {}
    done = threading.Event()

    def on_done(name):
        def record(seqs, err):
            order.append(name)
            out[name] = (seqs, err)
            steps[name] = engine.steps
            loads[name] = engine.load()  # a job's rows are gone from the load before it is answered
            if len(order) == 2:
                done.set()
        return record

    long = make_job(model, prompt_of(5, 21), 2, 150, temperature=1.0, seed=1, on_done=on_done("long"))
    short = make_job(model, prompt_of(23, 22), 2, 6, temperature=0.7, top_p=0.9, seed=2, on_done=on_done("short"))
    rows: dict[str, list[int]] = {"long": [], "short": []}  # the most rows each one's batch held (Flower's line)
    long.on_rows, short.on_rows = rows["long"].append, rows["short"].append
    with stepping(engine, model, gate):
        engine.submit(long)
        assert gate.reached.wait(30)
        assert engine.load() == 2
        engine.submit(short)
        assert engine.load() == 4
        joined_at = engine.steps
        gate.go.set()
        assert done.wait(30)
    assert order == ["short", "long"]
    assert loads == {"short": 2, "long": 0}
    assert rows == {"long": [4], "short": [4]}  # told once each: the long job's 2 rows and the short one's 2
    # The short job ran 6 steps right after it was submitted, not after the long job drained.
    assert steps["short"] == joined_at + 6 and steps["long"] == 149
    for job in (long, short):
        seqs, err = out["long" if job is long else "short"]
        assert err is None
        assert all(len(s.tokens) == job.max_tokens and s.stop_reason == "length" for s in seqs)
        assert_logprobs_match(model, job, seqs)
    assert engine.load() == 0


def test_staggered_arrivals_with_rows_finishing_in_between(model, monkeypatch):
    """Jobs arrive while rows finish at different steps (merges that drop finished rows, compactions);
    every token still carries its full-forward logprob."""
    from tinkerq.worker.sampling import cache_rows

    selects = []
    select = cache_rows.Rows.select
    monkeypatch.setattr(cache_rows.Rows, "select", lambda rows, idx: selects.append(len(idx)) or select(rows, idx))
    outcomes: dict[int, tuple] = {}
    all_done = threading.Semaphore(0)

    def job(*args, **kwargs):
        made = make_job(model, *args, **kwargs)
        made.on_done = lambda s, e: (outcomes.setdefault(id(made), (s, e)), all_done.release())
        return made

    stop = StopRule([5, 17, 40, 63, 88], [], None)
    first = job(prompt_of(9, 200), 16, 30, seed=0)
    schedule = {  # engine step -> the job submitted during that step's first forward (from the stepping thread)
        2: job(prompt_of(14, 201), 1, 4, seed=1),  # 1 of 17 rows: finishes, not yet dropped
        8: job(prompt_of(36, 202), 3, 12, temperature=0.0),  # joins: the merge drops that row
        12: job(prompt_of(5, 203), 2, 20, temperature=0.7, top_k=8, seed=3, stop=stop),
        20: job(prompt_of(22, 204), 4, 9, top_p=0.8, seed=4),
    }
    jobs = [first, *schedule.values()]

    def gate(module, args):  # a forward pre-hook
        late = schedule.pop(engine.steps, None)
        if late is not None:
            engine.submit(late)  # from the stepping thread, inside a step: admitted at the next step
        return None

    engine = TorchEngine()
    handle = model.register_forward_pre_hook(gate)
    try:
        engine.submit(first)
        engine.run_until_idle()  # on this thread
        for _ in jobs:
            assert all_done.acquire(timeout=30)
    finally:
        handle.remove()
        engine.close()
    assert not schedule
    assert selects  # finished rows were dropped while others ran
    for made in jobs:
        seqs, err = outcomes[id(made)]
        assert err is None
        assert_logprobs_match(model, made, seqs)


def test_admission_respects_max_rows(model):
    engine = TorchEngine(max_rows=4)
    steps = {}

    def at_step(name):
        return lambda seqs, err: steps.setdefault(name, engine.steps)

    jobs = [make_job(model, prompt_of(6, 31), 3, 5, seed=1, on_done=at_step("a")),
            make_job(model, prompt_of(9, 32), 3, 5, seed=2, on_done=at_step("b")),
            make_job(model, prompt_of(4, 33), 6, 3, seed=3, on_done=at_step("big"))]  # > max_rows: runs alone
    try:
        results = run_jobs(engine, jobs, timeout=30)
    finally:
        engine.close()
    assert steps == {"a": 4, "b": 9, "big": 12}  # one after the other: 3 + 3 rows do not fit in 4
    for job, seqs in zip(jobs, results, strict=True):
        assert_logprobs_match(model, job, seqs)


def test_two_weight_copies_in_flight_together(model):
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    jobs = []
    for i in range(6):
        weights, key = (model, "base") if i % 2 == 0 else (other, "snapshot-1")
        jobs.append(make_job(weights, prompt_of(4 + 7 * i, 40 + i), 1 + i % 3, 10 + i, key=key, seed=i))
    results = run_jobs(None, jobs, timeout=30)
    for job, seqs in zip(jobs, results, strict=True):
        assert_logprobs_match(job.model, job, seqs)
        wrong = model if job.model is other else other
        gap = np.abs(np.array(seqs[0].logprobs) - forward_logprobs(wrong, job.prompt, seqs[0].tokens)).max()
        assert gap > 1e-2  # the copies really differ: each job was sampled from its own weights


class Boom(RuntimeError):
    pass


def test_a_failing_group_does_not_disturb_the_others(model):
    broken = copy.deepcopy(model)
    calls = [0]

    @functools.wraps(broken.forward)
    def forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] >= 3:  # prefill and one decode step work, then the weights "fail"
            raise Boom("device error")
        return type(broken).forward(broken, *args, **kwargs)

    broken.forward = forward
    engine = TorchEngine()
    outcomes: dict[str, tuple] = {}
    good = [make_job(model, prompt_of(5 + 9 * i, 50 + i), 2, 10, seed=i,
                     on_done=lambda s, e, i=i: outcomes.setdefault(f"good{i}", (s, e))) for i in range(2)]
    bad = [make_job(broken, prompt_of(7, 60 + i), 2, 10, key="broken", seed=i,
                    on_done=lambda s, e, i=i: outcomes.setdefault(f"bad{i}", (s, e))) for i in range(2)]

    def raising(seqs, err):
        raise ValueError("a buggy callback")

    try:
        with pytest.raises(Boom):
            run_jobs(engine, [good[0], bad[0], good[1], bad[1],
                              make_job(model, prompt_of(3, 70), 1, 4, on_done=raising)], timeout=30)
        # The engine serves on after a group failed and a callback raised.
        after = make_job(model, prompt_of(11, 71), 2, 6, seed=5)
        assert_logprobs_match(model, after, run_jobs(engine, [after], timeout=30)[0])
    finally:
        engine.close()
    for i in range(2):
        seqs, err = outcomes[f"bad{i}"]
        assert seqs is None and isinstance(err, Boom)
        seqs, err = outcomes[f"good{i}"]
        assert err is None
        assert_logprobs_match(model, good[i], seqs)


def test_close_fails_jobs_not_done(model):
    gate = PausingGate(pause_at=1)  # hold the first prefill
    engine = TorchEngine()
    outcomes = []
    with stepping(engine, model, gate):
        for i in range(2):
            engine.submit(make_job(model, prompt_of(5, 80 + i), 2, 20, seed=i,
                                   on_done=lambda s, e: outcomes.append((s, e))))
            if i == 0:
                assert gate.reached.wait(30)  # job 0 is running, job 1 waits
        assert engine.load() == 4
        assert engine.has_work()
        closer = threading.Thread(target=engine.close)  # waits for the step in progress
        closer.start()
        gate.go.set()
        closer.join(30)
        assert not closer.is_alive()
        assert len(outcomes) == 2 and all(s is None and isinstance(e, EngineClosed) for s, e in outcomes)
        assert all(isinstance(e, errors.WorkerError) and "the worker stopped before" in e.message for _, e in outcomes)
        with pytest.raises(EngineClosed):
            engine.submit(make_job(model, [1, 2], 1, 2))
        assert engine.load() == 0
        assert not engine.has_work() and not engine.step()


def test_stepped_on_the_callers_thread(model):
    """No thread of its own: nothing runs until the owner steps; each step is one token of the running rows
    (the prefill gives the first), and callbacks run on the stepping thread."""
    engine = TorchEngine()
    assert not engine.has_work() and not engine.step()
    threads = []
    job = make_job(model, prompt_of(7, 91), 2, 3, seed=1, on_done=lambda s, e: threads.append(threading.get_ident()))
    submitter = threading.Thread(target=engine.submit, args=(job,))  # submit is thread-safe: from anywhere
    submitter.start()
    submitter.join(30)
    assert engine.has_work() and engine.load() == 2 and engine.steps == 0
    assert engine.step() and engine.steps == 1 and not threads  # the prefill and the first token
    engine.run_until_idle()
    assert engine.steps == 3 and threads == [threading.get_ident()] and not engine.has_work()
    assert not engine.step() and engine.steps == 3
    engine.close()


def test_compat_sample_goes_through_the_engine(model):
    params = types.SamplingParams(max_tokens=9, seed=4, temperature=0.9, top_k=20)
    prompt = prompt_of(13, 90)
    seqs = sample(model, prompt, 3, params, NO_STOP, 9)
    assert seqs == run_jobs(None, [make_job(model, prompt, 3, 9, seed=4, temperature=0.9, top_k=20)])[0]
    assert_logprobs_match(model, make_job(model, prompt, 3, 9), seqs)


# -- the dense decode step (worker/sampling/dense_decode.py) ----------------------------------------------------


def _dense_family(family: str):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(5)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    made = {"llama": lambda: LlamaForCausalLM(LlamaConfig(**common)),
            "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**common)),
            "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**common, head_dim=8))}[family]()
    return made.eval()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_dense_decode_is_bitwise_the_models_own_forward(family, monkeypatch):
    """Rows of several prompt lengths (left padding), joining at different steps, temperatures, filters, greedy
    rows: every token and logprob with the dense decode step equals the one the model's own forward gives, and
    the full forward of prompt + completion (the reference)."""
    from tinkerq.worker.sampling import dense_decode, forwards

    model = _dense_family(family)
    assert dense_decode.dense_decode(model) is not None
    calls = []
    step = dense_decode.DenseDecode.__call__
    monkeypatch.setattr(dense_decode.DenseDecode, "__call__", lambda *a: calls.append(1) or step(*a))

    def run(dense: bool) -> list[list[types.SampledSequence]]:
        monkeypatch.setattr(forwards, "DENSE_DECODE", dense)
        answers: dict[int, list[types.SampledSequence]] = {}

        def job(i: int, *args, **kwargs) -> SampleJob:
            return make_job(model, *args, **kwargs, on_done=lambda seqs, err: answers.setdefault(i, seqs))

        engine = TorchEngine()
        try:
            engine.submit(job(0, prompt_of(3, 1), 3, 12, temperature=1.0, seed=7))
            engine.submit(job(1, prompt_of(17, 2), 2, 9, temperature=0.6, top_k=20, seed=8))
            engine.submit(job(2, prompt_of(9, 3), 1, 14, temperature=0.0))
            engine.step()
            engine.step()
            # Joins rows whose cache is already wider: its rows are padded on the left.
            engine.submit(job(3, prompt_of(30, 4), 2, 5, top_p=0.7, seed=9))
            engine.run_until_idle()
        finally:
            engine.close()
        assert sorted(answers) == [0, 1, 2, 3] and all(answers.values())
        return [answers[i] for i in range(4)]

    plain = run(False)
    assert not calls
    fast = run(True)
    assert calls  # the fast step ran
    for a_job, b_job in zip(plain, fast, strict=True):
        for a, b in zip(a_job, b_job, strict=True):
            assert a.tokens == b.tokens and a.logprobs == b.logprobs and a.stop_reason == b.stop_reason
    job = make_job(model, prompt_of(17, 2), 2, 9, temperature=0.6, top_k=20, seed=8)
    assert_logprobs_match(model, job, fast[1])
    # One prompt's rows only: no padding anywhere (the model then gives SDPA no mask).
    alone = {}
    for dense in (False, True):
        monkeypatch.setattr(forwards, "DENSE_DECODE", dense)
        alone[dense] = run_jobs(None, [make_job(model, prompt_of(11, 5), 3, 10, temperature=1.0, seed=4)])[0]
    assert [(s.tokens, s.logprobs) for s in alone[True]] == [(s.tokens, s.logprobs) for s in alone[False]]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_dense_prefill_is_bitwise_the_models_own_prefill(family, lora):
    """The dense prefill's logits after the prompt and its cache (class and keys/values per layer) are bitwise what
    ``model(input_ids=ids, use_cache=True, logits_to_keep=1)`` gives: one token, one row, several rows; with a LoRA
    snapshot routed over every row (as the engine routes a sampling client's rows) and without."""
    from tinkerq.worker.lora.session import LoraBase, LoraSession
    from tinkerq.worker.sampling import dense_decode, forwards
    from tinkerq.worker.training.logprobs import LogprobComputer

    model = _dense_family(family)
    fast = dense_decode.dense_decode(model)
    assert fast is not None
    adapter = None
    if lora:
        base = LoraBase(model, LogprobComputer(model, "torch"), model_dir="/nonexistent", microbatch_tokens=4096)
        session = LoraSession("t", base, types.LoraConfig(rank=4, seed=1), base_model="tiny")
        with torch.no_grad():  # nonzero B: the adapter changes every row
            for p in session.engine.params:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)), alpha=0.05)
        adapter = session.adapter.frozen()
    gen = torch.Generator().manual_seed(11)
    for rows, length in [(1, 1), (1, 9), (3, 17)]:
        ids = torch.randint(3, VOCAB, (rows, length), generator=gen)
        with torch.no_grad(), forwards.routed([adapter] * rows, device=ids.device):
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            logits, cache = fast.prefill(ids)
        assert logits.dtype == torch.float32 and logits.shape == (rows, VOCAB)
        assert torch.equal(logits, out.logits[:, -1].float())
        theirs = forwards.returned_cache(out)
        assert type(cache) is type(theirs) and len(cache.layers) == len(theirs.layers) == 2
        for mine, their in zip(cache.layers, theirs.layers, strict=True):
            assert type(mine) is type(their)
            assert torch.equal(mine.keys, their.keys) and torch.equal(mine.values, their.values)
        if lora:
            with torch.no_grad():
                assert not torch.equal(logits, model(input_ids=ids, logits_to_keep=1).logits[:, -1])



def test_dense_groups_step_in_inference_mode_and_leave_the_model_trainable(monkeypatch):
    """A dense group's steps run under torch.inference_mode (cheaper per operator), with the same tokens and logprobs
    as under no_grad; the model trains afterwards exactly as one that never sampled (no inference tensor reached
    it). A model whose rotary table is rebuilt in its forward ("dynamic" rope) keeps no_grad."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tinkerq.worker.sampling import cache_rows

    model = _dense_family("qwen3")
    untouched = copy.deepcopy(model)
    modes = []

    def run() -> list[tuple[list[int], list[float]]]:
        answers: dict[int, list[types.SampledSequence]] = {}
        jobs = [make_job(model, prompt_of(n, n), 2, 10, temperature=1.0, seed=n,
                         on_done=lambda seqs, err, n=n: (modes.append(torch.is_inference_mode_enabled()),
                                                         answers.setdefault(n, seqs)))
                for n in (4, 9, 13)]
        run_jobs(None, jobs)
        return [(s.tokens, s.logprobs) for n in sorted(answers) for s in answers[n]]

    fast = run()
    assert modes and all(modes)  # answered inside the step, under inference_mode
    original_init = cache_rows.Group.__init__

    def without(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.inference_mode = False

    monkeypatch.setattr(cache_rows.Group, "__init__", without)
    modes.clear()
    assert run() == fast and modes and not any(modes)
    monkeypatch.undo()

    # Training after sampling: the same loss and gradients as a copy that never sampled.
    ids = torch.tensor([prompt_of(12, 3)])
    grads = []
    for m in (model, untouched):
        m.train()
        m.zero_grad()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        grads.append([loss.detach()] + [p.grad for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))

    dynamic = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           rope_scaling={"rope_type": "dynamic", "factor": 2.0})).eval()
    assert cache_rows.Group(dynamic).dense is not None and not cache_rows.Group(dynamic).inference_mode
    assert cache_rows.Group(model).inference_mode

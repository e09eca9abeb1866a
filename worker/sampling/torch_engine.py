"""Continuous batching on Hugging Face causal LMs with a KV cache (torch only), stepped by its owner's thread.

The engine has no thread of its own. ``submit`` only queues a job (from any thread); the thread that owns the
model and the device (the worker's compute loop, or a test) calls ``step`` when it picks sampling, and every
forward and callback runs there. One step admits waiting jobs, then for every group of rows sharing weights
(``model_key``) runs one decode forward for its running rows and prefills its newcomers, samples one token per
row, applies the per-row stop rules and reports finished jobs. A job submitted while others run joins them at
the next step instead of waiting for the batch to drain.

How rows are held in each kind of cache layer: worker/sampling/cache_rows.py. The forwards (padding, masks,
positions, prompt logprobs) and how seeds pick tokens: worker/sampling/forwards.py. Each token's logprob is
log_softmax of the raw logits (temperature 1).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Hashable

import numpy as np
import torch

from tinkerq import types
from tinkerq.worker.sampling import cache_rows, forwards
from tinkerq.worker.sampling.cache_rows import Group, Rows
from tinkerq.worker.sampling.engine import EngineClosed, SampleJob
from tinkerq.worker.sampling.prompt_scores import PromptScores, sample_topk
from tinkerq.worker.sampling.rules import filter_logits

log = logging.getLogger(__name__)


class Job:
    """A submitted job's progress: its sequences as rows finish."""

    def __init__(self, job: SampleJob, on_report: Callable[[Job], None]) -> None:
        self.job = job
        self._on_report = on_report
        self.results: list[types.SampledSequence | None] = [None] * job.num_samples
        self.left = job.num_samples
        self.reported = False
        self.prompt_logprobs: np.ndarray | None = None  # (P,), set at prefill when the job asks
        self.prompt_scores: PromptScores | None = None  # set at prefill when the job's options ask
        # topk_sample_logprobs: per sample, the (ids (k,), logprobs (k,)) of each position sampled so far.
        self.sample_topk: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(job.num_samples)]
        self.peak_rows = 0  # the most rows its group held while it ran (set when rows join)

    def report(self, sequences: list[types.SampledSequence] | None, error: BaseException | None) -> None:
        if self.reported:
            return
        self.reported = True
        self._on_report(self)  # before the answer: whoever hears it sees the rows gone
        try:
            if sequences is not None and self.job.on_prompt_logprobs is not None:
                assert self.prompt_logprobs is not None  # computed at prefill, before any row could finish
                self.job.on_prompt_logprobs(self.prompt_logprobs)
            if sequences is not None and self.job.on_prompt_scores is not None:
                assert self.prompt_scores is not None  # likewise
                self.job.on_prompt_scores(self.prompt_scores)
            if self.job.on_rows is not None:
                self.job.on_rows(self.peak_rows)
            self.job.on_done(sequences, error)
        except Exception:  # a caller's bug must not stop the engine
            log.exception("sampling on_done callback raised; ignored")


class TorchEngine:
    """Continuous batching for Hugging Face causal LMs, run by whoever calls ``step`` (see the module doc).

    Thread safety: ``submit``, ``has_work``, ``load`` and ``close`` from any thread. ``step`` runs one step at
    a time (a second caller waits for the first), with the callbacks on the stepping thread; a callback must
    not call ``step`` itself.
    """

    def __init__(self, max_rows: int = 256) -> None:
        self.max_rows = max_rows
        self._lock = threading.Lock()  # guards _waiting, _open_rows and _closed
        self._stepping = threading.Lock()  # held by the step in progress
        self._stepper: int | None = None  # the thread running that step
        self._waiting: deque[Job] = deque()
        self._open_rows = 0  # rows of jobs submitted and not answered yet
        self._groups: dict[Hashable, Group] = {}  # the stepping thread only
        self._closed = False
        self.steps = 0  # steps that did work: lets tests (and metrics) observe progress

    # -- the interface ---------------------------------------------------------------------------------

    def submit(self, job: SampleJob) -> None:
        """Queue ``job`` (thread-safe; it runs in the steps that follow). Raises EngineClosed after close."""
        if job.num_samples < 1 or job.max_tokens < 1 or not job.prompt:
            raise ValueError("a sample job needs a prompt, num_samples >= 1 and max_tokens >= 1")
        with self._lock:
            if self._closed:
                raise EngineClosed("the sampling engine is closed")
            self._waiting.append(Job(job, self._answered))
            self._open_rows += job.num_samples

    def has_work(self) -> bool:
        """Whether a job is queued or running, i.e. ``step`` would do something (thread-safe)."""
        with self._lock:
            return not self._closed and self._open_rows > 0

    def load(self) -> int:
        """Rows waiting + running (for load reporting)."""
        return self._open_rows

    def step(self) -> bool:
        """Run one step on the calling thread: admit waiting jobs, then one forward per group of weights (its
        running rows' decode and its newcomers' prefill) and one token per row; jobs whose last row finished
        are answered here. Returns whether there was anything to do."""
        with self._stepping:
            self._stepper = threading.get_ident()
            try:
                # no_grad, not inference_mode: a model's lazily built buffers must stay usable in training (a group
                # that cannot build any runs its own steps under inference_mode: Group.inference_mode)
                with torch.no_grad():
                    did = self._iteration()
                if did:
                    self.steps += 1
            finally:
                self._stepper = None
                if self._closed:  # closed during the step (by a callback, or another thread waiting for it)
                    self._shut()
        return did

    def run_until_idle(self) -> None:
        """``step`` until nothing is queued or running (tests, benchmarks, standalone use)."""
        while self.step():
            pass

    def close(self) -> None:
        """Answer every job still waiting or running with EngineClosed; later submits raise it. A step in
        progress on another thread is finished first; called from a callback, the current step ends it."""
        with self._lock:
            self._closed = True
        if self._stepper == threading.get_ident():
            return
        with self._stepping:
            self._shut()

    def _answered(self, job: Job) -> None:
        with self._lock:
            self._open_rows -= job.job.num_samples

    def _shut(self) -> None:
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        error = EngineClosed("the worker stopped before this sampling request finished; send it again")
        running = [job for group in self._groups.values() for job in (group.rows.jobs if group.rows else [])]
        self._groups.clear()
        for job in running + waiting:
            job.report(None, error)

    # -- a step ----------------------------------------------------------------------------------------

    def _iteration(self) -> bool:
        with self._lock:
            if self._closed or (not self._waiting and not self._groups):
                return False
            # Admit in FIFO order while the rows fit (a job larger than max_rows alone still runs).
            running = sum(g.size - g.finished for g in self._groups.values())
            admitted: dict[Hashable, list[Job]] = {}
            while self._waiting and (running == 0 or running + self._waiting[0].job.num_samples <= self.max_rows):
                job = self._waiting.popleft()
                running += job.job.num_samples
                # A model whose cache holds rows only in lockstep (DeepSeek-V4) gives each job a group of its own:
                # its rows share one prefill and one length, and no other rows join them.
                key = (job.job.model_key, id(job)) if cache_rows.lockstep(job.job.model) else job.job.model_key
                admitted.setdefault(key, []).append(job)
        try:
            for key, newcomers in admitted.items():
                if key not in self._groups:
                    try:
                        self._groups[key] = Group(newcomers[0].job.model)
                    except Exception as exc:
                        for job in newcomers:
                            job.report(None, exc)
            for key in list(self._groups):
                group = self._groups[key]
                with torch.inference_mode(group.inference_mode):
                    self._step(group, admitted.get(key, []))
                if group.rows is None:
                    del self._groups[key]
        except Exception as exc:  # a bug of the engine's own: answer what it holds rather than leave it waiting
            log.exception("sampling step failed")
            held = [j for g in self._groups.values() for j in (g.rows.jobs if g.rows else [])]
            for job in [*(j for jobs in admitted.values() for j in jobs), *held]:
                job.report(None, exc)
            self._groups.clear()
        return True

    def _step(self, group: Group, newcomers: list[Job]) -> None:
        """One token for every row of ``group``; an error fails this group's jobs only."""
        logits: torch.Tensor | None = None  # (B, V) of the running rows, once decoded
        if group.rows is not None:
            try:
                logits = forwards.decode(group)  # (B, V)
            except Exception as exc:
                self._fail(group, exc)
        parts, new_logits = [], []
        for chunk in forwards.prefill_chunks(newcomers):
            try:
                rows, chunk_logits = forwards.prefill(group, chunk)
                parts.append(rows)
                new_logits.append(chunk_logits)
            except Exception as exc:
                for job in chunk:
                    job.report(None, exc)
        if group.rows is None and not parts:
            return
        try:
            if group.rows is None and len(parts) == 1:  # nothing to merge with
                group.rows, parts = parts[0], []
                logits = new_logits[0]
                group.refresh()
            if parts:  # merge the newcomers in; the finished rows go at the same time
                if group.rows is not None and logits is not None and group.finished == 0:
                    parts.insert(0, group.rows)
                    new_logits.insert(0, logits)
                elif group.rows is not None and logits is not None:
                    keep = group.rows.t["active"].nonzero().squeeze(1)  # (B',)
                    parts.insert(0, group.rows.select(keep))
                    new_logits.insert(0, logits.index_select(0, keep))
                group.rows, group.finished = Rows.cat(parts), 0
                logits = torch.cat(new_logits)
                group.refresh()
            if newcomers:  # rows joined: the batch is at its largest for this while
                _note_rows(group)
            assert logits is not None  # the running rows' or the one newcomer chunk's
            self._sample(group, logits)
        except Exception as exc:
            for rows in parts:  # newcomers not merged yet
                for job in rows.jobs:
                    job.report(None, exc)
            self._fail(group, exc)

    def _fail(self, group: Group, exc: BaseException) -> None:
        log.exception("sampling step failed for %d rows", group.size, exc_info=exc)
        for job in group.rows.jobs if group.rows else []:
            job.report(None, exc)
        group.rows, group.finished = None, 0
        group.refresh()

    # -- sampling --------------------------------------------------------------------------------------

    def _sample(self, group: Group, logits: torch.Tensor) -> None:
        """Pick one token per row from ``logits`` (B, V), record it, finish rows, report finished jobs."""
        rows = group.rows
        assert rows is not None
        t = rows.t
        gen = t["gen"]
        greedy_tok = logits.argmax(-1) if group.any_greedy else None  # (B,)
        lse = None
        if greedy_tok is not None and group.all_greedy:
            tok = greedy_tok
        else:
            scaled = logits if group.plain else logits / t["temp"][:, None]  # (B, V)
            for top_k, top_p, idx in group.filters:  # one call per distinct (top_k, top_p)
                scaled[idx] = filter_logits(scaled[idx], top_k, top_p)
            # Inverse CDF over the unnormalised probabilities: the first token whose cumulative mass exceeds
            # u * total (filtered tokens add nothing, so they are never picked).
            peak = scaled.amax(-1, keepdim=True)  # (B, 1)
            cdf = (scaled - peak).exp_().cumsum_(-1)  # (B, V)
            target = t["uniforms"].gather(1, gen[:, None]) * cdf[:, -1:]  # (B, 1)
            tok = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=logits.shape[1] - 1)
            if greedy_tok is not None:
                tok = torch.where(t["greedy"], greedy_tok, tok)
            if group.plain:  # the sampling distribution is the temperature-1 one: reuse its normaliser
                lse = peak.squeeze(1) + cdf[:, -1].log()
        if lse is None:
            lse = torch.logsumexp(logits, -1)
        lp = logits.gather(1, tok[:, None]).squeeze(1) - lse  # (B,) log p at temperature 1

        active = t["active"]
        if group.topk_rows is not None:  # topk_sample_logprobs: kept on the host, per row still sampling
            idx, kmax = group.topk_rows
            ids, values = sample_topk(logits, lse, idx, kmax)
            for r, alive, i, v in zip(idx.tolist(), active.index_select(0, idx).tolist(), ids, values, strict=True):
                if alive:
                    rows.jobs[r].sample_topk[rows.samples[r]].append((i, v))
        t["out_tok"].scatter_(1, gen[:, None], tok[:, None])  # finished rows write their scratch column
        t["out_lp"].scatter_(1, gen[:, None], lp[:, None])
        t["last"] = tok
        gen += active
        stopped = (tok[:, None] == t["stop_ids"]).any(1)  # (B,)
        if group.py_stop:  # stop strings: the rule decodes the row's tokens
            idx = torch.tensor(group.py_stop, device=gen.device)
            for r, alive, n in zip(group.py_stop, active[idx].tolist(), gen[idx].tolist(), strict=True):
                if alive and rows.jobs[r].job.stop.done(t["out_tok"][r, :n].tolist()):
                    stopped[r] = True
        done = active & (stopped | (gen >= t["maxtok"]))
        finished = done.nonzero().squeeze(1)
        if len(finished) == 0:
            return
        active &= ~done
        group.finished += len(finished)
        toks, lps = t["out_tok"][finished], t["out_lp"][finished]  # (F, W)
        for i, (r, n, stop) in enumerate(zip(finished.tolist(), gen[finished].tolist(),
                                             stopped[finished].tolist(), strict=True)):
            job = rows.jobs[r]
            job.results[rows.samples[r]] = types.SampledSequence(
                stop_reason="stop" if stop else "length", tokens=toks[i, :n].tolist(), logprobs=lps[i, :n].tolist(),
                topk_logprobs=_topk_of(job, rows.samples[r]))
            job.left -= 1
            if job.left == 0:
                job.report(job.results, None)  # type: ignore[arg-type]
        # Drop finished rows once they are >= 1/8 of the batch (each drop copies the cache).
        if group.finished == group.size:
            group.rows, group.finished = None, 0
            group.refresh()
        elif group.finished * 8 >= group.size:
            group.rows, group.finished = rows.select(active.nonzero().squeeze(1)), 0
            group.refresh()


def _note_rows(group: Group) -> None:
    """Each job of ``group`` has seen the batch at its current size (a loop over rows, run when rows join only)."""
    assert group.rows is not None
    n = len(group.rows.jobs)
    for job in group.rows.jobs:
        if job.peak_rows < n:
            job.peak_rows = n


def _topk_of(job: Job, sample: int) -> types.TopkLogprobs | None:
    """The sampled positions' top-k of ``sample`` of ``job`` (its own k), or None when the job did not ask."""
    k = job.job.options.topk_sample if job.job.options is not None else 0
    if not k:
        return None
    kept = job.sample_topk[sample]
    return types.TopkLogprobs(token_ids=np.stack([ids[:k] for ids, _ in kept]).astype(np.int32),
                              logprobs=np.stack([lps[:k] for _, lps in kept]).astype(np.float32))

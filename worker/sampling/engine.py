"""The sampling engine interface: what the worker hands a backend (torch today, e.g. vLLM later).

A backend takes ``SampleJob``s from any thread and runs them, batched however it likes, in the steps its owner
calls (``step``, on the thread that owns the model and the device: the worker's compute loop); it has no thread
of its own. It reports each job exactly once through ``job.on_done``, on the stepping thread. It must report,
for every sampled token, log p(token) at temperature 1 under the job's weights: the number ``forward`` computes
for that token; and, for a job with ``on_prompt_logprobs``, the same number for every prompt token after the
first. A job with ``options`` gets the top-k of every sampled position in its sequences, and the prompt answers
(top-k, target ids, alternative tokens: worker/sampling/prompt_scores.py) through ``on_prompt_scores``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from tinkerq import types
from tinkerq.errors import WorkerError
from tinkerq.validation import PromptOptions
from tinkerq.worker.sampling.rules import StopRule

if TYPE_CHECKING:  # a backend need not import transformers
    from transformers import PreTrainedModel

    from tinkerq.worker.sampling.prompt_scores import PromptScores

OnDone = Callable[[list[types.SampledSequence] | None, BaseException | None], None]
# (P,) float32: NaN at 0, then log p(prompt[i] | prompt[:i]) at temperature 1 under the job's weights.
OnPromptLogprobs = Callable[[np.ndarray], None]
OnPromptScores = Callable[["PromptScores"], None]


def _ignore(sequences: list[types.SampledSequence] | None, error: BaseException | None) -> None:
    pass


class EngineClosed(WorkerError):
    """The engine was closed (the worker stopped) before the job finished; a server error, so the request can be
    sent again."""


@dataclass
class SampleJob:
    model: PreTrainedModel  # the weights to sample from (a frozen snapshot or the base model)
    model_key: Hashable  # jobs with the same key share forward passes (same weights)
    prompt: list[int]
    num_samples: int
    params: types.SamplingParams  # seed, temperature, top_k, top_p are read here; stop is in ``stop``
    stop: StopRule
    max_tokens: int  # already resolved (never None); prompt + max_tokens <= the model's max length
    # Called exactly once, on the thread that runs the engine's steps, with the num_samples sequences (in sample
    # order) or an error.
    on_done: OnDone = _ignore
    # A LoRA snapshot's adapter over ``model`` (the shared base; worker/lora/routing.py), or None. Jobs of
    # different adapters over one base share its forward passes, each row routed to its own adapter.
    adapter: Any = None
    # Asks for the prompt's logprobs (Tinker's include_prompt_logprobs): called once, on the stepping thread,
    # just before a successful on_done (never when the job fails). None: not asked, nothing computed.
    on_prompt_logprobs: OnPromptLogprobs | None = None
    # Tinker's top-k / target / alternative-token options (None: none asked). The prompt's answers are passed to
    # ``on_prompt_scores`` as the prompt logprobs are (set it when ``options.asks_prompt()``); topk_sample's are
    # in each sequence's ``topk_logprobs``.
    options: PromptOptions | None = None
    on_prompt_scores: OnPromptScores | None = None
    # For monitoring: told, once and just before on_done, the most rows the job's decode batch held while it ran
    # (its own included; 0 when it failed before its first decode).
    on_rows: Callable[[int], None] | None = None


class SamplingEngine(Protocol):
    def submit(self, job: SampleJob) -> None:
        """Thread-safe; only queues the job (raises EngineClosed after close)."""

    def has_work(self) -> bool:
        """Thread-safe: whether a job is queued or running (``step`` would do something)."""

    def step(self) -> bool:
        """One unit of work (a prefill, a decode step) on the calling thread, callbacks included; whether it
        did anything."""

    def run_until_idle(self) -> None:
        """``step`` until there is no work."""

    def load(self) -> int:
        """Rows waiting + running (for load reporting)."""

    def close(self) -> None:
        """Jobs not done get on_done(None, EngineClosed); later submits raise it."""


def run_jobs(engine: SamplingEngine | None, jobs: list[SampleJob],
             timeout: float | None = None) -> list[list[types.SampledSequence]]:
    """Submit ``jobs`` together, step the engine on this thread until all are answered, return their sequences
    in job order (raises the first error). ``timeout`` (seconds) is checked between steps.

    ``engine=None`` runs them on a private TorchEngine, closed afterwards. Each job's own on_done still runs.
    Another thread may step the same engine meanwhile (steps take turns): the jobs are answered by whichever.
    """
    owned = engine is None
    if engine is None:
        from tinkerq.worker.sampling.torch_engine import TorchEngine

        engine = TorchEngine()
    results: list[list[types.SampledSequence] | None] = [None] * len(jobs)
    errors: list[BaseException | None] = [None] * len(jobs)
    answered = threading.Condition()
    left = [len(jobs)]

    def collect(i: int, inner: OnDone) -> OnDone:
        def on_done(sequences: list[types.SampledSequence] | None, error: BaseException | None) -> None:
            results[i], errors[i] = sequences, error
            try:
                inner(sequences, error)
            finally:
                with answered:
                    left[0] -= 1
                    answered.notify_all()
        return on_done

    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        for i, job in enumerate(jobs):
            engine.submit(dataclasses.replace(job, on_done=collect(i, job.on_done)))
        while left[0]:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"sampling did not finish within {timeout} s")
            if not engine.step():  # nothing to do here: another thread's step holds the last rows
                with answered:
                    answered.wait_for(lambda: not left[0], timeout=0.01)
    finally:
        if owned:
            engine.close()
    for error in errors:
        if error is not None:
            raise error
    return results  # type: ignore[return-value]

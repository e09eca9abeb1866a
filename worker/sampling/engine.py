"""The sampling engine interface: what the worker hands a backend (torch today, e.g. vLLM later).

A backend takes ``SampleJob``s from any thread, runs them on its own thread (batched however it likes), and
reports each job exactly once through ``job.on_done``. It must report, for every sampled token, log p(token)
at temperature 1 under the job's weights: the number ``forward`` computes for that token; and, for a job with
``on_prompt_logprobs``, the same number for every prompt token after the first.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from tinkerq import types
from tinkerq.worker.sampling.rules import StopRule

if TYPE_CHECKING:  # a backend need not import transformers
    from transformers import PreTrainedModel

OnDone = Callable[[list[types.SampledSequence] | None, BaseException | None], None]
# (P,) float32: NaN at 0, then log p(prompt[i] | prompt[:i]) at temperature 1 under the job's weights.
OnPromptLogprobs = Callable[[np.ndarray], None]


def _ignore(sequences: list[types.SampledSequence] | None, error: BaseException | None) -> None:
    pass


class EngineClosed(RuntimeError):
    """The engine was closed (or its thread died) before the job finished."""


@dataclass
class SampleJob:
    model: PreTrainedModel  # the weights to sample from (a frozen snapshot or the base model)
    model_key: Hashable  # jobs with the same key share forward passes (same weights)
    prompt: list[int]
    num_samples: int
    params: types.SamplingParams  # seed, temperature, top_k, top_p are read here; stop is in ``stop``
    stop: StopRule
    max_tokens: int  # already resolved (never None); prompt + max_tokens <= the model's max length
    # Called exactly once, from the engine thread, with the num_samples sequences (in sample order) or an error.
    on_done: OnDone = _ignore
    # A LoRA snapshot's adapter over ``model`` (the shared base; worker/lora/routing.py), or None. Jobs of
    # different adapters over one base share its forward passes, each row routed to its own adapter.
    adapter: Any = None
    # Asks for the prompt's logprobs (Tinker's include_prompt_logprobs): called once, from the engine thread,
    # just before a successful on_done (never when the job fails). None: not asked, nothing computed.
    on_prompt_logprobs: OnPromptLogprobs | None = None


class SamplingEngine(Protocol):
    def submit(self, job: SampleJob) -> None:
        """Thread-safe; returns at once (raises EngineClosed after close)."""

    def load(self) -> int:
        """Rows waiting + running (for load reporting)."""

    def close(self) -> None:
        """Stop the engine thread; jobs not done get on_done(None, EngineClosed)."""


def run_jobs(engine: SamplingEngine | None, jobs: list[SampleJob],
             timeout: float | None = None) -> list[list[types.SampledSequence]]:
    """Submit ``jobs`` together, wait for all, return their sequences in job order (raises the first error).

    ``engine=None`` runs them on a private TorchEngine, closed afterwards. Each job's own on_done still runs.
    """
    owned = engine is None
    if engine is None:
        from tinkerq.worker.sampling.torch_engine import TorchEngine

        engine = TorchEngine()
    results: list[list[types.SampledSequence] | None] = [None] * len(jobs)
    errors: list[BaseException | None] = [None] * len(jobs)
    left = threading.Semaphore(0)

    def collect(i: int, inner: OnDone) -> OnDone:
        def on_done(sequences: list[types.SampledSequence] | None, error: BaseException | None) -> None:
            results[i], errors[i] = sequences, error
            try:
                inner(sequences, error)
            finally:
                left.release()
        return on_done

    try:
        for i, job in enumerate(jobs):
            engine.submit(dataclasses.replace(job, on_done=collect(i, job.on_done)))
        for _ in jobs:
            if not left.acquire(timeout=timeout):
                raise TimeoutError(f"sampling did not finish within {timeout} s")
    finally:
        if owned:
            engine.close()
    for error in errors:
        if error is not None:
            raise error
    return results  # type: ignore[return-value]

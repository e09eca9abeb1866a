"""Sampling from causal LMs: the rules (``rules``), the engine interface (``engine``), and the continuous-
batching torch engine (``torch_engine``, stepped by its owner's thread; its rows per cache layer: ``cache_rows``;
its forwards: ``forwards``). ``sample`` is the one-request call older callers use."""

from __future__ import annotations

from transformers import PreTrainedModel

from tinkerq import types
from tinkerq.worker.sampling.engine import EngineClosed, SampleJob, SamplingEngine, run_jobs
from tinkerq.worker.sampling.rules import StopRule, filter_logits
from tinkerq.worker.sampling.torch_engine import TorchEngine

__all__ = ["EngineClosed", "SampleJob", "SamplingEngine", "StopRule", "TorchEngine", "filter_logits", "run_jobs",
           "sample"]


def sample(model: PreTrainedModel, prompt: list[int], num_samples: int, params: types.SamplingParams,
           stop: StopRule, max_tokens: int) -> list[types.SampledSequence]:
    """Sample one request on a private engine (no batching with other requests), waiting for the result."""
    job = SampleJob(model=model, model_key=id(model), prompt=list(prompt), num_samples=num_samples, params=params,
                    stop=stop, max_tokens=max_tokens)
    return run_jobs(None, [job])[0]

"""SamplingClient: samples from a frozen snapshot of a training session's weights."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from producer.futures import APIFuture
from tinkerq import types
from tinkerq.errors import TinkerqError
from tinkerq.validation import validate_sampling
from tinkerq.wire import messages

if TYPE_CHECKING:
    from producer.client import TrainingClient


class SamplingClient:
    """Made by ``TrainingClient.save_weights_and_get_sampling_client()``.

    Sample requests travel in the training client's request stream, so they run on the worker that holds
    the session, after everything submitted before them; they always use the weights of the snapshot.
    """

    def __init__(self, training_client: TrainingClient, sampler_id: str) -> None:
        self.training_client = training_client
        self.sampler_id = sampler_id

    def sample(self, prompt: types.ModelInput, num_samples: int = 1,
               sampling_params: types.SamplingParams | None = None) -> APIFuture[types.SampleResponse]:
        """``num_samples`` completions of ``prompt``: tokens, per-token logprobs and why each stopped."""
        params = sampling_params or types.SamplingParams()
        tc = self.training_client
        try:
            validate_sampling(prompt, num_samples, params, vocab_size=tc.info.vocab_size,
                              max_seq_len=tc.info.max_seq_len)
        except TinkerqError as exc:
            return APIFuture.failed(exc)
        return tc._submit(
            "sample", messages.encode_sample_request(self.sampler_id, prompt, num_samples, params),
            messages.decode_sample_response,
            argsrepr=f"prompt_tokens={prompt.length} num_samples={num_samples} max_tokens={params.max_tokens}",
        )

    async def sample_async(self, *args: Any, **kwargs: Any) -> APIFuture[types.SampleResponse]:
        return self.sample(*args, **kwargs)

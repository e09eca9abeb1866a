"""The loss head: per-token target logprobs from final hidden states and the output embedding.

Layers, each in its own module (kernel / autograd Function / selection):

* :mod:`.reference`: the plain full-logits computation, kept as the numerical reference;
* :mod:`.chunked`: a custom autograd Function that walks the tokens chunk by chunk and recomputes each
  chunk's logits in backward, so peak memory does not grow with tokens x vocab;
* :mod:`.apex`: the same chunking with NVIDIA apex's fused softmax cross-entropy kernel per chunk (CUDA);
* :mod:`.backends`: choosing one (``auto`` = apex when importable on CUDA, else torch) by name.
"""

from tinkerq.worker.loss_head.backends import BACKENDS, resolve_backend, target_logprobs_from_hidden

__all__ = ["BACKENDS", "resolve_backend", "target_logprobs_from_hidden"]

"""The tinkerq producer library: the Tinker training API over a Redis-backed worker fleet.

Depends only on the core (``tinkerq``); never imports torch.
"""

from producer.client import ServiceClient, TrainingClient, wait_all
from producer.futures import APIFuture
from producer.sampling import SamplingClient

__all__ = ["APIFuture", "SamplingClient", "ServiceClient", "TrainingClient", "wait_all"]

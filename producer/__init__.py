"""The tinkerq producer library: the Tinker training API over a Redis-backed worker fleet.

Its API is the official SDK's (``tinker==0.38``): ``from producer import ServiceClient`` stands in for
``tinker.ServiceClient``; tests/test_sdk_surface.py lists the differences and why. Depends only on the core
(``tinkerq``); never imports torch (``forward_backward_custom`` does, when called).
"""

from producer.client import GetInfoResponse, ServiceClient, TrainingClient, TrainingClientFuture, wait_all
from producer.futures import APIFuture, ClientFuture
from producer.sampling import SamplingClient, SamplingClientFuture

__all__ = [
    "APIFuture", "ClientFuture", "GetInfoResponse", "SamplingClient", "SamplingClientFuture", "ServiceClient",
    "TrainingClient", "TrainingClientFuture", "wait_all",
]

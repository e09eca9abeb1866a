"""The tinkerq producer library: the Tinker training API over a Redis-backed worker fleet.

Its API is the official SDK's (``tinker==0.38``): ``from tinkerq.producer import ServiceClient`` stands in for
``tinker.ServiceClient``; tests/test_sdk_surface.py lists the differences and why. Depends only on the core
(``tinkerq``); never imports torch (``forward_backward_custom`` does, when called).
"""

from tinkerq.producer.futures import APIFuture, ClientFuture, wait_all
from tinkerq.producer.model_info import GetInfoResponse
from tinkerq.producer.sampling import SamplingClient, SamplingClientFuture
from tinkerq.producer.service_client import ServiceClient, TrainingClientFuture
from tinkerq.producer.training_client import TrainingClient

__all__ = [
    "APIFuture", "ClientFuture", "GetInfoResponse", "SamplingClient", "SamplingClientFuture", "ServiceClient",
    "TrainingClient", "TrainingClientFuture", "wait_all",
]

# Installed as tinkerq.producer (pyproject.toml's package-dir). `import producer` from a checkout's root would find
# this folder under a name another distribution may own, as a second copy: say which name to use instead.
if __name__ != "tinkerq.producer":
    raise ImportError(f"tinkerq's producer package is tinkerq.producer: import it by that name, not as {__name__!r}")

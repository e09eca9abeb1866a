"""The producer's client classes, by the import path they have always had: ``ServiceClient``
(producer/service_client.py) and ``TrainingClient`` (producer/training_client.py), with what their calls return."""

from tinkerq.producer.futures import wait_all
from tinkerq.producer.model_info import GetInfoResponse
from tinkerq.producer.service_client import ServiceClient, TrainingClientFuture
from tinkerq.producer.training_client import TrainingClient

__all__ = ["GetInfoResponse", "ServiceClient", "TrainingClient", "TrainingClientFuture", "wait_all"]

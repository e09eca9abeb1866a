"""The embedded fleet (worker/core/embedded.py): a whole fleet in one process, as `tinkerq sft` runs it without a
broker. Here: it answers through the producer library, and once it is closed nothing keeps its service (and so
its model) alive, however many fleets a process (a notebook, a test run) opens one after another."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
from celery import _state as celery_state

from tinkerq import types
from tinkerq.settings import Settings

pytestmark = pytest.mark.timeout(120)


def test_a_closed_embedded_fleet_leaves_nothing_holding_its_model(model_dir: Path):
    from tinkerq.producer import ServiceClient
    from tinkerq.worker.core.embedded import EmbeddedFleet

    default_before = celery_state.default_app
    services = []
    for _ in range(2):  # the second fleet in the process must release its model as the first does
        with EmbeddedFleet(str(model_dir), Settings(device="cpu")) as fleet, \
                ServiceClient(settings=fleet.settings) as sc:
            tc = sc.create_lora_training_client(base_model=fleet.base_model, rank=4)
            datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
                                loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0, 1.0, 1.0, 1.0]})
            out = tc.forward([datum], "cross_entropy").result(timeout=60)
            assert out.metrics["loss:sum"] > 0
            services.append(weakref.ref(fleet.worker.service))
            assert celery_state.default_app is fleet.worker.connection.app  # start_worker made it the default
        del fleet, sc, tc, out
        for _ in range(5):  # a cycle with finalizers can take a second pass
            if not gc.collect():
                break
        assert [ref() for ref in services] == [None] * len(services), "a closed fleet's service is still alive"
        assert celery_state.default_app is default_before

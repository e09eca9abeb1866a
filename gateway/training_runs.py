"""The gateway's training runs: each an SDK model id driving one worker session through the producer's
:class:`~tinkerq.producer.TrainingClient`, with its record in Redis (any gateway drives any run) and the clients
of the runs served lately kept at hand (LRU). Counting runs against the key's max_training_clients, and closing the
runs whose SDK went silent, are here too."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from tinkerq import types
from tinkerq.errors import TinkerqError
from tinkerq.gateway import lifecycle
from tinkerq.gateway.http_errors import not_found
from tinkerq.gateway.records import Records
from tinkerq.producer import ServiceClient, TrainingClient
from tinkerq.quotas import Quotas
from tinkerq.settings import Settings
from tinkerq.wire import messages

log = logging.getLogger("tinkerq.gateway")

CACHED_CLIENTS = 1024  # runs and sampling sessions whose producer clients a gateway keeps at hand (LRU)

T = TypeVar("T")


class ClientCache(Generic[T]):
    """The producer clients (of runs, of sampling sessions) a gateway served lately, by id: at most CACHED_CLIENTS,
    the least recently stored go first. A miss is rebuilt from the records (any gateway can)."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, T] = OrderedDict()

    def get(self, key: str) -> T | None:
        return self._items.get(key)

    def put(self, key: str, value: T) -> T:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > CACHED_CLIENTS:
            self._items.popitem(last=False)
        return value

    def pop(self, key: str) -> None:
        self._items.pop(key, None)


@dataclass
class Run:
    """A training run: its record, and the producer's client for its worker session."""

    model_id: str  # the SDK's: the training run's id, <session>:train:<n> (the worker session's is client.model_id)
    record: dict[str, Any]
    client: TrainingClient
    offset: int  # worker sequence number = SDK seq_id + offset


class TrainingRuns:
    def __init__(self, service: ServiceClient, records: Records, quotas: Quotas, settings: Settings) -> None:
        self.service = service
        self.records = records
        self.quotas = quotas
        self.settings = settings
        self._runs: ClientCache[Run] = ClientCache()

    def admit(self, tenant: str, model_id: str) -> bool:
        """Count the new run against the key's max_training_clients; at the cap, first close the key's runs whose
        SDK stopped heartbeating (a process that exited without unloading) and try again."""
        if self.quotas.try_open_training_client(tenant, model_id):
            return True
        stale = self.stale(tenant)
        for record in stale:
            log.warning("closing training run %s of %s: its session has not sent a heartbeat for over %g s",
                        record["model_id"], tenant, self.settings.gateway_session_stale_s)
            lifecycle.close_run(self.service, self.records, self.quotas, record)
        return bool(stale) and self.quotas.try_open_training_client(tenant, model_id)

    def stale(self, tenant: str) -> list[dict[str, Any]]:
        """The key's counted runs whose session is gone, finished, or silent for TINKERQ_GATEWAY_SESSION_STALE_S."""
        stale = []
        for model_id in self.quotas.training_clients(tenant):
            record = self.records.get("run", model_id, tenant)
            if record is None:
                continue  # being created now
            session = self.records.get("session", record["session_id"], tenant)
            last = None if session is None else session.get("heartbeat_at", session.get("created"))
            if session is None or last is None or time.time() - float(last) > self.settings.gateway_session_stale_s \
                    or session.get("finished"):
                stale.append(record)
        return stale

    def release(self, tenant: str, model_id: str) -> None:
        self.quotas.close_training_client(tenant, model_id)

    def add(self, tenant: str, model_id: str, job: dict[str, Any], lora: types.LoraConfig | None,
            client: TrainingClient) -> Run:
        offset = 0 if job.get("load") is None else 1
        record = {
            "tenant": tenant, "model_id": model_id, "session_id": job["session_id"], "base_model": job["base_model"],
            "lora": None if lora is None else messages.encode_lora(lora), "created": time.time(),
            "optimizer": job.get("optimizer"),  # its optimizer's config (None: AdamW)
            "user_metadata": job.get("user_metadata"),
            # What any gateway needs to drive the same worker session (see get()).
            "info": dataclasses.asdict(client.info), "offset": offset, "closed": False,
        }
        self.records.put("run", model_id, record)
        return self._runs.put(model_id, Run(model_id, record, client, offset))

    def get(self, tenant: str, model_id: Any, *, closed_ok: bool = False) -> Run | None:
        """The run, driven from its record (made here or by another gateway: the worker session is the same)."""
        run = self._runs.get(str(model_id))
        if run is None:
            record = self.records.get("run", str(model_id), tenant)
            if record is not None and not record.get("closed") and isinstance(record.get("info"), dict):
                client = self.service.attach_training_client(types.ModelInfo(**record["info"]))
                run = self._runs.put(str(model_id), Run(str(model_id), record, client, int(record["offset"])))
        if run is None or run.record["tenant"] != tenant:
            if closed_ok:
                return None
            raise not_found("model", model_id)
        return run

    def close(self, run: Run) -> None:
        """Close the run's worker session after every request taken for it (on any gateway), and forget it."""
        self._runs.pop(run.model_id)
        lifecycle.close_run(self.service, self.records, self.quotas, run.record, run.client)

    @staticmethod
    def close_quietly(client: TrainingClient) -> None:
        try:
            client.close()
        except TinkerqError as exc:  # the worker may be gone already: nothing left to free
            log.info("closing %s: %s", client.model_id, exc.message)

    def info(self, tenant: str, model_id: str) -> dict[str, Any]:
        run = self.get(tenant, model_id)
        assert run is not None
        lora = run.record["lora"]
        base_model = run.record["base_model"]
        return {
            "model_id": model_id, "type": "get_info", "is_lora": lora is not None,
            "lora_rank": None if lora is None else lora["rank"], "model_name": base_model,
            "model_data": {"model_name": base_model, "tokenizer_id": base_model, "arch": run.client.info.extra.get(
                "arch", "transformers")},
            "optimizer_config": run.record.get("optimizer") or {"type": "adamw"},
        }

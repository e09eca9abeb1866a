"""The weights sample requests name, as one worker holds them.

A sample request names its weights by *source* (tinkerq.wire.messages.check_source):

* ``{"snapshot": id}`` — a frozen copy made by ``save_weights_and_get_sampling_client()`` on the worker that
  holds the training session. That worker announces it at once (``tinkerq:snapshot:<id>``: its base model
  and owner, with a TTL) and *publishes* its weights the first time another worker asks for them (through
  the owner's ``tinkerq:publish:<worker>`` list, read by a thread of its own), so a run whose samples all
  stay on one worker never serialises a snapshot: in Redis when it is at most ``snapshot_inline_max_bytes``,
  otherwise as ``<checkpoint_dir>/snapshots/<id>.safetensors`` (the checkpoint directory is then shared).
  Each training session keeps its ``max_samplers`` newest snapshots (held by their owner, announced); older
  ones are withdrawn.
* ``{"path": dir}`` — a ``save_weights_for_sampler`` directory below the checkpoint directory.
* ``{"base": True}`` — the weights the worker was started with.

A LoRA session's snapshot is its adapter, frozen (:class:`worker.lora.adapter.FrozenAdapter`): it is sampled
over this worker's base model (its rows share the base's forward passes with every other adapter's and the
base's own), published as its A/B tensors only, and a ``save_weights_for_sampler`` directory of a LoRA
session is a PEFT adapter, loaded the same way.

Loaded weights stay in an LRU of ``sampler_cache_size`` entries (the base model is always there); a load
that would not fit in memory first evicts the least recently used. Everything is safetensors: loading a
snapshot never unpickles, and no name from a message becomes a path (snapshot ids are 32 hex digits).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from transformers import PreTrainedModel

from tinkerq import keys
from tinkerq.errors import CapacityError, UnknownModelError, ValidationError, WorkerError
from tinkerq.settings import Settings
from tinkerq.store import KeyValueStore
from tinkerq.wire import codec, messages
from tinkerq.worker import checkpoints, memory
from tinkerq.worker.loading.models import load_causal_lm
from tinkerq.worker.lora import routing
from tinkerq.worker.lora.adapter import FrozenAdapter

log = logging.getLogger("tinkerq.worker")

Weights = PreTrainedModel | FrozenAdapter  # what a snapshot holds
SNAPSHOT_DIR = "snapshots"
BASE_KEY: Hashable = ("base",)
PUBLISH_WAIT_S = 60.0  # how long a worker waits for a snapshot's owner to publish it


class Snapshots:
    def __init__(self, store: KeyValueStore, settings: Settings, base_model: str, base: PreTrainedModel,
                 sessions: Any = lambda: [], worker_id: str = "", sampling_base: Any = None,
                 serialise: Callable[[Callable[[], None]], Any] | None = None,
                 blank: Callable[[], PreTrainedModel] | None = None) -> None:
        self.store = store
        self.worker_id = worker_id
        self.settings = settings
        self.base_model = base_model
        self.base = base
        # What the base and LoRA snapshots are sampled on: the base itself, or a shard group's sharded base
        # (worker/sharding/sampling.py; made on first use). Full snapshots are whole copies of ``base``.
        self.sampling_base: Any = sampling_base or (lambda: base)
        # A whole model to load a full snapshot's weights into: a copy of the base; on a shard group's rank 0, which
        # holds only the base's skeleton, the skeleton with storage (ShardHost.blank_model).
        self._blank = blank or (lambda: copy.deepcopy(base))
        self.sessions = sessions  # open training sessions (their promised AdamW memory counts against loads)
        # Where a published snapshot is serialised: here (the publisher thread), or, on a shard group, as control
        # work of the compute loop (WorkerService.run_control), so it never runs beside the group's collectives.
        self._serialise = serialise or (lambda fn: fn())
        self._models: OrderedDict[Hashable, Weights] = OrderedDict()
        self._published: dict[str, deque[str]] = {}  # training session -> its announced snapshot ids
        self._own: dict[str, Weights] = {}  # snapshots made here, held while announced
        self._lock = threading.Lock()

    # -- made here ------------------------------------------------------------------------------------------

    def add(self, model: Weights, session_id: str, snapshot_id: str | None = None) -> str:
        """Keep a snapshot made by a training session on this worker (a model, or a LoRA adapter) and announce
        it; returns its id. ``snapshot_id``: the id a lost worker gave it (an adopter re-making it, so the
        sampling clients holding that id keep working)."""
        snapshot_id = snapshot_id or os.urandom(16).hex()
        if isinstance(model, FrozenAdapter):
            routing.install(self.base)  # its rows are routed over the base (inert hooks for everything else)
        else:
            model.eval()
        with self._lock:  # held here while announced, outside the LRU of loaded weights
            self._own[snapshot_id] = model
        record = {"base_model": self.base_model, "owner": self.worker_id}
        self.store.set(keys.snapshot(snapshot_id), codec.packb(record), ttl_s=self.settings.snapshot_ttl_s)
        published = self._published.setdefault(session_id, deque())
        published.append(snapshot_id)
        while len(published) > self.settings.max_samplers:
            self._withdraw(published.popleft())
        return snapshot_id

    def release_session(self, session_id: str) -> None:
        """A training session released idle (worker/recovery/idle_release.py): its snapshots stay announced, their
        weights
        published (Redis or the checkpoint directory, as for an automatic snapshot) and no longer held here, so a
        sample naming one loads it like another worker's. One that cannot be published stays held."""
        for snapshot_id in list(self._published.get(session_id, ())):
            try:
                self.publish(snapshot_id)
            except Exception as exc:  # (OSError, Redis) sampling from it must keep working: it stays held
                log.warning("could not publish snapshot %s of released session %s: %s", snapshot_id, session_id, exc)
                continue
            with self._lock:
                self._own.pop(snapshot_id, None)

    def forget_session(self, session_id: str) -> None:
        """A closed session's snapshots stay published until their TTL (sampling clients may outlive it)."""
        self._published.pop(session_id, None)

    # -- named by a request -------------------------------------------------------------------------------------

    def resolve(self, source: dict[str, Any]) -> tuple[Hashable, PreTrainedModel, FrozenAdapter | None]:
        """(the engine's key for the model, the model, the LoRA adapter or None) for a request's source, loading
        it if this worker does not hold it. Every adapter's key is the base's: they share its passes."""
        key, weights = self._resolve(source)
        if isinstance(weights, FrozenAdapter):
            return BASE_KEY, self.sampling_base(), weights
        if key == BASE_KEY:
            return BASE_KEY, self.sampling_base(), None
        return key, weights, None

    def _resolve(self, source: dict[str, Any]) -> tuple[Hashable, Weights]:
        """(cache key, weights) for a request's source, loading them if this worker does not hold them."""
        source = messages.check_source(source)
        if "base" in source:
            return BASE_KEY, self.base
        if "snapshot" in source:
            key: Hashable = ("snapshot", source["snapshot"])
            loader = lambda: self._load_published(source["snapshot"])  # noqa: E731
        else:
            directory = checkpoints.resolve_weights_path(source["path"], self.settings.checkpoint_dir)
            weights = [directory / f for f in os.listdir(directory) if f.endswith(".safetensors")]
            # The same path saved again (same name) is other weights: the files' times are part of the key.
            key = ("path", str(directory), tuple(sorted(os.stat(w).st_mtime_ns for w in weights)))
            loader = lambda: self._load_directory(directory)  # noqa: E731
        with self._lock:
            model = self._models.get(key)
            if model is None and "snapshot" in source:
                model = self._own.get(source["snapshot"])
            elif model is not None:
                self._models.move_to_end(key)
        if model is None:
            model = loader()
            self._remember(key, model)
        return key, model

    # -- publishing ------------------------------------------------------------------------------------------

    def publish(self, snapshot_id: str) -> None:
        """Write the weights of a snapshot made here where other workers can load them (asked for by one)."""
        with self._lock:
            model = self._own.get(snapshot_id)
        raw = self.store.get(keys.snapshot(snapshot_id))
        if model is None or raw is None:
            return  # withdrawn meanwhile: the asking worker reports it as unavailable
        record = codec.unpackb(raw)
        if isinstance(record, dict) and ("weights" in record or "file" in record):
            return  # another worker asked first
        self._serialise(lambda: self._publish(snapshot_id, model))
        log.info("published snapshot %s for other workers", snapshot_id)

    def publish_session(self, session_id: str) -> None:
        """Publish every snapshot of a training session that is still announced (with its automatic snapshot:
        they must outlive this worker, docs/reliability.md)."""
        for snapshot_id in list(self._published.get(session_id, ())):
            self.publish(snapshot_id)

    def _publish(self, snapshot_id: str, model: Weights) -> None:
        record: dict[str, Any] = {"base_model": self.base_model, "owner": self.worker_id}
        if isinstance(model, FrozenAdapter):
            weights = save_safetensors(model.tensors())
            record["lora_scaling"] = model.scaling
        else:
            weights = save_safetensors(_distinct_tensors(model))
        if len(weights) <= self.settings.snapshot_inline_max_bytes:
            record["weights"] = weights
        else:
            path = checkpoints.path_below(self.settings.checkpoint_dir, SNAPSHOT_DIR, f"{snapshot_id}.safetensors",
                                          create_parents=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(weights)
            os.replace(tmp, path)
            record["file"] = path.name
        self.store.set(keys.snapshot(snapshot_id), codec.packb(record), ttl_s=self.settings.snapshot_ttl_s)

    def _withdraw(self, snapshot_id: str) -> None:
        with self._lock:
            self._models.pop(("snapshot", snapshot_id), None)
            self._own.pop(snapshot_id, None)
        self.store.delete(keys.snapshot(snapshot_id))
        path = checkpoints.path_below(self.settings.checkpoint_dir, SNAPSHOT_DIR, f"{snapshot_id}.safetensors")
        if path.is_file():
            path.unlink()

    def _load_published(self, snapshot_id: str) -> Weights:
        record = self._published_record(snapshot_id)
        if isinstance(record.get("weights"), bytes):
            weights = record["weights"]
        else:
            path = checkpoints.path_below(self.settings.checkpoint_dir, SNAPSHOT_DIR, f"{snapshot_id}.safetensors")
            try:
                weights = path.read_bytes()
            except OSError as exc:
                raise ValidationError(f"snapshot {snapshot_id} was written to {path}, which this worker cannot "
                                      f"read ({exc}); workers of one model must share TINKERQ_CHECKPOINT_DIR") from None
        if isinstance(record.get("lora_scaling"), float):
            self._make_room(adapter_bytes=len(weights))  # its tensors: the file's size, give or take the header
            routing.install(self.base)
            adapter = FrozenAdapter.from_tensors(load_safetensors(weights), record["lora_scaling"], self._device())
            log.info("loaded published snapshot %s (a LoRA adapter, %.1f MB)", snapshot_id, len(weights) / 1e6)
            return adapter
        self._make_room()
        model = self._blank()
        _load_weights(model, load_safetensors(weights))
        log.info("loaded published snapshot %s (%.1f MB)", snapshot_id, len(weights) / 1e6)
        return model

    def _published_record(self, snapshot_id: str) -> dict[str, Any]:
        """The snapshot's record once its weights are published: asks its owner to publish them if needed."""
        deadline, asked = time.monotonic() + PUBLISH_WAIT_S, False
        while True:
            record = self._record(snapshot_id)
            if "weights" in record or "file" in record:
                return record
            owner = record.get("owner")
            if not isinstance(owner, str) or not owner:
                raise ValidationError(f"snapshot {snapshot_id} has no weights and no owner to ask for them")
            if not asked:
                self.store.push(keys.publish_queue(owner), messages.make_publish_item(snapshot_id))
                asked = True
            if time.monotonic() > deadline:
                raise WorkerError(f"worker {owner}, which made snapshot {snapshot_id}, did not publish it within "
                                  f"{PUBLISH_WAIT_S:g} s (it may be gone or busy); try again, or make a new "
                                  f"snapshot with save_weights_and_get_sampling_client()")
            time.sleep(0.05)

    def _record(self, snapshot_id: str) -> dict[str, Any]:
        raw = self.store.get(keys.snapshot(snapshot_id))
        if raw is None:
            raise ValidationError(
                f"sampling snapshot {snapshot_id} is not available: it was withdrawn (each training client keeps "
                f"its {self.settings.max_samplers} newest, TINKERQ_MAX_SAMPLERS) or expired "
                f"(TINKERQ_SNAPSHOT_TTL_S); call save_weights_and_get_sampling_client() again")
        record = codec.unpackb(raw)
        if not isinstance(record, dict) or record.get("base_model") != self.base_model:
            theirs = record.get("base_model") if isinstance(record, dict) else None
            raise UnknownModelError(f"snapshot {snapshot_id} is of {theirs!r}; this worker serves {self.base_model!r}")
        return record

    def _device(self) -> torch.device:
        """Where adapters live: beside the base they are sampled on."""
        return next(self.sampling_base().parameters()).device

    def _load_directory(self, directory: Any) -> Weights:
        marker = directory / checkpoints.WEIGHTS_FILE
        if marker.is_file():
            try:
                saved_from = json.loads(marker.read_text()).get("base_model")
            except (OSError, ValueError, AttributeError) as exc:
                raise ValidationError(f"{marker} is unreadable ({exc}): pass a path returned by "
                                      f"save_weights_for_sampler()") from None
            if saved_from != self.base_model:
                raise UnknownModelError(f"{directory} holds weights of {saved_from!r}; this worker serves "
                                        f"{self.base_model!r}: pass base_model={saved_from!r}")
        if (directory / checkpoints.ADAPTER_FILE).is_file():  # a LoRA session's PEFT adapter
            self._make_room(adapter_bytes=(directory / checkpoints.ADAPTER_FILE).stat().st_size)
            routing.install(self.base)
            return FrozenAdapter.from_peft_directory(directory, self._device())
        self._make_room()
        model = load_causal_lm(str(directory), device=self.settings.device, dtype=self.settings.dtype)
        model.requires_grad_(False)
        return model

    # -- the cache --------------------------------------------------------------------------------------------

    def _remember(self, key: Hashable, model: Weights) -> None:
        with self._lock:
            self._models[key] = model
            self._models.move_to_end(key)
            while len(self._models) > self.settings.sampler_cache_size:
                self._models.popitem(last=False)

    def _make_room(self, adapter_bytes: int | None = None) -> None:
        """Evict least recently used snapshots until one more copy of the weights (or a LoRA adapter of
        ``adapter_bytes``) fits in memory."""
        while True:
            try:
                if adapter_bytes is None:
                    memory.admit_snapshot(self.base, self.settings, self.sessions())
                else:
                    memory.admit_lora_snapshot(adapter_bytes, self.settings)
                return
            except CapacityError:
                with self._lock:
                    if not self._models:
                        raise
                    evicted, _ = self._models.popitem(last=False)
                log.warning("evicted sampling weights %s to make room", evicted)
                memory.release_memory()

    def __len__(self) -> int:
        return len(self._models)


def _distinct_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each tensor once (tied embeddings share storage; safetensors refuses duplicates)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        out[name] = tensor.detach().contiguous().cpu()
    return out


def _load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    missing, unexpected = model.load_state_dict(weights, strict=False)
    state = model.state_dict()
    loaded = {state[n].data_ptr() for n in weights if n in state}
    tied = {n for n, t in state.items() if n not in weights and t.data_ptr() in loaded}  # set through their twin
    if unexpected or set(missing) - tied:
        raise ValidationError(f"published snapshot does not fit this model: missing {sorted(set(missing) - tied)[:5]}, "
                              f"unexpected {sorted(unexpected)[:5]}")
    model.requires_grad_(False)
    model.eval()

"""The training sessions a worker holds: how each kind is made, admitted, counted and closed.

The one place that knows session kinds (full-parameter on this process, full-parameter on a shard group,
LoRA over the shared frozen base, on this process or sharded once over a shard group); everything else sees
the :class:`worker.session.Session` protocol.
"""

from __future__ import annotations

import copy
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedModel

from tinkerq import optimizers, types
from tinkerq.errors import CapacityError, ValidationError
from tinkerq.settings import Settings
from tinkerq.validation import validate_lora
from tinkerq.worker import memory
from tinkerq.worker.loading import support
from tinkerq.worker.loading.quantized_base import refuse_full_session
from tinkerq.worker.lora.adapter import find_targets
from tinkerq.worker.lora.session import LoraBase, LoraSession, config_dict
from tinkerq.worker.sharding.host import LeaderSession, ShardHost
from tinkerq.worker.training.logprobs import LogprobComputer
from tinkerq.worker.training.session import Session, TrainingSession

log = logging.getLogger("tinkerq.worker")


class RoomComing(Exception):
    """The session chosen to make room for a new one is being released: its snapshot and parked record are on
    their way through the outbox (worker/recovery/idle_release.py, ``make_room``). Nothing was made; the new session
    waits (a deferred creation, or an adopter's thread) and is made once the old one is out. Never reaches a
    caller."""

    def __init__(self, model_id: str) -> None:
        super().__init__(f"session {model_id} is being released to make room")
        self.model_id = model_id


@dataclass
class Slot:
    """A session and its recovery state (worker/recovery/); its requests and order are the scheduler's."""

    session: Session
    steps_since_snapshot: int = 0  # optimizer steps since the latest automatic snapshot
    journal_len: int = 0  # entries in the session's journal (requests applied since that snapshot)
    snapshot_due: bool = False  # auto_snapshot_steps reached: snapshot once the current request is journaled
    snapshot_at: float | None = None  # wall time of the latest automatic snapshot (None before the first)
    snapshot_seq: int | None = None  # the last request that snapshot holds (None: none taken or loaded here)
    adopted_from: str | None = None  # the lost worker this session was adopted from
    # The entries the journal will hold once the outbox has written what the compute loop handed it, an automatic
    # snapshot's cut included: what journal_max_entries is checked against, the same whatever the outbox's delay.
    journal_planned: int = 0
    snapshot_staged: bool = False  # an automatic snapshot is written and on the outbox's way to its place


class SessionFactory:
    def __init__(self, settings: Settings, model: PreTrainedModel, model_dir: str, logprobs: LogprobComputer,
                 base_model: str, worker_id: str, shards: ShardHost | None,
                 evictable: Callable[[dict[str, float], float, float], str | None]) -> None:
        self.settings = settings
        self.model = model
        self.model_dir = model_dir
        self.logprobs = logprobs
        self.base_model = base_model
        self.worker_id = worker_id
        self.shards = shards
        self.evictable = evictable  # the scheduler's choice of a session to make room (Scheduler.evictable)
        self.lora_base: LoraBase | None = None  # made on the first LoRA session (docs/lora.md)

    def make(self, model_id: str, lora: dict[str, Any] | types.LoraConfig | None, slots: dict[str, Slot],
             close: Callable[[str], None], optimizer: Any = None) -> Session:
        """A new session (``lora``: its config, else full-parameter; ``optimizer``: its optimizer config or that
        config's map, None: AdamW), after its kind's count limit (at it, a broken session of the kind is closed, or
        an idle one given to ``close``: the service releases it, parked, when it can come back:
        worker/recovery/idle_release.py) and memory admission."""
        if isinstance(lora, dict):
            lora = types.LoraConfig(**lora)
        config = optimizers.config_of(optimizer)
        support.check(type(self.model).__name__, "full" if lora is None else "lora")  # a path not proven: refused
        self._check_optimizer(config, lora)
        if lora is None:
            # A base kept quantized trains LoRA adapters only (a shard group's: its ranks hold it, refused here too).
            refuse_full_session(self.model, kept=self.shards is not None and self.shards.kept_quantized)
            self._make_room("full", slots, close)
            memory.admit_session(self.model, self.settings, [slot.session for slot in slots.values()])
            if self.shards is not None:
                return LeaderSession(self.shards, model_id)
            # Every weight of the copy trains (the shared model itself is frozen once LoRA sessions use it).
            return TrainingSession(model_id, copy.deepcopy(self.model).requires_grad_(True),
                                   base_dir=self.model_dir, microbatch_tokens=self.settings.microbatch_tokens,
                                   logprobs=self.logprobs, blank_model=lambda: copy.deepcopy(self.model),
                                   optimizer=config)
        validate_lora(lora, max_rank=self.settings.max_lora_rank)
        if lora.seed is None:  # Tinker: no seed, a random one; kept so the session can be told and re-made
            lora = types.LoraConfig(**{**config_dict(lora), "seed": secrets.randbits(63)})
        # A shard group's base is sharded by its first LoRA session, on every rank: counted here on the whole one.
        targets = find_targets(self.model, lora) if self.shards is not None else self.lora().targets(lora)
        self._make_room("lora", slots, close)
        parameters = lora.rank * sum(t.parameters_per_rank() for t in targets)
        # On an expert-parallel group the per-expert factors are split with the experts (worker/sharding/experts.py).
        memory.admit_lora_session(parameters, self.settings, [slot.session for slot in slots.values()], self.model,
                                  sharded_base=self.shards is not None and not self.shards.has_lora_base,
                                  expert_parallel=self.shards is not None and self.shards.expert_parallel,
                                  expert_parameters=lora.rank * sum(t.expert_parameters_per_rank() for t in targets),
                                  base_bytes=self.shards.kept_base_bytes()
                                  if self.shards is not None and not self.shards.has_lora_base else None)
        if self.shards is not None:  # the adapter and its optimizer state on every rank, over the base sharded once
            return self.shards.open_lora(model_id, lora, base_model=self.base_model, optimizer=config)
        return LoraSession(model_id, self.lora(), lora, base_model=self.base_model, optimizer=config)

    def _check_optimizer(self, config: types.OptimizerConfig, lora: types.LoraConfig | None) -> None:
        """Dimuon's matrix sign needs each trained matrix whole on one rank: a shard group's full-parameter sessions
        (FSDP shards) and its adapters' per-expert factors on an expert-parallel group are not, so Dimuon is refused
        there (a user error) rather than computed otherwise. Replicated adapters on a shard group are whole."""
        if not isinstance(config, types.DimuonOptimizerConfig) or self.shards is None:
            return
        if lora is None or self.shards.expert_parallel:
            what = "full-parameter sessions" if lora is None else "LoRA sessions on an expert-parallel group"
            raise ValidationError(
                f"the Dimuon optimizer is not served for {what} on a shard group (worker {self.worker_id}): its "
                f"matrix sign needs each trained matrix whole on one rank, and these are sharded; train with AdamW "
                f"here, or with Dimuon on an unsharded worker" + ("" if lora is None else " or a LoRA session on a "
                                                                  "group without --expert-parallel"))

    def lora(self) -> LoraBase:
        if self.lora_base is None:
            self.lora_base = LoraBase(self.model, self.logprobs, model_dir=self.model_dir,
                                      microbatch_tokens=self.settings.microbatch_tokens)
        return self.lora_base

    def admit_sampler(self, session: Session, slots: dict[str, Slot]) -> None:
        """Refuse a sampler of a class whose sampling is not served (a user error), or (CapacityError) one whose
        weights copy would not fit; a LoRA sampler is its adapter only."""
        support.check(type(self.model).__name__, "sampling")
        if session.kind == "full":
            memory.admit_snapshot(self.model, self.settings, [slot.session for slot in slots.values()])
        else:
            parameters = session.describe()["lora"]["trainable_parameters"]
            memory.admit_lora_snapshot(memory.lora_snapshot_bytes(parameters), self.settings)

    def _make_room(self, kind: str, slots: dict[str, Slot], close: Callable[[str], None]) -> None:
        """Make room for a new session of ``kind`` when that kind is at its count limit: ``close`` a broken or idle
        one (it may raise :class:`RoomComing`: that session is on its way out, and nothing was made; or return
        with it kept, a request having come for it since it was chosen: another is chosen)."""
        limit, setting = ((self.settings.max_lora_sessions, "TINKERQ_MAX_LORA_SESSIONS") if kind == "lora"
                          else (self.settings.max_sessions, "TINKERQ_MAX_SESSIONS"))
        tried: set[str] = set()
        while True:
            same = {mid: s for mid, s in slots.items() if s.session.kind == kind}
            if len(same) < limit:
                return
            chosen = self.evictable({mid: s.session.last_used for mid, s in same.items() if mid not in tried},
                                    time.monotonic(), self.settings.session_idle_ttl_s)
            if chosen is None:
                break
            tried.add(chosen)  # a broken session first, else the longest idle
            close(chosen)
        raise CapacityError(
            f"worker {self.worker_id} already holds {len(same)} {'LoRA' if kind == 'lora' else 'full-parameter'} "
            f"training sessions ({setting}); close unused training clients (tc.close()) or start another worker "
            f"for this model"
        )

"""What recovery and idle release both use of the worker that owns them (worker/core/service.py passes itself).

Each narrows this further in its own protocol (:class:`~tinkerq.worker.recovery.RecoveryHost`,
:class:`~tinkerq.worker.recovery.idle_release.IdleHost`), so each names exactly what it reaches for.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tinkerq.connection import Connection
    from tinkerq.settings import Settings
    from tinkerq.worker.core.metrics import WorkerMetrics
    from tinkerq.worker.core.scheduler import Scheduler
    from tinkerq.worker.sampling.snapshots import Snapshots
    from tinkerq.worker.training.sessions import Slot


class SessionsHost(Protocol):
    """The worker's identity, its sessions under their condition, their scheduler, and the control path."""

    settings: Settings
    connection: Connection
    base_model: str
    worker_id: str
    cond: threading.Condition
    scheduler: Scheduler
    slots: dict[str, Slot]
    snapshots: Snapshots
    metrics: WorkerMetrics

    def close_session(self, model_id: str) -> None: ...
    def run_control(self, fn: Any) -> Any: ...

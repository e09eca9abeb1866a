"""What the gateway's collaborators use of it (:class:`tinkerq.gateway.service.Gateway` passes itself).

Each collaborator names its part as a ``Protocol``, so mypy holds it to that part and a reader sees what it
reaches for: the request-accepting half (:class:`OrderedParts`), the samplers (:class:`SamplerParts`) and the
job runner (:class:`JobParts`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tinkerq.audit import AuditLog
    from tinkerq.gateway.futures import Futures
    from tinkerq.gateway.jobs import Jobs
    from tinkerq.gateway.records import Records
    from tinkerq.gateway.run_metrics import RunMetrics
    from tinkerq.gateway.samplers import Samplers
    from tinkerq.gateway.training_runs import TrainingRuns
    from tinkerq.producer import ServiceClient
    from tinkerq.quotas import Quotas
    from tinkerq.settings import Settings
    from tinkerq.store import RedisStore


class RequestParts(Protocol):
    """Shared by the collaborators that take requests: the records, the futures, quotas, and the checks."""

    settings: Settings
    store: RedisStore
    records: Records
    quotas: Quotas
    futures: Futures
    jobs: Jobs

    def session(self, tenant: str, session_id: Any) -> dict[str, Any]: ...
    def checkpoint(self, tenant: str, path: Any, *, segment: str | None = ...,
                   readable: bool = ...) -> dict[str, Any]: ...
    async def check_served(self, base_model: str) -> None: ...


class OrderedParts(RequestParts, Protocol):
    """What :class:`tinkerq.gateway.ordered_requests.OrderedRequests` uses."""

    runs: TrainingRuns

    def create_once(self, tenant: str, model_id: str, kind: str, job: dict[str, Any]) -> str: ...


class SamplerParts(RequestParts, Protocol):
    """What :class:`tinkerq.gateway.samplers.Samplers` uses."""

    service: ServiceClient


class JobParts(Protocol):
    """What :class:`tinkerq.gateway.jobs.Jobs` uses."""

    settings: Settings
    service: ServiceClient
    records: Records
    runs: TrainingRuns
    futures: Futures
    run_metrics: RunMetrics
    audit: AuditLog
    samplers: Samplers

"""What the gateway remembers in Redis, per tenant: sessions, training runs, sampling sessions, checkpoints.

Kept in Redis (not in the gateway's memory) so that a restarted gateway, or a second one behind the same
load balancer, still knows who owns what: a tenant's ids and ``tinker://`` paths resolve for that tenant
only, and everything else answers as if it did not exist. Each record is a JSON map with its ``tenant``.

Checkpoint paths are Tinker's: ``tinker://<training run>/weights/<name>`` (save_state) and
``tinker://<training run>/sampler_weights/<name>`` (save_weights_for_sampler). A record maps one to the
directory the worker wrote; the directory name never comes from the path itself. A checkpoint saved with
``ttl_seconds`` has a record that expires with it.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

import redis

PREFIX = "tinkerq:gw:"
# Sessions and training runs are kept a week after their last use; checkpoints until their ttl (or forever).
IDLE_TTL_S = 7 * 24 * 3600

SEGMENTS = {"weights": "training", "sampler_weights": "sampler"}  # path segment -> Tinker's checkpoint_type
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_ID_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")


class PathError(ValueError):
    """A string that is not a tinker:// checkpoint path this gateway makes."""


@dataclass(frozen=True)
class TinkerPath:
    run: str  # the training run (model id) that saved it
    segment: str  # "weights" | "sampler_weights"
    name: str

    def __str__(self) -> str:
        return f"tinker://{self.run}/{self.segment}/{self.name}"

    @property
    def checkpoint_type(self) -> str:
        return SEGMENTS[self.segment]

    @property
    def checkpoint_id(self) -> str:
        return f"{self.segment}/{self.name}"

    @classmethod
    def parse(cls, path: Any) -> TinkerPath:
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise PathError(f"{path!r} is not a checkpoint path: expected tinker://<run>/weights/<name> or "
                            f"tinker://<run>/sampler_weights/<name>, as save_state / save_weights_for_sampler give")
        parts = path[len("tinker://"):].split("/")
        if len(parts) != 3 or parts[1] not in SEGMENTS or not _ID_RE.match(parts[0]) or not _NAME_RE.match(parts[2]):
            raise PathError(f"{path!r} is not a checkpoint path: expected tinker://<run>/weights/<name> or "
                            f"tinker://<run>/sampler_weights/<name> (names: 1-128 characters of [A-Za-z0-9_.-])")
        return cls(parts[0], parts[1], parts[2])


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", ".."):
        raise PathError(f"checkpoint name {name!r} must be 1-128 characters of [A-Za-z0-9_.-]")
    return name


class Records:
    """Tenant-owned JSON records in Redis. ``get`` returns None for another tenant's record."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    @staticmethod
    def _key(table: str, ident: str) -> str:
        return f"{PREFIX}{table}:{ident}"

    def put(self, table: str, ident: str, record: dict[str, Any], *, ttl_s: float | None = IDLE_TTL_S) -> None:
        assert "tenant" in record
        raw = json.dumps(record, separators=(",", ":"))
        if ttl_s is None:
            self.client.set(self._key(table, ident), raw)
        else:
            self.client.set(self._key(table, ident), raw, px=max(1, int(ttl_s * 1000)))

    def put_new(self, table: str, ident: str, record: dict[str, Any], *, ttl_s: float = IDLE_TTL_S) -> bool:
        """Store ``record`` unless ``ident`` exists (for anyone): False then."""
        raw = json.dumps(record, separators=(",", ":"))
        return bool(self.client.set(self._key(table, ident), raw, px=int(ttl_s * 1000), nx=True))

    def get(self, table: str, ident: str, tenant: str) -> dict[str, Any] | None:
        raw = self.client.get(self._key(table, ident))
        if raw is None:
            return None
        record = json.loads(raw)
        return record if isinstance(record, dict) and record.get("tenant") == tenant else None

    def delete(self, table: str, ident: str) -> None:
        self.client.delete(self._key(table, ident))

    def scan(self, table: str, tenant: str, prefix: str = "") -> list[dict[str, Any]]:
        """Every record of ``table`` whose id starts with ``prefix`` that ``tenant`` owns."""
        pattern = self._key(table, _glob_escape(prefix) + "*")
        keys = list(self.client.scan_iter(match=pattern, count=500))
        out = []
        for raw in self.client.mget(keys) if keys else []:
            if raw is None:
                continue
            record = json.loads(raw)
            if isinstance(record, dict) and record.get("tenant") == tenant:
                out.append(record)
        return out

    def touch(self, table: str, ident: str, ttl_s: float = IDLE_TTL_S) -> None:
        self.client.pexpire(self._key(table, ident), int(ttl_s * 1000))


def checkpoint_record(tenant: str, path: TinkerPath, directory: str, run: dict[str, Any],
                      ttl_seconds: int | None, user_metadata: dict[str, str] | None) -> dict[str, Any]:
    now = time.time()
    return {
        "tenant": tenant, "tinker_path": str(path), "checkpoint_id": path.checkpoint_id,
        "checkpoint_type": path.checkpoint_type, "run": path.run, "directory": directory,
        "base_model": run["base_model"], "lora": run.get("lora"), "time": now,
        "expires_at": None if ttl_seconds is None else now + ttl_seconds, "user_metadata": user_metadata,
    }


def _glob_escape(text: str) -> str:
    return re.sub(r"([\[\]*?\\])", r"\\\1", text)

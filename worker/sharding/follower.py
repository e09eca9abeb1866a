"""Ranks 1..N-1 of a sharded worker: join the group, then run rank 0's commands until told to stop.

A follower never talks to Redis or Celery. When its group breaks (a peer died or hung, or this rank
failed), it drops its sessions and joins the next generation rank 0 opens; when rank 0 itself is gone
it exits non-zero, for its supervisor to restart it.
"""

from __future__ import annotations

import logging
import os

from tinkerq.errors import ShardGroupError, TinkerqError
from tinkerq.settings import Settings
from tinkerq.worker.loading.dtypes import served_dtype
from tinkerq.worker.loading.models import configure_torch, load_skeleton
from tinkerq.worker.loading.quantized_base import KEEP
from tinkerq.worker.sharding.experts import check_expert_parallel
from tinkerq.worker.sharding.group import ShardGroup, ShardSpec
from tinkerq.worker.sharding.host import ShardHost, from_wire
from tinkerq.worker.training.logprobs import LogprobComputer

log = logging.getLogger("tinkerq.shards")


def build_host(model_path: str, settings: Settings) -> ShardHost:
    """The group membership and the base model's skeleton (no weights: each session reads its shards from the
    files, worker/sharding/streaming.py)."""
    spec = ShardSpec.from_settings(settings)
    assert spec is not None
    # Every rank resolves "auto" alike (same checkpoint, same kind of device): the group's parts agree.
    model = load_skeleton(model_path, dtype=served_dtype(model_path, settings.dtype, settings.device))
    if settings.expert_parallel:  # said at start-up, not at the first session
        check_expert_parallel(model, spec.shards)
    group = ShardGroup(spec)
    logprobs = LogprobComputer(model, settings.loss_backend, device=settings.device)
    return ShardHost(group, model, model_dir=os.path.abspath(model_path), logprobs=logprobs,
                     microbatch_tokens=settings.microbatch_tokens, expert_parallel=settings.expert_parallel,
                     kept_quantized=settings.quantized_base == KEEP)


def run_follower(model_path: str, settings: Settings, *, threads: int | None = None) -> int:
    """Serve as rank ``settings.shard_rank`` (>= 1) until rank 0 says stop; returns the exit status."""
    configure_torch(settings, threads)
    host = build_host(model_path, settings)
    group = host.group
    group.form()  # at start-up a missing rank is an error (ShardGroupError says which)
    while True:
        try:
            op, args = group.receive_command()
        except Exception as exc:
            _rejoin(host, f"lost rank 0's command stream ({type(exc).__name__}: {str(exc)[:200]})")
            continue
        if op == "shutdown":
            log.info("rank 0 stopped; rank %d stops too", group.rank)
            group.leave("rank 0 stopped")
            return 0
        try:
            host.execute(op, from_wire(op, args))
        except TinkerqError:
            pass  # every rank raised it alike (agreed); rank 0 answers the caller
        except Exception as exc:
            log.exception("shard %d failed in %s", group.rank, op)
            _rejoin(host, f"shard {group.rank} failed in {op}: {exc}")


def _rejoin(host: ShardHost, reason: str) -> None:
    group = host.group
    log.error("%s; dropping this shard's sessions and waiting for the group to re-form", reason)
    host.drop_sessions()
    group.leave(reason)
    while True:
        try:
            group.form()
            return
        except ShardGroupError as exc:
            log.error("the shard group has not re-formed yet: %s", exc.message)
        except Exception as exc:  # the rendezvous store lives in rank 0: it is gone
            raise ShardGroupError(
                f"rank 0 at {group.spec.address} is gone ({type(exc).__name__}: {exc}); restart it, and this "
                f"shard (exiting now)"
            ) from None

"""Published checkpoints: readable by every tenant by their ``tinker://`` path, changed by their owner only.

A checkpoint's record (gateway/records.py) carries ``public``; ``publish_checkpoint_from_tinker_path`` sets it and
``unpublish_...`` clears it (gateway/checkpoint_rest.py). Reading a checkpoint (create_sampling_client,
create_training_client_from_state[_with_optimizer], weights_info, a run's load_state) looks up the caller's own
record first and, when there is none, a published one of any tenant: that is :func:`readable`. Everything else
(listing, deleting, publishing, ttl) stays the owner's, and another tenant's private checkpoint answers 404 as a
missing one. An unpublished checkpoint is nobody else's to read from then on; a sampler or run another tenant
made from it while it was public keeps the weights it loaded (as Tinker's).
"""

from __future__ import annotations

import json
from typing import Any

from tinkerq import keys
from tinkerq.gateway.records import Records, TinkerPath


def readable(records: Records, tenant: str, path: TinkerPath) -> dict[str, Any] | None:
    """The checkpoint record ``tenant`` may read at ``path``: its own, or a published one; else None."""
    own = records.get("checkpoint", str(path), tenant)
    if own is not None:
        return own
    raw = records.store.get(keys.gateway_record("checkpoint", str(path)))
    record = json.loads(raw) if raw is not None else None
    return record if isinstance(record, dict) and record.get("public") is True else None

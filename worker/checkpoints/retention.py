"""Checkpoint retention per session: a save with ``keep_newest: N`` keeps the training session's N newest
checkpoints of that kind (``save_state``: states, ``save_weights_for_sampler``: sampler weights; the registry's
:data:`tinkerq.operations.CHECKPOINT_KINDS`), the one just written always among them, and deletes the older ones;
their names go back in the reply (``pruned``) so whoever keeps records of them (the gateway) drops those. A save's
reply also says how large it is (``bytes``).

Newest means latest written (the marker's ``created``; its file time for checkpoints written before it was
recorded). Expired checkpoints are left to the expiry sweep and not counted (they go anyway). Nothing is followed
through a symbolic link, and a checkpoint is renamed aside before it is deleted, so a crash never leaves a
half-deleted directory that looks complete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from pathlib import Path
from typing import Any

from tinkerq.errors import ValidationError
from tinkerq.operations import CHECKPOINT_KINDS
from tinkerq.worker import checkpoints

log = logging.getLogger("tinkerq.worker")


def keep_newest_of(body: Any, op: str) -> int | None:
    """A save's ``keep_newest`` (None: keep everything), checked before anything is written."""
    value = body.get("keep_newest") if isinstance(body, dict) else None
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValidationError(f"{op} keep_newest= must be an integer >= 1 (how many of this training session's "
                              f"{CHECKPOINT_KINDS[op]} checkpoints to keep, this one included), got {value!r:.80}; "
                              f"nothing was saved or deleted")
    return value


def prune(checkpoint_dir: str, model_id: str, op: str, keep_newest: int, written: Path) -> list[str]:
    """Delete the session's checkpoints of ``op``'s kind beyond the ``keep_newest`` newest, never ``written``;
    returns the names deleted. Best effort: a failure is logged, and what was deleted until then returned."""
    kind = CHECKPOINT_KINDS[op]
    pruned: list[str] = []
    try:
        found = _checkpoints(checkpoint_dir, model_id, kind)
    except (OSError, ValidationError) as exc:
        log.warning("keep_newest: could not list the %s checkpoints of %s: %s", kind, model_id, exc)
        return pruned
    kept = {written.name}
    for _, name, path in sorted(found, reverse=True):  # newest first
        if name in kept:
            continue
        if len(kept) < keep_newest:
            kept.add(name)
            continue
        try:
            if _delete(path):
                pruned.append(name)
        except OSError as exc:
            log.warning("keep_newest: could not delete checkpoint %s: %s", path, exc)
    if pruned:
        log.info("keep_newest=%d: deleted %d older %s checkpoint(s) of %s: %s", keep_newest, len(pruned), kind,
                 model_id, ", ".join(pruned))
    return pruned


def _checkpoints(checkpoint_dir: str, model_id: str, kind: str) -> list[tuple[float, str, Path]]:
    """(written at, name, directory) of every complete, unexpired checkpoint of the session of ``kind``."""
    parent = checkpoints.path_below(checkpoint_dir, model_id, *(("state",) if kind == "state" else ()))
    marker = checkpoints.STATE_FILE if kind == "state" else checkpoints.WEIGHTS_FILE
    now = checkpoints.now()
    found = []
    with os.scandir(parent) as entries:
        for entry in entries:
            # Dot-names: the automatic snapshot, saves in progress, directories being deleted. "state" holds the
            # session's states, beside its sampler weights.
            if entry.name.startswith(".") or (kind == "sampler" and entry.name == "state"):
                continue
            if not entry.is_dir(follow_symlinks=False):
                continue
            path = Path(entry.path)
            written = _written_at(path / marker)
            expires = checkpoints.expiry(path)
            if written is not None and (expires is None or expires > now):
                found.append((written, entry.name, path))
    return found


def _written_at(marker: Path) -> float | None:
    """When a checkpoint was written; None when ``marker`` is missing or a link (not a complete checkpoint)."""
    try:
        st = os.lstat(marker)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    try:
        created = json.loads(marker.read_text()).get("created")
    except (OSError, ValueError, AttributeError):
        created = None
    return float(created) if isinstance(created, (int, float)) and not isinstance(created, bool) else st.st_mtime


def _delete(directory: Path) -> bool:
    """Rename ``directory`` aside, then delete it (never following a link); False if it was gone already."""
    aside = directory.with_name(f".{directory.name}.pruned-{os.urandom(4).hex()}")
    try:
        os.rename(directory, aside)  # renames a link itself, never its target
    except FileNotFoundError:  # deleted meanwhile (the expiry sweep)
        return False
    shutil.rmtree(aside, ignore_errors=True)  # never follows links inside the tree
    return True


def directory_bytes(directory: str | Path) -> int:
    """Bytes of the regular files below a saved directory (links neither counted nor followed)."""
    total = 0
    for root, _dirs, files in os.walk(directory, followlinks=False):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total

"""Checkpoints on disk: training state (save_state / load_state) and plain HF weights (for samplers).

A training state is a directory::

    model.safetensors, config.json      the weights (save_pretrained: tied weights stored once)
    optimizer.safetensors               optimizer state per parameter, by parameter name (AdamW: moments
                                        and step; Dimuon: momentum)
    gradients.safetensors               pending gradients, only when some are non-zero
    tinkerq_state.json                  format, base model, optimizer (absent: AdamW), optimizer steps,
                                        request position

The layout does not depend on how the model was held: a sharded worker gathers full tensors to rank 0
and writes the same files, so a state loads with any number of shards. Everything is safetensors and
JSON: loading a checkpoint never unpickles. Every directory is written
beside its final place and renamed into it, so a crash never leaves one that looks complete but isn't.

Names that come from messages never become paths as they are, and nothing below the checkpoint directory is
ever a symbolic link that gets followed (worker/checkpoints/paths.py).

A save with ``ttl_seconds`` records ``expires_at`` (unix seconds) in its marker (tinkerq_state.json /
tinkerq_weights.json). An expired checkpoint is refused, and deleted, when a request names it; workers also
delete expired ones at start and after each save (:func:`remove_expired`).

Here: writing a checkpoint atomically, resolving a path a request names, and expiry. Where checkpoints lie
(worker/checkpoints/paths.py) and what their files hold (worker/checkpoints/files.py) are re-exported, so
callers import ``tinkerq.worker.checkpoints`` alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tinkerq.errors import ValidationError
from tinkerq.worker.checkpoints.files import (
    ADAPTER_FILE,
    PEFT_PREFIX,
    STATE_FILE,
    STATE_FORMAT,
    WEIGHTS_FILE,
    SavedState,
    check_state,
    copy_tokenizer_files,
    read_state,
    write_state,
    write_weights_marker,
)
from tinkerq.worker.checkpoints.paths import (
    AUTO_SNAPSHOT,
    AUTO_SNAPSHOT_STAGED,
    _refuse_link,
    _remove_tree,
    _saved_directory,
    check_name,
    checkpoint_root,
    path_below,
    previous_path,
    refuse_links_inside,
    remove_auto_snapshot,
    state_path,
    weights_path,
)

__all__ = [  # where checkpoints lie and what they hold (their modules); writing, resolving and expiry (here)
    "ADAPTER_FILE", "AUTO_SNAPSHOT", "AUTO_SNAPSHOT_STAGED", "PEFT_PREFIX", "STATE_FILE", "STATE_FORMAT",
    "WEIGHTS_FILE", "SavedState", "check_name", "check_state", "checkpoint_root", "copy_tokenizer_files", "expiry",
    "install_directory", "now", "path_below", "previous_path", "read_state", "refuse_existing",
    "refuse_links_inside", "remove_auto_snapshot", "remove_expired", "resolve_state_path", "resolve_weights_path",
    "state_path", "weights_path", "write_atomically", "write_state", "write_weights_marker",
]

log = logging.getLogger("tinkerq.worker")
# How deep checkpoints lie below the checkpoint directory: <model_id>/<name> and <model_id>/state/<name>.
_CHECKPOINT_DEPTH = 3
# Dot-names the expiry sweep looks into (it skips the others: saves in progress are built under dot-names).
_SWEPT_DOT_NAMES = (AUTO_SNAPSHOT, f".{AUTO_SNAPSHOT}.previous", AUTO_SNAPSHOT_STAGED)


def now() -> float:
    """The clock expiry is judged by (unix seconds); one place for tests to move it."""
    return time.time()


def write_atomically(final: Path, fill: Callable[[Path], None], *, overwrite: bool = True) -> Path:
    """Build the directory in a temporary sibling with ``fill``, then rename it to ``final``.

    ``final`` comes from weights_path / state_path. Neither its parent nor an old ``final`` is followed if
    it is a symbolic link: the write is refused before anything is created or deleted. Without
    ``overwrite`` an existing (unexpired) ``final`` is a ValidationError and nothing is written.
    """
    final = Path(final)
    if not final.parent.exists():
        os.makedirs(final.parent, mode=0o700, exist_ok=True)
    _refuse_link(final.parent)
    _refuse_link(final)  # before the (expensive) fill, and checked again before replacing
    if not overwrite:
        refuse_existing(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))  # mode 0o700, a new name
    try:
        with _no_progress_bars():
            fill(tmp)
        if not overwrite:  # saved meanwhile by another worker (a shared checkpoint directory): that one stays
            refuse_existing(final)
        install_directory(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off while a checkpoint is written: its "Writing model shards" bar at every
    automatic snapshot would cut through the caller's own progress bar in an embedded fleet (``tinkerq sft``) and
    fill a worker's log. (Its switch is global: a bar another thread starts meanwhile stays hidden too.)"""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def install_directory(new: Path, final: Path) -> None:
    """Move the complete directory ``new`` to ``final``, its sibling. An old ``final`` is moved aside first and
    deleted once the new one is in place, so a crash at any point leaves a complete directory at ``final`` or at
    its ``previous_path``. A link at ``final`` is moved, never followed."""
    st = _refuse_link(final)
    previous = previous_path(final)
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            raise ValidationError(f"{final} exists and is not a directory; choose another name")
        _remove_tree(previous)  # a leftover of an earlier crash
        os.rename(final, previous)  # renames a link itself, never its target
    os.replace(new, final)  # rename(2) never follows a link at the destination
    _remove_tree(previous)


def refuse_existing(final: Path) -> None:
    """A ValidationError if checkpoint ``final`` exists (an expired one is deleted instead: its name is free)."""
    if _refuse_link(final) is None or _delete_if_expired(final, now()):
        return
    raise ValidationError(f"checkpoint {final.name!r} already exists ({final}): pass overwrite=True or choose "
                          f"another name")


def resolve_state_path(path: Any, checkpoint_dir: str) -> Path:
    """A training-state directory inside the checkpoint directory, or a ValidationError saying what is wrong."""
    directory = _saved_directory(path, checkpoint_dir, "save_state()")
    state_file = _refuse_link(directory / STATE_FILE)
    if state_file is None or not stat.S_ISREG(state_file.st_mode):
        raise ValidationError(
            f"{path!r} is not a training state (no {STATE_FILE}): pass a path returned by save_state(); "
            f"save_weights_for_sampler() writes weights only"
        )
    refuse_links_inside(directory)
    _refuse_expired(directory, path)
    return directory


def resolve_weights_path(path: Any, checkpoint_dir: str) -> Path:
    """A model directory (save_weights_for_sampler, or a save_state) inside the checkpoint directory."""
    directory = _saved_directory(path, checkpoint_dir, "save_weights_for_sampler()")
    config = _refuse_link(directory / "config.json") or _refuse_link(directory / ADAPTER_FILE)
    if config is None or not stat.S_ISREG(config.st_mode):
        raise ValidationError(f"{path!r} holds no model (no config.json) and no LoRA adapter ({ADAPTER_FILE}): "
                              f"pass a path returned by save_weights_for_sampler()")
    refuse_links_inside(directory)
    _refuse_expired(directory, path)
    return directory


# -- expiry ------------------------------------------------------------------------------------------------

def expiry(directory: Path) -> float | None:
    """When a saved directory expires (its marker's ``expires_at``), or None: kept until deleted. A marker that
    is missing, a link or unreadable says nothing here (resolving the directory reports those)."""
    for marker in (STATE_FILE, WEIGHTS_FILE):
        try:
            st = _refuse_link(directory / marker)
            if st is None or not stat.S_ISREG(st.st_mode):
                continue
            value = json.loads((directory / marker).read_text()).get("expires_at")
        except (ValidationError, OSError, ValueError, AttributeError):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _refuse_expired(directory: Path, path: Any) -> None:
    """A ValidationError if the checkpoint expired; it is deleted on the way (best effort)."""
    when = expiry(directory)
    if when is None or when > now():
        return
    try:
        _delete_if_expired(directory, now())
    except OSError as exc:
        log.warning("could not delete expired checkpoint %s: %s", directory, exc)
    raise ValidationError(
        f"checkpoint {path!r} expired at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(when))} (the "
        f"ttl_seconds it was saved with ran out) and has been deleted; save it again, with a longer ttl_seconds "
        f"or none")


def _delete_if_expired(directory: Path, at: float) -> bool:
    """Delete checkpoint ``directory`` if it expired by ``at`` (unix seconds); True if it did.

    It is renamed aside first and judged again there, so a checkpoint saved under the same name in between
    (by another worker sharing the directory) is put back, never deleted. Links are never followed.
    """
    when = expiry(directory)
    if when is None or when > at:
        return False
    st = _refuse_link(directory)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return False
    aside = directory.with_name(f".{directory.name}.expired-{os.urandom(4).hex()}")
    try:
        os.rename(directory, aside)  # renames a link itself, never its target
    except FileNotFoundError:  # deleted meanwhile
        return False
    when = expiry(aside)
    if when is None or when > at:
        with contextlib.suppress(OSError):
            os.rename(aside, directory)
        return False
    shutil.rmtree(aside, ignore_errors=True)  # never follows links inside the tree
    log.info("deleted expired checkpoint %s", directory)
    return True


def remove_expired(checkpoint_dir: str, at: float | None = None) -> list[Path]:
    """Delete every checkpoint expired by ``at`` (default: now) below the checkpoint directory, best effort;
    returns those deleted.

    Walks the directories below it, at most ``_CHECKPOINT_DEPTH`` levels down, without following a symbolic
    link; a directory holding a marker is a checkpoint (not entered). Names starting with '.' are skipped
    (saves in progress are built there), but for automatic snapshots.
    """
    when = now() if at is None else at
    deleted: list[Path] = []

    def walk(directory: Path, depth: int) -> None:
        try:
            with os.scandir(directory) as found:
                entries = [e for e in found if not e.name.startswith(".") or e.name in _SWEPT_DOT_NAMES]
        except OSError:
            return
        for entry in entries:
            path = Path(entry.path)
            try:
                if not entry.is_dir(follow_symlinks=False):
                    continue
                if any(os.path.lexists(path / marker) for marker in (STATE_FILE, WEIGHTS_FILE)):
                    if _delete_if_expired(path, when):
                        deleted.append(path)
                elif depth < _CHECKPOINT_DEPTH:
                    walk(path, depth + 1)
            except (OSError, ValidationError) as exc:  # best effort: the next sweep tries again
                log.warning("checkpoint sweep skipped %s: %s", path, exc)

    try:
        root = checkpoint_root(checkpoint_dir)
    except ValidationError:
        return deleted
    walk(root, 1)
    return deleted

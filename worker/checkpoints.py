"""Checkpoints on disk: training state (save_state / load_state) and plain HF weights (for samplers).

A training state is a directory::

    model.safetensors, config.json      the weights (save_pretrained: tied weights stored once)
    optimizer.safetensors               AdamW moments and step per parameter, by parameter name
    gradients.safetensors               pending gradients, only when some are non-zero
    tinkerq_state.json                  format, base model, optimizer steps, request position

The layout does not depend on how the model was held: a sharded worker gathers full tensors to rank 0
and writes the same files, so a state loads with any number of shards. Everything is safetensors and
JSON: loading a checkpoint never unpickles. Every directory is written
beside its final place and renamed into it, so a crash never leaves one that looks complete but isn't.

Names that come from messages (session ids, checkpoint names, paths to load) never become paths as they
are: every path is built below the checkpoint directory one component at a time, each component a plain
name, and nothing below the checkpoint directory is ever a symbolic link that gets followed (the directory
itself may be a link the operator configured). Whoever can send messages must not be able to make a worker
write, replace or read anything outside it.

A save with ``ttl_seconds`` records ``expires_at`` (unix seconds) in its marker (tinkerq_state.json /
tinkerq_weights.json). An expired checkpoint is refused, and deleted, when a request names it; workers also
delete expired ones at start and after each save (:func:`remove_expired`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tinkerq.errors import ValidationError

log = logging.getLogger("tinkerq.worker")
STATE_FORMAT = 1
STATE_FILE = "tinkerq_state.json"
ADAPTER_FILE = "adapter_model.safetensors"  # a LoRA session's weights (PEFT's layout)
PEFT_PREFIX = "base_model.model."  # PEFT's key prefix in adapter_model.safetensors
WEIGHTS_FILE = "tinkerq_weights.json"  # in save_weights_for_sampler directories: the base model's name
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
# Files that make a saved directory a complete model for from_pretrained (weights come from the session).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "tokenizer.model", "generation_config.json", "chat_template.jinja")
# How deep checkpoints lie below the checkpoint directory: <model_id>/<name> and <model_id>/state/<name>.
_CHECKPOINT_DEPTH = 3


# A session's automatic snapshot (docs/reliability.md): save_state's layout under a name no user picks
# (check_name refuses a leading dot for users' names).
AUTO_SNAPSHOT = ".auto"
# Dot-names the expiry sweep looks into (it skips the others: saves in progress are built under dot-names).
_SWEPT_DOT_NAMES = (AUTO_SNAPSHOT, f".{AUTO_SNAPSHOT}.previous")


def remove_auto_snapshot(checkpoint_dir: str, model_id: str) -> None:
    """Delete a closed session's automatic snapshot, if any (never following a link)."""
    try:
        directory = path_below(checkpoint_dir, _check_model_id(model_id), "state", AUTO_SNAPSHOT)
        # With it go the directory a write was replacing and the temporary ones of writes killed midway.
        for path in [directory, *directory.parent.glob(f".{AUTO_SNAPSHOT}.*")]:
            _remove_tree(path)
    except (ValidationError, OSError) as exc:  # best effort: the expiry sweep removes the snapshot later
        log.warning("could not remove the automatic snapshot of %s: %s", model_id, exc)


def now() -> float:
    """The clock expiry is judged by (unix seconds); one place for tests to move it."""
    return time.time()


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name) or name.startswith("."):
        raise ValidationError(f"checkpoint name {name!r} must be 1-128 characters of [A-Za-z0-9_.-], not starting "
                              f"with '.'")
    return name


def _check_component(part: Any, what: str) -> str:
    """One path component: a plain name, never empty, '.', '..', absolute or holding a separator."""
    if not isinstance(part, str) or not _NAME_RE.match(part) or part in (".", ".."):
        raise ValidationError(f"{what} {part!r} cannot name a directory: it must be 1-128 characters of "
                              f"[A-Za-z0-9_.-] and not '.' or '..'")
    return part


def _refuse_link(path: Path) -> os.stat_result | None:
    """``lstat`` of ``path`` (None if missing); a ValidationError if it is a symbolic link, never followed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise ValidationError(
            f"{path} is a symbolic link below the checkpoint directory; tinkerq never follows links there "
            f"(they could point anywhere): an operator should remove it (only the checkpoint directory itself "
            f"may be a link)")
    return st


def checkpoint_root(checkpoint_dir: str) -> Path:
    """The configured checkpoint directory, absolute. The operator may make it a symlink; below it, none."""
    if not isinstance(checkpoint_dir, str) or not checkpoint_dir:
        raise ValidationError("no checkpoint directory is configured: set TINKERQ_CHECKPOINT_DIR")
    return Path(os.path.abspath(os.path.expanduser(checkpoint_dir)))


def path_below(checkpoint_dir: str, *parts: str, create_parents: bool = False, what: str = "name") -> Path:
    """``<checkpoint_dir>/<parts...>``, built and checked one component at a time.

    Each component must be a plain name (no '..', no separator, not absolute), and each that exists must
    not be a symbolic link (checked with ``lstat``, so a planted link is refused instead of followed).
    With ``create_parents`` the missing directories above the last component are created, owner-only
    (0o700). The result is verified to lie inside the resolved checkpoint directory.
    """
    root = checkpoint_root(checkpoint_dir)
    if create_parents:
        os.makedirs(root, mode=0o700, exist_ok=True)
    path = root
    missing = False  # below a missing directory nothing exists, so there is nothing left to lstat
    for i, part in enumerate(parts):
        path = path / _check_component(part, what)
        if missing:
            continue
        st = _refuse_link(path)
        last = i == len(parts) - 1
        if st is None and create_parents and not last:
            with contextlib.suppress(FileExistsError):  # a concurrent save may create it too
                os.mkdir(path, 0o700)
            st = _refuse_link(path)
        if st is None:
            missing = True
        elif not last and not stat.S_ISDIR(st.st_mode):
            raise ValidationError(f"{path} inside the checkpoint directory is not a directory; an operator "
                                  f"should move it away")
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, os.path.realpath(path)]) != real_root:  # defence in depth
        raise ValidationError(f"{path} is outside this fleet's checkpoint directory {root}")
    return path


def _check_model_id(model_id: Any) -> str:
    if not isinstance(model_id, str) or not _NAME_RE.match(model_id) or model_id in (".", ".."):
        raise ValidationError(f"session id {model_id!r} is not one this worker minted; open a session with "
                              f"create_training_client() and use the client it returns")
    return model_id


def weights_path(checkpoint_dir: str, model_id: str, name: Any) -> Path:
    """Where save_weights_for_sampler(name) writes: ``<checkpoint_dir>/<model_id>/<name>`` (parents created,
    owner-only; a symlink anywhere below the checkpoint directory is a ValidationError)."""
    check_name(name)
    return path_below(checkpoint_dir, _check_model_id(model_id), name, create_parents=True)


def state_path(checkpoint_dir: str, model_id: str, name: Any) -> Path:
    """Where save_state(name) writes: ``<checkpoint_dir>/<model_id>/state/<name>`` (as weights_path)."""
    if name != AUTO_SNAPSHOT:  # users' names are checked; the automatic snapshot's is ours
        check_name(name)
    return path_below(checkpoint_dir, _check_model_id(model_id), "state", name, create_parents=True)


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
        fill(tmp)
        if not overwrite:  # saved meanwhile by another worker (a shared checkpoint directory): that one stays
            refuse_existing(final)
        st = _refuse_link(final)
        previous = previous_path(final)
        if st is not None:  # replacing: the old one is moved aside first, and deleted once the new one is in place,
            # so a crash at any point leaves a complete directory at `final` or at its `previous_path`
            if not stat.S_ISDIR(st.st_mode):
                raise ValidationError(f"{final} exists and is not a directory; choose another name")
            _remove_tree(previous)  # a leftover of an earlier crash
            os.rename(final, previous)  # renames a link itself, never its target
        os.replace(tmp, final)  # rename(2) never follows a link at the destination
        _remove_tree(previous)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def previous_path(final: Path) -> Path:
    """Where write_atomically keeps the directory it replaces until the new one is in place (a crash between
    the two renames leaves only this one: an adopter loads the automatic snapshot from it then)."""
    return final.with_name(f".{final.name}.previous")


def _remove_tree(path: Path) -> None:
    st = _refuse_link(path)
    if st is not None and stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)  # never follows links inside the tree


def refuse_existing(final: Path) -> None:
    """A ValidationError if checkpoint ``final`` exists (an expired one is deleted instead: its name is free)."""
    if _refuse_link(final) is None or _delete_if_expired(final, now()):
        return
    raise ValidationError(f"checkpoint {final.name!r} already exists ({final}): pass overwrite=True or choose "
                          f"another name")


def copy_tokenizer_files(model_dir: str, directory: Path) -> None:
    """Copy the base model's tokenizer files, so the saved directory is a complete model."""
    for fname in _TOKENIZER_FILES:
        src = Path(model_dir) / fname
        if src.is_file():
            shutil.copy2(src, directory / fname)


@dataclass
class SavedState:
    """A training state as full (unsharded) CPU tensors, keyed by parameter name."""

    weights: dict[str, torch.Tensor]
    moments: dict[str, torch.Tensor]  # "<name>::exp_avg" / "::exp_avg_sq" / "::step"
    grads: dict[str, torch.Tensor]  # empty when no gradient is pending
    meta: dict[str, Any]


def optimizer_entries(name: str, state: dict[str, Any], full: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """One parameter's AdamW state as ``{"<name>::<key>": tensor}`` (``full`` gathers a shard, if any)."""
    return {f"{name}::{key}": full(state[key]) for key in ("exp_avg", "exp_avg_sq", "step") if key in state}


def write_state(directory: Path, *, write_weights: Callable[[Path], None], shapes: dict[str, list[int]],
                moments: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], base_model: str,
                model_id: str, steps: int, seq_id: int, shards: int = 1, lora: dict[str, Any] | None = None,
                expires_at: float | None = None) -> None:
    """Write a training state; ``write_weights(directory)`` writes model.safetensors + config.json."""
    write_weights(directory)
    save_file({k: v.detach().cpu().contiguous() for k, v in moments.items()},
              str(directory / "optimizer.safetensors"))
    if grads:
        save_file({k: v.detach().cpu().contiguous() for k, v in grads.items()},
                  str(directory / "gradients.safetensors"))
    meta = {"format": STATE_FORMAT, "base_model": base_model, "model_id": model_id, "optimizer_steps": steps,
            "seq_id": seq_id, "created": time.time(), "saved_by_shards": shards, "parameters": shapes}
    if lora is not None:
        meta["lora"] = lora
    if expires_at is not None:
        meta["expires_at"] = expires_at
    (directory / STATE_FILE).write_text(json.dumps(meta, indent=1))  # last: marks the directory complete


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


def write_weights_marker(directory: Path, base_model: str, lora: dict[str, Any] | None = None,
                         expires_at: float | None = None) -> None:
    """Name the base model in a saved weights directory, so a sampling client can be made from the path alone
    (and, for a LoRA adapter, its configuration; with a ttl, when it expires)."""
    marker: dict[str, Any] = {"format": STATE_FORMAT, "base_model": base_model}
    if lora is not None:
        marker["lora"] = lora
    if expires_at is not None:
        marker["expires_at"] = expires_at
    (directory / WEIGHTS_FILE).write_text(json.dumps(marker))


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


def _saved_directory(path: Any, checkpoint_dir: str, returned_by: str) -> Path:
    """An existing directory below the checkpoint directory named by ``path`` (absolute, or relative to it)."""
    if not isinstance(path, str) or not path:
        raise ValidationError(f"checkpoint path must be a non-empty string, got {path!r}")
    root = checkpoint_root(checkpoint_dir)
    given = Path(path) if os.path.isabs(path) else root / path  # relative: to the checkpoint directory
    outside = (f"checkpoint path {path!r} is outside this fleet's checkpoint directory {root}: pass a path "
               f"returned by {returned_by}")
    if ".." in given.parts or "\0" in path:  # judged on the text: '..' after a link could lead anywhere
        raise ValidationError(outside)
    # The path save_state() returned starts with the configured root; accept the resolved root as well.
    rel = None
    for prefix in (root, Path(os.path.realpath(root))):
        with contextlib.suppress(ValueError):
            rel = given.relative_to(prefix)
            break
    if rel is None:
        raise ValidationError(outside)
    if not rel.parts:
        raise ValidationError(f"{path!r} is the checkpoint directory itself: pass a path returned by {returned_by}")
    directory = path_below(checkpoint_dir, *rel.parts, what="checkpoint path component")
    st = _refuse_link(directory)
    if st is None:
        raise ValidationError(f"checkpoint {path!r} does not exist")
    if not stat.S_ISDIR(st.st_mode):
        raise ValidationError(f"checkpoint {path!r} is not a directory: pass a path returned by {returned_by}")
    return directory


def refuse_links_inside(directory: Path) -> None:
    """A ValidationError if any entry of a saved directory is a symlink (a planted model.safetensors -> /etc/…
    would otherwise be read, and its content could leak through the loaded weights)."""
    for entry in os.scandir(directory):
        if entry.is_symlink():
            raise ValidationError(
                f"{Path(directory) / entry.name} is a symbolic link; a checkpoint holds only plain files and "
                f"tinkerq never follows links below the checkpoint directory: save the state again")


def check_state(directory: Path, shapes: dict[str, list[int]], lora: dict[str, Any] | None = None,
                base_model: str | None = None) -> dict[str, Any]:
    """The state's metadata, after checking it fits a session with these parameter shapes (``lora``: the LoRA
    session's configuration; None for a full-parameter session; ``base_model``: checked when given)."""
    try:
        meta = json.loads((directory / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ValidationError(f"cannot read {directory / STATE_FILE}: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise ValidationError(f"checkpoint format {found!r} is not supported (expected {STATE_FORMAT})")
    saved_lora = meta.get("lora")
    if (saved_lora is None) != (lora is None):
        what = "a LoRA adapter's state" if saved_lora is not None else "a full-parameter state"
        here = "a LoRA session" if lora is not None else "a full-parameter session"
        raise ValidationError(f"{directory} is {what} and cannot load into {here}: resume it with "
                              f"ServiceClient.create_training_client_from_state({str(directory)!r}), which opens "
                              f"the right kind of session")
    if base_model is not None and meta.get("base_model") != base_model:
        raise ValidationError(f"{directory} was saved from base model {meta.get('base_model')!r}, not {base_model!r}: "
                              f"load it into a session on that base model")
    if lora is not None and isinstance(saved_lora, dict):
        for key in ("rank", "train_attn", "train_mlp", "train_unembed"):
            if saved_lora.get(key) != lora.get(key):
                raise ValidationError(f"{directory} holds a LoRA adapter with {key}={saved_lora.get(key)!r}; this "
                                      f"session has {key}={lora.get(key)!r}: resume it with "
                                      f"create_training_client_from_state(path)")
    if meta.get("parameters") != shapes:
        saved = meta.get("parameters") or {}
        diff = next((n for n in sorted(set(saved) | set(shapes)) if saved.get(n) != shapes.get(n)), None)
        raise ValidationError(
            f"checkpoint was saved from a model with other parameters than this worker serves "
            f"(first difference: {diff}: saved {saved.get(diff)}, here {shapes.get(diff)})"
        )
    return meta


def read_state(directory: Path, shapes: dict[str, list[int]], tied: dict[str, str],
               lora: dict[str, Any] | None = None, *, optimizer: bool = True) -> SavedState:
    """Every tensor of a training state (full tensors, on the CPU). ``tied`` maps a parameter that shares
    its storage with another to the other's name (tied embeddings are stored once). Without ``optimizer``
    only the weights are read (no AdamW state, no pending gradients)."""
    refuse_links_inside(directory)  # again: every rank of a sharded worker reads the files itself
    meta = check_state(directory, shapes, lora)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob(ADAPTER_FILE if lora is not None else "model*.safetensors")):
        weights.update({k.removeprefix(PEFT_PREFIX): v for k, v in load_file(str(file)).items()})
    for name in shapes:
        if name not in weights and tied.get(name) not in weights:
            raise ValidationError(f"checkpoint {directory} has no weights for {name}")
    if not optimizer:
        return SavedState(weights, {}, {}, meta)
    moments = load_file(str(directory / "optimizer.safetensors"))
    grads_file = directory / "gradients.safetensors"
    grads = load_file(str(grads_file)) if grads_file.is_file() else {}
    return SavedState(weights, moments, grads, meta)

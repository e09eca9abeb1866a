"""Where checkpoints lie: names from messages become paths below the checkpoint directory, never following a link.

Names that come from messages (session ids, checkpoint names, paths to load) never become paths as they
are: every path is built below the checkpoint directory one component at a time, each component a plain
name, and nothing below the checkpoint directory is ever a symbolic link that gets followed (the directory
itself may be a link the operator configured). Whoever can send messages must not be able to make a worker
write, replace or read anything outside it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any

from tinkerq.errors import ValidationError

log = logging.getLogger("tinkerq.worker")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")

# A session's automatic snapshot (docs/reliability.md): save_state's layout under a name no user picks
# (check_name refuses a leading dot for users' names).
AUTO_SNAPSHOT = ".auto"
# Where the compute loop writes an automatic snapshot; the outbox moves it to AUTO_SNAPSHOT once every request it
# covers is journaled (worker/recovery/: the compute loop does not wait for Redis).
AUTO_SNAPSHOT_STAGED = ".auto.staged"


def remove_auto_snapshot(checkpoint_dir: str, model_id: str) -> None:
    """Delete a closed session's automatic snapshot, if any (never following a link)."""
    try:
        directory = path_below(checkpoint_dir, _check_model_id(model_id), "state", AUTO_SNAPSHOT)
        # With it go the directory a write was replacing and the temporary ones of writes killed midway.
        staged = directory.with_name(AUTO_SNAPSHOT_STAGED)
        for path in [directory, staged, *directory.parent.glob(f".{AUTO_SNAPSHOT}.*")]:
            _remove_tree(path)
    except (ValidationError, OSError) as exc:  # best effort: the expiry sweep removes the snapshot later
        log.warning("could not remove the automatic snapshot of %s: %s", model_id, exc)


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


# Folders of a session's directory that hold other saves than save_weights_for_sampler's: save_state's, and
# the gateway's save_weights_external exports. A weights save by either name would hold the other saves inside it.
STATE_FOLDER, EXTERNAL_FOLDER = "state", "external"


def weights_path(checkpoint_dir: str, model_id: str, name: Any, *, external: bool = False) -> Path:
    """Where save_weights_for_sampler(name) writes: ``<checkpoint_dir>/<model_id>/<name>``, or with ``external``
    (the gateway's save_weights_external) ``<checkpoint_dir>/<model_id>/external/<name>`` (parents created,
    owner-only; a symlink anywhere below the checkpoint directory is a ValidationError)."""
    check_name(name)
    if external:
        return path_below(checkpoint_dir, _check_model_id(model_id), EXTERNAL_FOLDER, name, create_parents=True)
    if name in (STATE_FOLDER, EXTERNAL_FOLDER):
        raise ValidationError(f"checkpoint name {name!r} is reserved (the folder of save_state's or "
                              f"save_weights_external's checkpoints); choose another name")
    return path_below(checkpoint_dir, _check_model_id(model_id), name, create_parents=True)


def state_path(checkpoint_dir: str, model_id: str, name: Any) -> Path:
    """Where save_state(name) writes: ``<checkpoint_dir>/<model_id>/state/<name>`` (as weights_path)."""
    if name not in (AUTO_SNAPSHOT, AUTO_SNAPSHOT_STAGED):  # users' names are checked; the automatic snapshot's is ours
        check_name(name)
    return path_below(checkpoint_dir, _check_model_id(model_id), STATE_FOLDER, name, create_parents=True)


def previous_path(final: Path) -> Path:
    """Where write_atomically keeps the directory it replaces until the new one is in place (a crash between
    the two renames leaves only this one: an adopter loads the automatic snapshot from it then)."""
    return final.with_name(f".{final.name}.previous")


def _remove_tree(path: Path) -> None:
    st = _refuse_link(path)
    if st is not None and stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)  # never follows links inside the tree


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

"""What the gateway does to a checkpoint's files: change its expiry (``set_checkpoint_ttl``), copy it
(``copy_weights``) and delete it (``delete_checkpoint``). Everything else about checkpoints on disk is the workers'.

The gateway reaches the fleet's checkpoint directory (``TINKERQ_CHECKPOINT_DIR``, the workers' shared one) for
these calls only; a gateway without it answers the first two 503 with what to set, and a deletion there removes the
record only (its log says the files stay). It acts only on directories its
own records name (written from a worker's reply, never from a request), and only below the checkpoint directory,
never following a symbolic link (as the workers, worker/checkpoints/paths.py).

Expiry lives where the workers read it: ``expires_at`` in the directory's marker (``tinkerq_state.json`` for a
save_state, ``tinkerq_weights.json`` for a sampler save). Rewriting it (atomically: a new file renamed over the
old) is what makes the workers' expiry sweep (worker/checkpoints/ ``remove_expired``, at each worker start
and after each save) delete the directory once it has expired, and refuse to load it after that.

A copy is a new directory beside the source's session folder (``<root>/<new id>/...``, the source's layout) whose
files are hard links to the source's (no bytes duplicated, as Tinker's copies share storage) and whose marker is
a file of its own (its own expiry). A hard link outlives the source's deletion, so the copy's lifetime is its own.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import uuid
from pathlib import Path
from typing import Any

from tinkerq.errors import ServerError

MARKERS = ("tinkerq_state.json", "tinkerq_weights.json")  # the workers' markers (worker/checkpoints/files.py)


class Unreachable(ServerError):
    """The checkpoint's directory is not reachable from this gateway."""


def _root(checkpoint_dir: str) -> Path:
    return Path(os.path.abspath(os.path.expanduser(checkpoint_dir)))


def _below(checkpoint_dir: str, directory: str) -> Path:
    """``directory`` (a record's) checked: below the checkpoint directory, existing, no link on the way."""
    root = _root(checkpoint_dir)
    given = Path(directory)
    rel = None
    for prefix in (root, Path(os.path.realpath(root))):
        try:
            rel = given.relative_to(prefix)
            break
        except ValueError:
            continue
    if rel is None or not rel.parts or ".." in rel.parts:
        raise Unreachable(f"checkpoint directory {directory} is not below this gateway's checkpoint directory "
                          f"{root}: start the gateway with TINKERQ_CHECKPOINT_DIR set to the workers' shared one")
    path = root
    for part in rel.parts:
        path = path / part
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise Unreachable(f"checkpoint directory {directory} is not reachable from this gateway: start it with "
                              f"TINKERQ_CHECKPOINT_DIR set to the workers' shared checkpoint directory") from None
        if stat.S_ISLNK(st.st_mode):
            raise ServerError(f"{path} is a symbolic link below the checkpoint directory; tinkerq never follows "
                              f"links there: an operator should remove it")
    return path


def _marker(directory: Path) -> Path:
    for name in MARKERS:
        path = directory / name
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                return path
        except FileNotFoundError:
            continue
    raise ServerError(f"{directory} holds no checkpoint marker ({' or '.join(MARKERS)})")


def _write_marker(marker: Path, content: dict[str, Any]) -> None:
    tmp = marker.with_name(f".{marker.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(content))
    os.replace(tmp, marker)  # readers see the old marker or the new one, never half of one


def set_expiry(checkpoint_dir: str, directory: str, expires_at: float | None) -> None:
    """Make the checkpoint expire at ``expires_at`` (unix seconds; None: never)."""
    marker = _marker(_below(checkpoint_dir, directory))
    content = json.loads(marker.read_text())
    if expires_at is None:
        content.pop("expires_at", None)
    else:
        content["expires_at"] = expires_at
    _write_marker(marker, content)


def remove(checkpoint_dir: str, directory: str) -> None:
    """Delete the checkpoint at ``directory`` (``delete_checkpoint``). Its marker says it expired first, so a
    worker refuses to load it while its files go; a copy's hard links to the same files keep the copy whole."""
    if _root(checkpoint_dir).is_dir() and not os.path.lexists(directory):
        return  # gone already (the workers' expiry sweep)
    path = _below(checkpoint_dir, directory)
    try:
        marker = _marker(path)
    except ServerError:  # none (an export's folder): nothing a worker would load from it
        marker = None
    if marker is not None:
        content = json.loads(marker.read_text())
        content["expires_at"] = 0.0
        _write_marker(marker, content)
    shutil.rmtree(path)  # never follows a link: removes the link itself


def copy(checkpoint_dir: str, directory: str, expires_at: float | None) -> str:
    """A copy of the checkpoint at ``directory`` (hard links), expiring at ``expires_at``: its directory."""
    source = _below(checkpoint_dir, directory)
    root = _root(checkpoint_dir)
    rel = source.relative_to(root) if source.is_relative_to(root) else source.relative_to(os.path.realpath(root))
    final = root / uuid.uuid4().hex / Path(*rel.parts[1:])  # the source's layout under a session id of its own
    final.parent.mkdir(mode=0o700, parents=True)
    building = final.with_name(f".{final.name}.copying-{uuid.uuid4().hex[:8]}")
    marker = _marker(source)
    try:
        _link_tree(source, building, marker, expires_at)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    os.rename(building, final)
    return str(final)


def _link_tree(source: Path, building: Path, marker: Path, expires_at: float | None) -> None:
    for folder, dirs, files in os.walk(source, followlinks=False):
        here = Path(folder)
        target = building / here.relative_to(source)
        target.mkdir(mode=0o700)
        for name in dirs:
            if (here / name).is_symlink():
                raise ServerError(f"{here / name} is a symbolic link inside a checkpoint; not copied")
        for name in files:
            src = here / name
            if not stat.S_ISREG(os.lstat(src).st_mode):
                raise ServerError(f"{src} is not a plain file; the checkpoint is not copied")
            if src == marker:
                continue  # written below, as a file of the copy's own
            try:
                os.link(src, target / name)
            except OSError:  # another file system, or links not allowed: copy the bytes
                shutil.copy2(src, target / name)
    content = json.loads(marker.read_text())
    content.pop("expires_at", None)  # the source's expiry is not inherited
    if expires_at is not None:
        content["expires_at"] = expires_at
    (building / marker.name).write_text(json.dumps(content))

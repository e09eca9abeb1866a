"""External weights behind signed URLs: ``get_external_weights_urls`` and the downloads it points at.

``save_weights_external`` (an ordered request of the run, gateway/service.py) has the worker write the run's weights
archive, the same files as ``save_weights_for_sampler`` (Tinker's layout, which ``tinker_cookbook.weights`` reads:
``adapter_model.safetensors`` + ``adapter_config.json`` for LoRA, a Hugging Face model for a full run, the
tokenizer files) into ``<checkpoint_dir>/<run's worker session>/external/<name>``, recorded at
``tinker://<run>/external_weights/<name>``. ``get_external_weights_urls`` answers one URL per file. Each URL holds a
token (gateway/signing.py) naming the tenant, the checkpoint and the file, valid for ``URL_LIFETIME_S``; it carries
no API key, so the ``tinker`` CLI (or curl, or a serving engine) fetches it as it is. A download checks the token,
then the checkpoint's record again (a deleted or expired checkpoint is gone, and a published one of another tenant is
readable while it stays published: gateway/publishing.py), then serves the file.

The gateway reads the checkpoint directory the workers write (TINKERQ_CHECKPOINT_DIR, which workers and users
share already). Nothing from a request becomes a path: the directory is the record's (written by the gateway from
the worker's reply) and must lie below the gateway's checkpoint directory; files are listed and opened below it one
component at a time, and a symbolic link anywhere is refused, never followed.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import quote

from tinkerq.gateway import publishing
from tinkerq.gateway.lookups import NotFound, iso
from tinkerq.gateway.records import PathError, Records, TinkerPath
from tinkerq.gateway.signing import BadToken, Signer

URL_LIFETIME_S = 3600.0  # the tinker CLI signs again when fewer than 5 minutes are left
PURPOSE = "external-weights-download"
CHUNK_BYTES = 1 << 20
SEGMENT = "external_weights"
MAX_FILES = 10_000
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class Unavailable(Exception):
    """The checkpoint's files cannot be served from here (the message says why and what to do)."""


def archive_files(checkpoint_dir: str, directory: str) -> dict[str, int]:
    """Every regular file of the saved ``directory`` (relative path -> size), walked without following links."""
    found: dict[str, int] = {}
    with _opened_directory(checkpoint_dir, directory) as top:
        _walk(top, "", found)
    return found


def _walk(fd: int, prefix: str, found: dict[str, int]) -> None:
    for name in sorted(os.listdir(fd)):
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            raise Unavailable(f"{prefix}{name} in the checkpoint is a symbolic link; it is never served")
        if stat.S_ISDIR(st.st_mode):
            sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            try:
                _walk(sub, f"{prefix}{name}/", found)
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            found[prefix + name] = st.st_size
            if len(found) > MAX_FILES:
                raise Unavailable(f"the checkpoint holds over {MAX_FILES} files; it is not an archive this serves")


@contextlib.contextmanager
def _opened_directory(checkpoint_dir: str, directory: str) -> Iterator[int]:
    """An open descriptor of ``directory``, reached from the checkpoint directory one component at a time with
    O_NOFOLLOW (the checkpoint directory itself may be a link the operator made; nothing below it)."""
    root = os.path.abspath(os.path.expanduser(checkpoint_dir))
    target = os.path.abspath(directory)
    rel = None
    for prefix in (root, os.path.realpath(root)):
        with contextlib.suppress(ValueError):
            candidate = os.path.relpath(target, prefix)
            if candidate != "." and not candidate.startswith(".."):
                rel = candidate
                break
    if rel is None:
        raise Unavailable("this checkpoint lies outside the gateway's checkpoint directory: run the gateway with the "
                          "workers' TINKERQ_CHECKPOINT_DIR (a directory they share)")
    try:
        fd = os.open(root, _DIR_FLAGS & ~os.O_NOFOLLOW)
    except OSError as exc:
        raise Unavailable(f"the gateway cannot read its checkpoint directory ({exc.strerror}): run it with the "
                          f"workers' TINKERQ_CHECKPOINT_DIR") from None
    try:
        for part in rel.split(os.sep):
            try:
                sub = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise Unavailable(f"the checkpoint's files are not readable here ({exc.strerror}): they expired, "
                                  f"were removed, or this gateway does not share the workers' checkpoint "
                                  f"directory") from None
            os.close(fd)
            fd = sub
        yield fd
    finally:
        os.close(fd)


def open_file(checkpoint_dir: str, directory: str, relpath: str) -> tuple[int, int]:
    """(descriptor, size) of one file of the archive, opened below it without following links."""
    parts = relpath.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise Unavailable(f"{relpath!r} is not a file of this checkpoint")
    with _opened_directory(checkpoint_dir, directory) as top:
        fd = os.dup(top)
        try:
            for part in parts[:-1]:
                sub = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = sub
            file_fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=fd)
        except OSError as exc:
            raise Unavailable(f"{relpath} is not readable ({exc.strerror}): the checkpoint expired or was "
                              f"removed") from None
        finally:
            os.close(fd)
    st = os.fstat(file_fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(file_fd)
        raise Unavailable(f"{relpath!r} is not a file of this checkpoint")
    return file_fd, st.st_size


async def stream(fd: int, size: int) -> AsyncIterator[bytes]:
    """The file's bytes, read in a thread chunk by chunk (a large archive never sits in memory); closes ``fd``."""
    import asyncio

    try:
        left = size
        while left > 0:
            chunk = await asyncio.to_thread(os.read, fd, min(CHUNK_BYTES, left))
            if not chunk:
                break
            left -= len(chunk)
            yield chunk
    finally:
        os.close(fd)


def signed_urls(signer: Signer, base_url: str, tenant: str, path: TinkerPath,
                files: dict[str, int]) -> tuple[dict[str, str], float]:
    """One signed URL per file of the checkpoint at ``path``, and when they expire (unix seconds)."""
    urls, expires = {}, 0.0
    for relpath in files:
        token, expires = signer.sign(PURPOSE, tenant, URL_LIFETIME_S, path=str(path), file=relpath)
        # The file name after the token is for people and tools that name downloads by the URL; the token decides.
        urls[relpath] = f"{base_url.rstrip('/')}/api/v1/external_weights/{token}/{quote(relpath)}"
    return urls, expires


def verify(signer: Signer, token: str, relpath: str) -> dict[str, Any]:
    """The claims of a download token, if valid for ``relpath``; BadToken otherwise."""
    claims = signer.verify(token, PURPOSE)
    if claims.get("file") != relpath or not isinstance(claims.get("path"), str):
        raise BadToken("this URL was signed for another file")
    return claims


class ExternalWeights:
    """The gateway's two download calls, over its records and signer."""

    def __init__(self, records: Records, signer: Signer, checkpoint_dir: str) -> None:
        self.records = records
        self.signer = signer
        self.checkpoint_dir = checkpoint_dir

    def urls(self, tenant: str, run_id: str, checkpoint_id: str, base_url: str) -> dict[str, Any]:
        """``GET training_runs/{run}/checkpoints/external_weights/{name}/external_weights_urls``: Tinker's
        ``ExternalWeightsUrlsResponse`` (PathError for a path that is not an external one; NotFound for another
        tenant's, or a missing one; Unavailable when its files cannot be read here)."""
        path = TinkerPath.parse(f"tinker://{run_id}/{checkpoint_id}")
        if path.segment != SEGMENT:
            raise PathError(f"{path} is not an external weights checkpoint: download URLs are signed for "
                            f"tinker://<run>/external_weights/<name> (TrainingClient.save_weights_external)")
        record = publishing.readable(self.records, tenant, path)  # the tenant's own, or a published one
        if record is None:
            raise NotFound("checkpoint", str(path))
        files = archive_files(self.checkpoint_dir, str(record["directory"]))
        urls, expires = signed_urls(self.signer, base_url, tenant, path, files)
        if record.get("expires_at") is not None:  # a URL never outlives its checkpoint
            expires = min(expires, float(record["expires_at"]))
        return {"urls": urls, "expires": iso(expires)}

    def open(self, token: str, relpath: str) -> tuple[int, int]:
        """(descriptor, size) of the file a download URL names (BadToken, NotFound or Unavailable otherwise)."""
        claims = verify(self.signer, token, relpath)
        path = TinkerPath.parse(claims["path"])
        record = publishing.readable(self.records, str(claims["sub"]), path)
        if record is None:  # deleted, expired or unpublished since the URL was signed
            raise NotFound("checkpoint", claims["path"])
        return open_file(self.checkpoint_dir, str(record["directory"]), relpath)


# -- the routes' answers: errors as the HTTP statuses the SDK and the CLI expect ---------------------------------------

def answer_urls(weights: ExternalWeights, tenant: str, run_id: str, checkpoint_id: str,
                base_url: str) -> dict[str, Any]:
    from tinkerq.gateway.http_errors import HTTPError, not_found

    try:
        return weights.urls(tenant, run_id, checkpoint_id, base_url)
    except PathError as exc:
        raise HTTPError(400, str(exc)) from None
    except NotFound as exc:
        raise not_found(exc.what, exc.ident) from None
    except Unavailable as exc:
        raise HTTPError(404, str(exc)) from None


def answer_file(weights: ExternalWeights, token: str, relpath: str) -> tuple[int, int]:
    from tinkerq.gateway.http_errors import HTTPError

    try:
        return weights.open(token, relpath)
    except BadToken as exc:  # expired, altered, or for something else: ask get_external_weights_urls again
        raise HTTPError(403, f"download refused: {exc}") from None
    except NotFound:
        raise HTTPError(404, "this checkpoint was deleted or expired since the URL was signed") from None
    except Unavailable as exc:
        raise HTTPError(404, str(exc)) from None

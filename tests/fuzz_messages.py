"""Hostile and malformed messages for a worker's queues, generated from a seed (tests and the RSS benchmark).

Each kind is a function ``(rng, base) -> bytes`` where ``base`` is a well-formed Celery message of tinkerq
(as kombu's Redis transport stores it: JSON with a base64 body) aimed at a session that does not exist,
so a kind that happens to be valid only earns an error reply. The kinds cover every layer: Redis list
entry, kombu's JSON envelope, base64, Celery's headers and protocol, our msgpack, our request envelope.
"""

from __future__ import annotations

import base64
import copy
import json
import uuid
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from tinkerq.wire import codec, messages

Kind = Callable[[np.random.Generator, dict[str, Any]], bytes]


def base_message(inbox: str, queue: str, op: str = "forward") -> dict[str, Any]:
    """A well-formed message, as the producer posts it, for a session nobody holds."""
    envelope = messages.make_envelope(op, uuid.uuid4().hex, 1, {"inline": codec.packb({"data": []})})
    body = codec.packb([[envelope], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}])
    task_id = str(uuid.uuid4())
    return {
        "body": base64.b64encode(body).decode(),
        "content-encoding": "binary",
        "content-type": codec.CONTENT_TYPE,
        "headers": {"lang": "py", "task": f"tinkerq.{op}", "id": task_id, "shadow": None, "eta": None,
                    "expires": None, "group": None, "group_index": None, "retries": 0, "timelimit": [None, None],
                    "root_id": task_id, "parent_id": None, "argsrepr": "fuzz", "kwargsrepr": "{}",
                    "origin": "fuzz", "ignore_result": None, "replaced_task_nesting": 0, "stamped_headers": None,
                    "stamps": {}, messages.REPLY_HEADER: inbox},
        "properties": {"correlation_id": task_id, "reply_to": "", "delivery_mode": 2,
                       "delivery_info": {"exchange": "", "routing_key": queue}, "priority": 0,
                       "body_encoding": "base64", "delivery_tag": str(uuid.uuid4())},
    }


def _j(m: Any) -> bytes:
    return json.dumps(m).encode()


def _with(path: tuple[str, ...], value: Any) -> Kind:
    def make(rng: np.random.Generator, base: dict[str, Any]) -> bytes:
        m = copy.deepcopy(base)
        target = m
        for key in path[:-1]:
            target = target[key]
        if value is _DELETE:
            target.pop(path[-1], None)
        else:
            target[path[-1]] = value
        return _j(m)
    return make


def _body(raw: bytes) -> Kind:
    return _with(("body",), base64.b64encode(raw).decode())


_DELETE = object()
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def _random_bytes(rng: np.random.Generator, base: dict[str, Any]) -> bytes:
    return rng.bytes(int(rng.integers(0, 300)))


def _flipped(rng: np.random.Generator, base: dict[str, Any]) -> bytes:
    raw = bytearray(_j(base))
    for _ in range(int(rng.integers(1, 8))):
        raw[int(rng.integers(0, len(raw)))] = int(rng.integers(0, 256))
    return bytes(raw)


def _truncated(rng: np.random.Generator, base: dict[str, Any]) -> bytes:
    raw = _j(base)
    return raw[: int(rng.integers(0, len(raw)))]


def _random_body(rng: np.random.Generator, base: dict[str, Any]) -> bytes:
    return _body(rng.bytes(int(rng.integers(0, 200))))(rng, base)


def _envelope(patch: dict[str, Any]) -> Kind:
    def make(rng: np.random.Generator, base: dict[str, Any]) -> bytes:
        env = messages.make_envelope("forward", uuid.uuid4().hex, int(rng.integers(1, 5)),
                                     {"inline": codec.packb({"data": []})})
        env.update(patch)
        return _body(codec.packb([[env], {}, _EMBED]))(rng, base)
    return make


def _huge(rng: np.random.Generator, base: dict[str, Any]) -> bytes:
    m = copy.deepcopy(base)
    m["headers"]["argsrepr"] = "x" * (2 * 1024 * 1024)
    return _j(m)


KINDS: dict[str, Kind] = {
    "random-bytes": _random_bytes,
    "empty": lambda rng, base: b"",
    "not-json": lambda rng, base: b"{not json",
    "json-number": lambda rng, base: b"12345",
    "json-list": lambda rng, base: b"[1, 2, 3]",
    "json-string": lambda rng, base: b'"hello"',
    "json-null": lambda rng, base: b"null",
    "flipped-bytes": _flipped,
    "truncated": _truncated,
    "headers-string": _with(("headers",), "not a map"),
    "headers-list": _with(("headers",), [1, 2]),
    "no-headers": _with(("headers",), _DELETE),
    "task-list": _with(("headers", "task"), ["tinkerq.forward"]),
    "task-unknown": _with(("headers", "task"), "tinkerq.nope"),
    "task-chord-unlock": _with(("headers", "task"), "celery.chord_unlock"),
    "task-backend-cleanup": _with(("headers", "task"), "celery.backend_cleanup"),
    "id-int": _with(("headers", "id"), 12345),
    "id-path": _with(("headers", "id"), "../../etc/passwd"),
    "eta": _with(("headers", "eta"), "2099-01-01T00:00:00"),
    "expires": _with(("headers", "expires"), "garbage"),
    "timelimit-garbage": _with(("headers", "timelimit"), "forever"),
    "content-type-null": _with(("content-type",), None),
    "content-type-pickle": _with(("content-type",), "application/x-python-serialize"),
    "content-type-json": _with(("content-type",), "application/json"),
    "body-encoding-unknown": _with(("properties", "body_encoding"), "rot13"),
    "body-not-base64": _with(("body",), "!!! not base64 !!!"),
    "body-empty": _with(("body",), ""),
    "body-int": _with(("body",), 7),
    "no-properties": _with(("properties",), _DELETE),
    "properties-string": _with(("properties",), "x"),
    "delivery-tag-int": _with(("properties", "delivery_tag"), 5),
    "no-delivery-info": _with(("properties", "delivery_info"), _DELETE),
    "inbox-forged": _with(("headers", messages.REPLY_HEADER), "tinkerq.worker.someone-else"),
    "msgpack-map": _body(codec.packb({"a": 1})),
    "msgpack-one-item": _body(codec.packb([1])),
    "msgpack-list-65535": _body(b"\xdc\xff\xff" + b"\x01" * 5),
    "msgpack-garbage": _random_body,
    "msgpack-bad-ext": _body(msgpack.packb([[msgpack.ExtType(1, b"\x63\x00")], {}, _EMBED])),
    "chain-garbage": _body(codec.packb([[{}], {}, {**_EMBED, "chain": [{"task": "celery.backend_cleanup"}]}])),
    "callbacks": _body(codec.packb([[{}], {}, {**_EMBED, "callbacks": [{"task": "x"}]}])),
    "kwargs": _body(codec.packb([[{}], {"x": 1}, _EMBED])),
    "two-args": _body(codec.packb([[{}, {}], {}, _EMBED])),
    "envelope-not-map": _body(codec.packb([[[1, 2]], {}, _EMBED])),
    "envelope-model-id-path": _envelope({"model_id": "../../etc"}),
    "envelope-unknown-session": _envelope({}),
    "envelope-seq-negative": _envelope({"seq_id": -1}),
    "envelope-version": _envelope({"v": 99}),
    "envelope-blob-foreign": _envelope({"payload": {"blob": "tinkerq.worker.x"}}),
    "huge-message": _huge,
}


def fuzz_messages(seed: int, n: int, inbox: str, queue: str) -> list[tuple[str, bytes]]:
    """``n`` messages (kind, raw bytes): every kind at least once, then random kinds."""
    rng = np.random.default_rng(seed)
    names = list(KINDS)
    order = names + [names[int(i)] for i in rng.integers(0, len(names), size=max(0, n - len(names)))]
    out = []
    for name in order:
        ops = ("forward", "forward_backward", "optim_step", "create_model", "sample")
        base = base_message(inbox, queue, op=ops[int(rng.integers(0, len(ops)))])
        out.append((name, KINDS[name](rng, base)))
    return out

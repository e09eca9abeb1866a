"""Message intake: every message taken from a tinkerq queue is checked here before kombu or Celery sees it.

A worker must never die, or stop consuming, because of what somebody put in its queue. kombu's Redis
transport decodes the JSON envelope, then base64, then Celery reads headers and decodes the body; a defect
at any of these layers used to escape as an "Unrecoverable error" (the process exited) or leave a
delivery that was never acknowledged (the worker stayed registered but stopped consuming).

So the transport's read path is wrapped (:class:`GuardedChannel`): the raw bytes popped from Redis are
parsed and checked by :func:`inspect_message`, which rebuilds the message from the fields tinkerq sends,
with the types kombu and Celery expect. A message that fails any check, or that makes kombu or Celery
raise anyway, is *dead-lettered* (:class:`DeadLetters`): logged in one line, answered to its sender
when a task id and reply inbox can be read, and kept with its reason and (the head of) its bytes in the
bounded list ``tinkerq.dead``. A message redelivered more than ``max_deliveries`` times (it may crash
workers in a way nothing can catch, e.g. by exhausting memory) is dead-lettered before it is processed.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps as kombu_dumps
from redis.exceptions import ConnectionError as RedisConnectionError

from tinkerq import keys
from tinkerq.celery_app import TASK_NAMES
from tinkerq.errors import MalformedMessageError, TinkerqError
from tinkerq.redis_client import SentinelMasterConnection
from tinkerq.retry import is_transient
from tinkerq.settings import Settings
from tinkerq.store import KeyValueStore, Reply
from tinkerq.threads import NamedThread
from tinkerq.wire import codec, messages
from tinkerq.wire.codec import CONTENT_TYPE
from tinkerq.wire.messages import REPLY_HEADER

log = logging.getLogger("tinkerq.intake")

ALLOWED_TASKS = frozenset(TASK_NAMES.values())
_ID_RE = re.compile(r"^[A-Za-z0-9-]{1,64}$")
_KEEP_BYTES = 64 * 1024  # bytes of a dead message kept for inspection
_EMBED_KEYS = {"callbacks", "errbacks", "chain", "chord"}


class Refused(Exception):
    """A message that is not a tinkerq request; ``task_id``/``inbox`` are set when they could be read."""

    def __init__(self, reason: str, task_id: str | None = None, inbox: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.task_id = task_id
        self.inbox = inbox


def _text(value: Any, limit: int) -> str | None:
    return value[:limit] if isinstance(value, str) else None


def inspect_message(item: bytes | str, queue: str, settings: Settings) -> dict[str, Any]:
    """The message kombu should deliver, rebuilt from ``item`` (the raw list entry), or raise Refused."""
    size = len(item)
    if size > settings.max_inline_bytes:
        raise Refused(f"message of {size} bytes exceeds TINKERQ_MAX_INLINE_BYTES ({settings.max_inline_bytes}); "
                      f"large payloads travel by claim check")
    try:
        raw = json.loads(item)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Refused(f"message is not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise Refused(f"message is a JSON {type(raw).__name__}, not an object")
    headers = raw.get("headers")
    if not isinstance(headers, dict):
        raise Refused(f"message headers are a {type(headers).__name__}, not a map")
    task_id = headers.get("id") if isinstance(headers.get("id"), str) and _ID_RE.match(headers["id"]) else None
    inbox = headers.get(REPLY_HEADER)
    inbox = inbox if isinstance(inbox, str) and keys.REPLY_LIST_RE.match(inbox) else None

    def refuse(reason: str) -> Refused:
        return Refused(reason, task_id, inbox)

    if task_id is None:
        raise refuse(f"message has no valid task id (headers.id = {headers.get('id')!r:.80})")
    task = headers.get("task")
    if not isinstance(task, str) or task not in ALLOWED_TASKS:
        raise refuse(f"task {task!r:.100} is not a tinkerq operation (accepted: tinkerq.<op>)")
    content_type = raw.get("content-type")
    if content_type != CONTENT_TYPE:
        raise refuse(f"{task} message refused without being decoded: content type {content_type!r:.80} is not "
                     f"accepted (tinkerq accepts only {CONTENT_TYPE!r}; use the tinkerq producer)")
    for name in ("eta", "expires", "group", "shadow", "parent_id", "chord", "stamped_headers"):
        if headers.get(name) is not None:
            raise refuse(f"header {name!r} is not supported by tinkerq (got {headers[name]!r:.80})")
    properties = raw.get("properties")
    if not isinstance(properties, dict):
        raise refuse("message properties are missing")
    if properties.get("body_encoding") != "base64":
        raise refuse(f"body encoding {properties.get('body_encoding')!r:.80} is not supported (base64)")
    tag = properties.get("delivery_tag")
    if not isinstance(tag, str) or not _ID_RE.match(tag):
        raise refuse(f"delivery tag {tag!r:.80} is not valid")
    body = raw.get("body")
    if not isinstance(body, str):
        raise refuse("message body is not a base64 string")
    try:
        decoded = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise refuse(f"message body is not base64 ({exc})") from None
    try:
        args, kwargs, embed = _task_body(decoded)
    except MalformedMessageError as exc:
        raise refuse(f"task body is not a tinkerq request: {exc.message}") from None
    redelivered = bool(headers.get("redelivered")) or bool(
        isinstance(properties.get("delivery_info"), dict) and properties["delivery_info"].get("redelivered"))
    # Rebuilt from the fields tinkerq sends, with the types Celery expects: nothing else reaches Celery.
    canonical_headers: dict[str, Any] = {
        "lang": "py", "task": task, "id": task_id, "shadow": None, "eta": None, "expires": None, "group": None,
        "group_index": None, "retries": 0, "timelimit": [None, None], "root_id": task_id, "parent_id": None,
        "argsrepr": _text(headers.get("argsrepr"), 1024), "kwargsrepr": _text(headers.get("kwargsrepr"), 256),
        "origin": _text(headers.get("origin"), 256), "ignore_result": False, "replaced_task_nesting": 0,
        "stamped_headers": None, "stamps": {}, REPLY_HEADER: inbox,
    }
    if redelivered:
        canonical_headers["redelivered"] = True
    return {
        "body": body,
        "content-encoding": "binary",
        "content-type": CONTENT_TYPE,
        "headers": canonical_headers,
        "properties": {
            "correlation_id": task_id, "reply_to": "", "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue, **({"redelivered": True} if redelivered else {})},
            "priority": 0, "body_encoding": "base64", "delivery_tag": tag,
        },
        # Checked above; kept so the caller can count redeliveries without parsing again.
        "_tinkerq": {"redelivered": redelivered, "args": args, "kwargs": kwargs, "embed": embed},
    }


def _task_body(decoded: bytes) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    """Celery's protocol-2 body as tinkerq sends it: ``[[envelope], {}, {callbacks..: None}]``."""
    body = codec.unpackb(decoded)
    if not isinstance(body, list) or len(body) != 3:
        raise MalformedMessageError(f"expected [args, kwargs, embed], got a {type(body).__name__}"
                                    + (f" of {len(body)} items" if isinstance(body, list) else ""))
    args, kwargs, embed = body
    if not isinstance(args, list) or len(args) != 1:
        raise MalformedMessageError("a tinkerq task takes exactly one argument, the request envelope")
    if kwargs != {}:
        raise MalformedMessageError("a tinkerq task takes no keyword arguments")
    if not isinstance(embed, dict) or set(embed) - _EMBED_KEYS or any(v is not None for v in embed.values()):
        raise MalformedMessageError("callbacks, errbacks, chains and chords are not supported")
    return args, kwargs, embed


@dataclass(repr=False)
class DeadLetters:
    """Where refused messages go: a line in the log, an answer to the sender, an entry in tinkerq.dead."""

    store: KeyValueStore
    settings: Settings
    worker_id: str

    def __repr__(self) -> str:
        # It sits in the worker's transport options, which `celery inspect conf` and Flower's Config tab show:
        # the default repr would print the settings, the broker URL with its password among them.
        return f"DeadLetters(worker={self.worker_id})"

    def refuse(self, reason: str, raw: bytes | str | None, queue: str, task_id: str | None = None,
               inbox: str | None = None, *, answer: bool = True) -> None:
        """Log, answer (unless the caller answers itself) and keep a message no worker can use."""
        data = raw.encode("utf-8", "surrogateescape") if isinstance(raw, str) else (raw or b"")
        log.warning("dead-lettered a message on %s: %s (task id %s, %d bytes)", queue, reason[:300], task_id,
                    len(data))
        if task_id is not None and answer:
            error = MalformedMessageError(f"request refused by worker {self.worker_id}: {reason}")
            self.answer(task_id, inbox, messages.error_reply(error))
        entry = {"reason": reason, "queue": queue, "task_id": task_id, "worker": self.worker_id,
                 "host": socket.gethostname(), "at": time.time(), "size": len(data), "raw": data[:_KEEP_BYTES]}
        try:
            self.store.push(keys.DEAD_LETTERS, codec.packb(entry), max_len=self.settings.dead_letter_max)
        except TinkerqError as exc:
            log.error("could not keep the dead letter: %s", exc)

    def answer(self, task_id: str, inbox: str | None, reply: dict[str, Any]) -> None:
        try:
            store_reply(self.store, self.settings, task_id, inbox, reply)
        except TinkerqError as exc:
            log.error("could not answer %s: %s", task_id, exc)

    def too_many_deliveries(self, tag: str) -> int | None:
        """Count a redelivery of ``tag``; the count when it exceeds the limit, else None."""
        seen = self.store.count(keys.deliveries(tag), ttl_s=self.settings.visibility_timeout_s * 2)
        return seen if seen > self.settings.max_deliveries else None


def store_reply(store: KeyValueStore, settings: Settings, task_id: str, inbox: str | None,
                reply: dict[str, Any]) -> None:
    """Keep ``reply`` under the task's reply key and push it to the sender's inbox (retried through outages)."""
    store.write_many([reply_write(settings, task_id, inbox, reply)])


def reply_write(settings: Settings, task_id: str, inbox: str | None, reply: dict[str, Any]) -> Reply:
    """The store write that answers ``task_id``: its reply key, and the sender's inbox."""
    return Reply(keys.reply(task_id), codec.packb(reply), inbox, messages.make_reply_item(task_id, reply),
                 ttl_s=settings.result_ttl_s)


class DeferredQoS(kombu_redis.QoS):
    """kombu's Redis ack emulation, with its Redis writes taken off the consumer's thread.

    kombu records every message it delivers in its ``unacked`` hash (a transaction) and removes it when Celery
    acknowledges it (another), each a round trip the consumer waits for before it reads the next message: on a
    Redis 10 ms away, most of a small request's cost (docs/benchmarks.md section 20). Here the bookkeeping kombu
    keeps in memory (what counts against the prefetch window) is done at once, and the Redis writes go to a
    writer thread that sends whatever queued up in one pipeline; a record whose acknowledgement comes before
    it was written is never written. A tinkerq task only hands its request over (worker/transport/tasks.py), and a
    request is acknowledged at that hand-off; the producer sends again what a lost worker owed, so a record
    that a kill keeps from being written loses nothing. Everything that reads the records (requeueing a
    rejected message, restoring at shutdown) first waits for the writer.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._writes: dict[str, tuple[str, str | None]] = {}  # tag -> ("add", record) or ("remove", None)
        self._cond = threading.Condition()
        self._writing = False
        self._writer: threading.Thread | None = None

    def append(self, message: Any, delivery_tag: str) -> None:
        delivery = message.delivery_info
        record = kombu_dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
        with self._cond:
            self._writes[delivery_tag] = ("add", record)
            self._wake()
        virtual_qos_append(self, message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        with self._cond:
            if self._writes.get(delivery_tag, ("",))[0] == "add":
                del self._writes[delivery_tag]  # never written: nothing to remove
            else:
                self._writes[delivery_tag] = ("remove", None)
                self._wake()
        virtual_qos_ack(self, delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if not requeue:
            self.ack(delivery_tag)
            return
        self.flush()
        super().reject(delivery_tag, requeue=True)

    def restore_unacked(self, client: Any = None) -> None:
        self.flush()
        super().restore_unacked(client)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write reached Redis (False after ``timeout_s``)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._writes and not self._writing, timeout_s)

    def _wake(self) -> None:
        if self._writer is None or not self._writer.is_alive():
            self._writer = NamedThread(target=self._write_loop, name="tinkerq-unacked", daemon=True)
            self._writer.start()
        self._cond.notify_all()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: bool(self._writes), 60.0):
                    self._writer = None  # idle: a new one starts with the next write
                    return
                writes, self._writes = self._writes, {}
                self._writing = True
            try:
                self._write(writes)
            except Exception as exc:  # Redis away: put them back (newer ones win) and try again shortly
                log.warning("could not write kombu's unacked records (%d): %s", len(writes), exc)
                with self._cond:
                    self._writes = {**writes, **self._writes}
                time.sleep(0.5)
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def _write(self, writes: dict[str, tuple[str, str | None]]) -> None:
        with self.channel.conn_or_acquire() as client:
            pipe = client.pipeline()
            now = time.time()
            for tag, (kind, record) in writes.items():
                if kind == "add":
                    pipe.zadd(self.unacked_index_key, {tag: now}).hset(self.unacked_key, tag, record)
                else:
                    pipe.zrem(self.unacked_index_key, tag).hdel(self.unacked_key, tag)
            pipe.execute()


def virtual_qos_append(qos: Any, message: Any, delivery_tag: str) -> None:
    """kombu's in-memory bookkeeping of a delivered message (what the Redis QoS adds to it is deferred)."""
    super(kombu_redis.QoS, qos).append(message, delivery_tag)


def virtual_qos_ack(qos: Any, delivery_tag: str) -> None:
    super(kombu_redis.QoS, qos).ack(delivery_tag)


@dataclass(frozen=True)
class IntakeBatch:
    """Which queues one pop may take several messages from, and how many (transport option
    ``tinkerq_intake_batch``; the worker sets it to its own queue and ``TINKERQ_INTAKE_BATCH``)."""

    queues: frozenset[str]
    count: int


class GuardedChannel(kombu_redis.Channel):
    """kombu's Redis channel, with every message from a tinkerq queue checked before it is delivered, its ack
    emulation's writes off the consumer's thread (:class:`DeferredQoS`), and several messages of the worker's own
    queue taken in one round trip.

    kombu pops one message per BRPOP and, with Celery's prefetch of 1, sends the next BRPOP only once the last
    message was acknowledged (at its hand-off to the scheduler): one round trip per message, in series, which
    on a Redis 10 ms away was most of a small pipelined step (docs/benchmarks.md section 20). Redis 7's BLMPOP
    pops up to N messages of the first non-empty queue in one round trip; all are delivered, in order, at once.
    Only the worker's own queue is popped so: the model's queue is shared by every worker of the model, and a
    busy worker must not hold create_model messages another would build, so what a pop took from it beyond
    the first goes back, oldest next, in the same read.
    """

    QoS = DeferredQoS
    _pop_command = "BRPOP"
    _blmpop_known: bool | None = None  # whether the server has BLMPOP (Redis >= 7); None: not asked yet

    def _dead_letters(self) -> DeadLetters | None:
        return self.connection.client.transport_options.get("tinkerq_dead_letters")

    def _batch(self) -> IntakeBatch | None:
        batch = self.connection.client.transport_options.get("tinkerq_intake_batch")
        if batch is None or batch.count <= 1 or self.global_keyprefix:  # kombu prefixes BRPOP's keys only
            return None
        if self._blmpop_known is None:
            try:
                with self.conn_or_acquire() as client:
                    version = str(client.info("server").get("redis_version", "0"))
                self._blmpop_known = int(version.split(".")[0]) >= 7
            except Exception:  # Redis away: plain BRPOP now, ask again next time
                return None
        return batch if self._blmpop_known else None

    def _brpop_start(self, timeout: Any = None) -> None:
        batch = self._batch()
        if batch is None:
            self._pop_command = "BRPOP"
            super()._brpop_start(timeout)
            return
        # kombu's _brpop_start (5.7), with BLMPOP: the same keys in the same order (its rotation between queues).
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        keys_ = [self._q_for_pri(queue, pri) for pri in self.priority_steps for queue in queues]
        self._in_poll = self.client.connection
        self._brpop_sent_at = time.monotonic()  # type: ignore[assignment]  # kombu declares it None
        self._pop_command = "BLMPOP"
        timeout = self.brpop_timeout if timeout is None else timeout
        self.client.connection.send_command("BLMPOP", timeout or 0, len(keys_), *keys_, "RIGHT", "COUNT",
                                            batch.count)

    def _brpop_read(self, **options: Any) -> bool:
        # kombu's own read, minus the JSON decoding, which moves into _deliver_raw (kombu 5.7 structure).
        try:
            try:
                dest__item = self.client.parse_response(self.client.connection, self._pop_command, **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            except self.ResponseError as exc:
                if not is_transient(exc):
                    raise
                # The node stopped being a writable primary under this BRPOP: a demotion after a failover
                # answers every blocked client "UNBLOCKED ... (master -> replica?)" (then READONLY, or LOADING
                # while it syncs). kombu would let that escape as a channel error, which Celery treats as
                # unrecoverable: the worker exited. It is a lost connection: Celery reconnects, through the
                # sentinels, to the new primary.
                log.warning("Redis answered the consumer's %s with %s: reconnecting", self._pop_command, str(exc)[:200])
                self.client.connection.disconnect()
                raise RedisConnectionError(f"Redis answered {self._pop_command} with: {exc}") from exc
            if not dest__item:
                raise kombu_redis.Empty()
            key, popped = dest__item
            items = list(popped) if self._pop_command == "BLMPOP" else [popped]  # BLMPOP: oldest first
            dest = kombu_redis.bytes_to_str(key).rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(dest)
            batch = self._batch()
            if len(items) > 1 and (batch is None or dest not in batch.queues):
                self._give_back(key, items[1:])
                items = items[:1]
            for i, item in enumerate(items):
                try:
                    self._deliver_raw(item, dest)
                except BaseException:
                    self._give_back(key, items[i + 1:])
                    raise
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]  # as kombu's own _brpop_read leaves it
            getattr(self, "_flush_brpop_reauth", lambda: None)()  # kombu >= 5.7 re-auth hook

    def _give_back(self, key: bytes | str, items: list[bytes]) -> None:
        """Put popped, undelivered messages back at the consuming end of ``key``, the oldest to be popped next."""
        if not items:
            return
        try:
            with self.conn_or_acquire() as client:
                client.rpush(key, *reversed(items))
        except Exception as exc:  # lost as a killed worker's would be: their producers send them again
            log.error("could not put %d popped messages back on %s: %s", len(items),
                      kombu_redis.bytes_to_str(key), exc)

    def _get(self, queue: str, timeout: Any = None) -> dict[str, Any]:
        # The polling path (basic_get): the same checks; a refused message is reported as "nothing there".
        with self.conn_or_acquire() as client:
            for pri in self.priority_steps:
                item = client.rpop(self._q_for_pri(queue, pri))
                if item:
                    message = self._checked(item, queue)
                    if message is not None:
                        return message
        raise kombu_redis.Empty()

    def _checked(self, item: bytes, queue: str) -> dict[str, Any] | None:
        dead = self._dead_letters()
        if dead is None or not queue.startswith(keys.PREFIX + "."):
            try:  # Celery's own queues (remote control replies): kombu's decoding, but never fatal
                return kombu_redis.loads(kombu_redis.bytes_to_str(item))
            except Exception as exc:
                log.warning("dropped an unreadable message on %s: %s", queue, exc)
                return None
        try:
            message = inspect_message(item, queue, dead.settings)
        except Refused as exc:
            dead.refuse(exc.reason, item, queue, exc.task_id, exc.inbox)
            return None
        except Exception as exc:  # a defect the checks did not foresee: still only this message's problem
            dead.refuse(f"the message could not be inspected ({type(exc).__name__}: {str(exc)[:200]})", item, queue)
            return None
        extra = message.pop("_tinkerq")
        if extra["redelivered"]:
            seen = dead.too_many_deliveries(message["properties"]["delivery_tag"])
            if seen is not None:
                dead.refuse(f"delivered {seen} times without being answered (it may crash workers)", item, queue,
                            message["headers"]["id"], message["headers"][REPLY_HEADER])
                return None
        return message

    def _deliver_raw(self, item: bytes, queue: str) -> None:
        message = self._checked(item, queue)
        if message is None:
            return
        try:
            self.connection._deliver(message, queue)
        except self.connection_errors:
            raise
        except Exception as exc:  # kombu or Celery failed on a message that passed our checks: still not fatal
            dead = self._dead_letters()
            tag = message["properties"]["delivery_tag"]
            if tag in self.qos._delivered:  # it reached the unacked set: remove it, it must not come back
                try:
                    self.qos.ack(tag)
                except Exception as ack_exc:
                    log.error("could not acknowledge refused message %s: %s", tag, ack_exc)
            reason = f"the worker could not take this message ({type(exc).__name__}: {str(exc)[:200]})"
            if dead is not None:
                dead.refuse(reason, item, queue, message["headers"]["id"], message["headers"][REPLY_HEADER])
            else:
                log.error("dropped a message on %s: %s", queue, reason)


class GuardedTransport(kombu_redis.Transport):
    Channel = GuardedChannel


class GuardedSentinelChannel(GuardedChannel, kombu_redis.SentinelChannel):
    # Reconnects go through the sentinels (tinkerq.redis_client.SentinelMasterConnection): with kombu's
    # default class, the consumer's restore of unacknowledged messages spun forever on a demoted primary.
    connection_class = SentinelMasterConnection


class GuardedSentinelTransport(kombu_redis.SentinelTransport):
    Channel = GuardedSentinelChannel


def transport_for(broker_url: str) -> str:
    """The guarded transport class for a broker URL (kombu resolves ``module:Class``)."""
    if broker_url.startswith("sentinel://"):
        return "tinkerq.worker.transport.intake:GuardedSentinelTransport"
    return "tinkerq.worker.transport.intake:GuardedTransport"

"""Every Redis key and queue name tinkerq uses, in one place (so operators can find them)."""

from __future__ import annotations

import hashlib
import re

PREFIX = "tinkerq"


def model_key(base_model: str) -> str:
    """A short stable name for a served model: readable tail + hash of the full name."""
    tail = re.sub(r"[^A-Za-z0-9_.-]+", "-", base_model.rstrip("/").rsplit("/", 1)[-1])[:40] or "model"
    digest = hashlib.sha1(base_model.encode()).hexdigest()[:10]
    return f"{tail}-{digest}"


def model_queue(base_model: str) -> str:
    """Queue a worker serving ``base_model`` listens on for new training sessions."""
    return f"{PREFIX}.model.{model_key(base_model)}"


def worker_queue(worker_id: str) -> str:
    """A worker's own queue: every request of a session goes to the worker that holds it."""
    return f"{PREFIX}.worker.{worker_id}"


def sample_queue(worker_id: str) -> str:
    """A worker's sampling intake: a Redis list of sample requests, read by its own thread, not by Celery
    (so a sample never waits behind training requests in Celery's single slot)."""
    return f"{PREFIX}:samples:{worker_id}"


def publish_queue(worker_id: str) -> str:
    """Requests from other workers to publish the weights of snapshots this worker made (worker/sampling/snapshots.py);
    read by a thread of their own, so two workers waiting on each other's snapshots never deadlock."""
    return f"{PREFIX}:publish:{worker_id}"


def blob(blob_id: str) -> str:
    """A claim-checked payload (raw bytes, with a TTL)."""
    return f"{PREFIX}:blob:{blob_id}"


def snapshot(snapshot_id: str) -> str:
    """A published sampling snapshot (msgpack: its base model, and its weights or the file holding them)."""
    return f"{PREFIX}:snapshot:{snapshot_id}"


def serving(base_model: str, worker_id: str) -> str:
    """A worker's heartbeat registration for the model it serves (JSON, with a TTL)."""
    return f"{PREFIX}:serving:{model_key(base_model)}:{worker_id}"


def serving_pattern(base_model: str | None = None) -> str:
    return f"{PREFIX}:serving:{model_key(base_model) if base_model else '*'}:*"


# -- replies, liveness, dead letters ----------------------------------------------------------------------

def auto_snapshot(model_id: str) -> str:
    """JSON: a training session's latest automatic snapshot (path, request position, time, worker)."""
    return f"{PREFIX}:autosnapshot:{model_id}"


def session_home(model_id: str) -> str:
    """JSON: where a training session lives {model_id, base_model, worker, lora}; rewritten by an adopter."""
    return f"{PREFIX}:session:{model_id}"


SESSION_HOME_PATTERN = f"{PREFIX}:session:*"


def journal(model_id: str) -> str:
    """A list (LPUSH, newest first) of msgpack maps {seq, op, body, reply}: every request a session applied
    since its latest automatic snapshot, replayed by a worker adopting the session."""
    return f"{PREFIX}:journal:{model_id}"


def session_claim(model_id: str) -> str:
    """A claim (SET NX, value: the worker id) taken before a training session is built: whichever worker gets
    a ``create_model`` first builds it; a duplicate delivery elsewhere builds nothing."""
    return f"{PREFIX}:created:{model_id}"


def adopting(model_id: str) -> str:
    """A claim (SET NX, value: the worker id): this worker is adopting the session."""
    return f"{PREFIX}:adopting:{model_id}"


def reply(task_id: str) -> str:
    """A request's answer, kept for ``result_ttl_s`` (read back by a producer after a Redis outage)."""
    return f"{PREFIX}:reply:{task_id}"


def reply_list(client_id: str) -> str:
    """A producer's inbox: workers LPUSH every answer for it here, the producer BLPOPs (survives blips)."""
    return f"{PREFIX}:replies:{client_id}"


REPLY_LIST_RE = re.compile(rf"^{PREFIX}:replies:[0-9a-f]{{32}}$")

# Workers' liveness: member = worker id, score = Redis server time of its last heartbeat. One ZRANGE tells a
# producer the age of every worker at once.
HEARTBEATS = f"{PREFIX}:heartbeats"

# Messages no worker could read: a bounded list of msgpack maps (reason, queue, raw bytes...).
DEAD_LETTERS = f"{PREFIX}.dead"


def deliveries(delivery_tag: str) -> str:
    """How many times a redelivered message has been seen (poison-message counter, with a TTL)."""
    return f"{PREFIX}:deliveries:{delivery_tag}"


REAPER_LOCK = f"{PREFIX}:reaper"

# kombu's Redis transport (default transport options): delivered, unacknowledged messages and their times.
KOMBU_UNACKED = "unacked"
KOMBU_UNACKED_INDEX = "unacked_index"

# -- the HTTP gateway's records (gateway/records.py) ------------------------------------------------------

GATEWAY_TABLES = ("session", "run", "sampler", "checkpoint", "future")


def gateway_record(table: str, ident: str) -> str:
    """One of the gateway's tenant-owned JSON records: a session, a training run, a sampling session, a future
    (by their ids) or a checkpoint (by its ``tinker://`` path)."""
    assert table in GATEWAY_TABLES, table
    return f"{PREFIX}:gw:{table}:{ident}"


def gateway_records_pattern(table: str, id_prefix: str = "") -> str:
    """A SCAN pattern for every record of ``table`` whose id starts with ``id_prefix`` (taken literally)."""
    return gateway_record(table, re.sub(r"([\[\]*?\\])", r"\\\1", id_prefix) + "*")


# Every gateway of a fleet shares these (gateway/futures.py): a future's answer (msgpack, once it is ready), the
# request body an unposted future still needs, first-come claims (a training run's sequence id, a create, the
# adoption of a lost gateway's future), the gateways' heartbeats, and the channel that announces answers.
GATEWAY_HEARTBEATS = f"{PREFIX}:gw:heartbeats"
GATEWAY_ANSWERS = f"{PREFIX}:gw:answers"
# Sorted sets, member = a training run's model id: its highest SDK seq_id (so an unload comes after every request
# taken for it, on any gateway), and the epoch seconds of its last request.
GATEWAY_RUN_TOPS = f"{PREFIX}:gw:tops"
GATEWAY_LAST_REQUEST = f"{PREFIX}:gw:last_request"


def gateway_answer(request_id: str) -> str:
    return f"{PREFIX}:gw:answer:{request_id}"


def gateway_body(request_id: str) -> str:
    return f"{PREFIX}:gw:body:{request_id}"


def gateway_claim(what: str) -> str:
    return f"{PREFIX}:gw:claim:{what}"


def gateway_run_metrics(model_id: str) -> str:
    """A training run's metrics, one hash field per SDK seq_id (gateway/run_metrics.py): the console's curves."""
    return f"{PREFIX}:gw:metrics:{model_id}"


def gateway_signing_secret() -> str:
    """The fleet's secret for the gateway's signed tokens (download URLs, exchanged credentials): random bytes,
    made once by the first gateway that needs them (gateway/signing.py). Deleting it ends every outstanding token."""
    return f"{PREFIX}:gw:signing-secret"


def gateway_session_trace(session_id: str) -> str:
    """A list: one JSON event per answered request of a session (gateway/session_trace.py), for its trace export."""
    return f"{PREFIX}:gw:trace:{session_id}"


def audit_log(tenant: str) -> str:
    """A list: a tenant's audit events, newest first (tinkerq/audit.py): keys, checkpoints, publishing, projects."""
    return f"{PREFIX}:audit:{tenant}"


# -- API keys of the HTTP gateway (tinkerq/tenants.py) ---------------------------------------------------
# Only SHA-256 digests of keys are stored, never a key. A hash: tenant name -> hex digest of its live key
# (one key per tenant; ``tinkerq keys list`` / ``revoke`` work by name).
TENANTS = f"{PREFIX}:tenants"


def api_key(digest: str) -> str:
    """One live API key, by the hex SHA-256 of the key: a hash {tenant, created_at, last_used_at}."""
    return f"{PREFIX}:apikey:{digest}"


# -- quotas and usage of the gateway's tenants (tinkerq/quotas.py, tinkerq/usage.py) ---------------------------
# A tenant's limits are fields of its API key's record (api_key above), so they go with the key when it is revoked.

def training_clients(tenant: str) -> str:
    """A sorted set: the training runs (model ids) a tenant holds open, counted against max_training_clients."""
    return f"{PREFIX}:quota:training:{tenant}"


def samples_inflight(tenant: str) -> str:
    """A sorted set: a tenant's sample requests in flight, scored by when their lease ends (Redis time)."""
    return f"{PREFIX}:quota:sampling:{tenant}"


def token_bucket(tenant: str) -> str:
    """A tenant's token rate limit: its GCRA theoretical arrival time (epoch seconds), with a TTL."""
    return f"{PREFIX}:quota:tokens:{tenant}"


def run_schedule(tenant: str, run_id: str) -> str:
    """The time (epoch seconds) a tenant's training run's latest request was scheduled for, with a TTL: a run's
    requests are posted in the order they were accepted."""
    return f"{PREFIX}:quota:run:{tenant}:{run_id}"


# A hash: tenant name -> the latest hour (epoch seconds) it has usage for (kept after its key is revoked).
USAGE_TENANTS = f"{PREFIX}:usage:tenants"


def usage_hours(tenant: str) -> str:
    """A sorted set: the hours (UTC hour starts, epoch seconds) a tenant has usage for, member = score."""
    return f"{PREFIX}:usage:hours:{tenant}"


def usage_hour(tenant: str, hour: int) -> str:
    """A hash: one tenant's usage in one UTC hour, field ``<session id>|<counter>`` -> count (with a TTL)."""
    return f"{PREFIX}:usage:hour:{tenant}:{hour}"


def usage_once(request_id: str) -> str:
    """A marker (with a TTL): the usage of this request was recorded (so a second answer is not counted again)."""
    return f"{PREFIX}:usage:once:{request_id}"

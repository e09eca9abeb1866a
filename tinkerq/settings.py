"""Settings: one typed object, built in one place from arguments and ``TINKERQ_*`` environment.

Every other module takes a :class:`Settings`; nothing else reads the environment.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tinkerq.errors import UserError

ENV_PREFIX = "TINKERQ_"
MEMORY_BROKER = "memory://"
NO_BROKER = "no broker configured: set TINKERQ_BROKER_URL=redis://:PASSWORD@host:6379/0 (or pass --broker)"


class SettingsError(UserError):
    """A setting has a value that cannot work; the message names the variable and the fix."""


@dataclass(frozen=True)
class Settings:
    # Where messages travel. None means "not configured": commands that can, run an embedded fleet.
    broker_url: str | None = None
    # The Sentinel master (`sentinel monitor NAME ...`) that sentinel:// URLs resolve (docs/redis.md).
    sentinel_master: str = "mymaster"
    # TLS for rediss:// URLs, PEM files: the CA that signed the server's certificate (empty: the system's
    # trusted CAs), and a client certificate + key if the server asks for one (tls-auth-clients).
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # Payloads larger than this travel as separate Redis values referenced from the message
    # (claim check) instead of inside kombu's base64 JSON envelope.
    claim_check_bytes: int = 16 * 1024
    # Time to live of claim-checked payloads and of results in the backend.
    blob_ttl_s: int = 3600
    result_ttl_s: int = 3600
    # Hard limits on a single request; larger ones are refused with a user error.
    max_message_bytes: int = 256 * 1024 * 1024
    # The HTTP gateway (docs/gateway.md): how long a retrieve_future call is held before it answers
    # try_again (the SDK re-polls at once, and gives up on a call after 45 s), and how long finished
    # results stay retrievable.
    gateway_poll_s: float = 25.0
    gateway_keep_s: float = 600.0
    # How long a create_model waits (its polls saying paused_capacity) while no worker can take the session,
    # before it answers the workers' refusal.
    gateway_capacity_wait_s: float = 3600.0
    # A session whose SDK sent no heartbeat for this long (it sends one every 10 s) is gone: when its API key is at
    # max_training_clients, its training runs are closed to make room.
    gateway_session_stale_s: float = 300.0
    # 1: the gateway's client/config turns the SDK's token exchange on (pjwt_auth_enabled): the SDK trades its API key
    # for a short-lived signed token (POST auth/token) and sends that instead; `whoami` reads it. 0: API keys only.
    gateway_token_exchange: int = 1
    # 1: client/config lets the SDK use its pyqwest (Rust) HTTP transport. 0 (default): httpx. pyqwest 0.12 can abort
    # the SDK's process at exit (SIGABRT, about 1 run in 60 of `tinker` commands on a loaded machine: its tokio thread
    # hands a reply to an interpreter that is finalising), it ignores SSL_CERT_FILE, and it measured no faster here.
    gateway_sdk_pyqwest: int = 0
    max_datums: int = 8192
    max_batch_tokens: int = 4 * 1024 * 1024
    # Seconds a producer waits for the broker to answer before failing.
    connect_timeout_s: float = 5.0
    # Seconds to wait for a worker to open a training session (the model must be served).
    create_timeout_s: float = 120.0
    # How often workers refresh their "I serve model X" registration, and how long it lives.
    heartbeat_s: float = 5.0
    # Long tasks must not be redelivered while they run (field-notes: visibility_timeout).
    visibility_timeout_s: int = 12 * 3600
    # How long a producer keeps retrying Redis through an outage (restart, failover, pause) before its
    # pending requests fail with BrokerUnavailableError. Workers retry for visibility_timeout_s: after that
    # the request would be delivered again anyway.
    redis_retry_s: float = 600.0
    # A session's oldest pending request is posted again when the session has had no answer for this long:
    # a message or reply lost without any visible error (a Sentinel failover writes briefly to the demoted
    # primary) must not hang the session. A repeat is answered from the worker's kept replies, never re-applied.
    resend_after_s: float = 15.0
    # A message (kombu envelope) larger than this is dead-lettered unread: requests carry large payloads
    # by claim check, so a real message is a few KiB.
    max_inline_bytes: int = 1024 * 1024
    # Messages no worker can read are kept, newest first, in the list tinkerq.dead (`tinkerq dead`).
    dead_letter_max: int = 1000
    # Messages a worker takes off its own queue in one round trip to Redis (BLMPOP; Redis >= 7, else one at a
    # time). 1: one per round trip, as kombu does. The model's shared queue is always taken one at a time.
    intake_batch: int = 16
    # A message redelivered this many times without being answered is dead-lettered (a poison message
    # that kills workers must not kill their replacements too).
    max_deliveries: int = 3
    # -- worker options ----------------------------------------------------------------------------------
    # torch device and dtype a worker holds its model in. dtype "auto": the checkpoint's own dtype (bfloat16 for
    # the published checkpoints) on a CUDA device with native bfloat16, float32 on the CPU; the worker resolves
    # it against the checkpoint and device (worker/loading/dtypes.py) and reports what it chose.
    device: str = "cpu"
    dtype: str = "auto"
    # A quantized checkpoint's base (block FP8, MXFP4, INT4): "dequantize" holds it in ``dtype``; "keep" holds
    # it as stored, each layer dequantized when used (LoRA sessions and sampling only; docs/quantized.md).
    quantized_base: str = "dequantize"
    # Full-parameter training sessions (each a full copy of weights + AdamW state) one worker holds at once.
    max_sessions: int = 4
    # -- LoRA sessions (docs/lora.md): adapters over one shared frozen base -------------------------------
    # LoRA sessions one worker holds at once; within this, memory decides (each adapter's weights,
    # gradients and AdamW state, 16 bytes per parameter, must fit beside everything else).
    max_lora_sessions: int = 256
    # Largest LoRA rank a client may ask for.
    max_lora_rank: int = 256
    # LoRA requests of different sessions waiting at a worker run as one forward/backward pass of at most
    # this many datums (and TINKERQ_MICROBATCH_TOKENS padded tokens per micro-batch).
    lora_batch_max_datums: int = 1024
    # Sampling snapshots published per training session (save_weights_and_get_sampling_client): older ones
    # are unpublished, and sampling from them is refused (docs/sampling.md).
    max_samplers: int = 2
    # -- sampling (docs/sampling.md) -----------------------------------------------------------------------
    # "trainer" serves training sessions and sampling; "sampler" serves sampling only (no optimizer state).
    role: str = "trainer"
    # 1: torch.use_deterministic_algorithms (and cuBLAS's fixed workspace) in workers. On a GPU, bfloat16 kernels
    # may otherwise reduce in a different order from run to run, so an adopted session's replay drifts from
    # the lost worker's run (docs/reliability.md measures it); float32 and the CPU are bitwise without it.
    deterministic: int = 0
    # Rows (sequences) one worker decodes together at most; more requests wait their turn between steps.
    sample_max_rows: int = 512
    # Per-request limits, refused with a user error before anything runs.
    max_num_samples: int = 256
    max_sample_tokens: int = 8192
    # Snapshots a worker keeps loaded for sampling (LRU; also bounded by free memory).
    sampler_cache_size: int = 4
    # Published snapshots up to this size travel through Redis; larger ones are written below the
    # checkpoint directory (which every worker of the model must then share).
    snapshot_inline_max_bytes: int = 64 * 1024 * 1024
    # How long a published snapshot stays loadable by other workers.
    snapshot_ttl_s: int = 6 * 3600
    # Automatic snapshots of every training session (docs/reliability.md): its whole state is written to
    # <checkpoint_dir>/<model_id>/state/.auto after every this many optimizer steps (0: never), so a lost
    # worker costs at most that many steps; the WorkerLostError names it.
    auto_snapshot_steps: int = 10
    # ... and kept this long after the latest one (the worker's expiry sweep removes it; closing the training
    # client removes it at once).
    auto_snapshot_ttl_s: int = 7 * 24 * 3600
    # Adoption (docs/reliability.md): every request a session applies is also appended to its journal in Redis
    # until the next automatic snapshot; past this many entries a snapshot is taken at once, so a workload
    # without optimizer steps keeps a bounded journal too. 0: no journal, no session record, no adoption.
    journal_max_entries: int = 256
    # How long a producer whose session's worker was lost waits for another worker to adopt the session
    # (replaying snapshot + journal) before its pending requests fail with WorkerLostError.
    adopt_timeout_s: float = 30.0
    # Sessions idle this long may be closed to make room for a new one (released instead, like below, when
    # journaling is on: the session can come back).
    session_idle_ttl_s: float = 1800.0
    # Idle release (docs/reliability.md): a training session that has had no request for this long is released
    # from its worker's memory: snapshotted, dropped, and recorded as parked; its client's next request restores
    # it (the adoption path), with the same numbers. With journaling off (TINKERQ_JOURNAL_MAX_ENTRIES=0) a
    # released session cannot come back and its next request fails saying so. 0: never released.
    session_release_idle_s: float = 3600.0
    # A request that waits this long for a missing predecessor fails (with every request after it), and
    # the session refuses further work: its order can no longer be kept. Bounded, never a silent hang.
    gap_timeout_s: float = 300.0
    # Port of the worker's own Prometheus endpoint (tokens, queue wait, tokens/s); 0 = off.
    metrics_port: int = 0
    # Loss head: auto (apex on CUDA when installed, else chunked torch), apex, torch, or reference.
    loss_backend: str = "auto"
    # Padded tokens per forward/backward pass; larger batches run as several micro-batches (gradients sum).
    microbatch_tokens: int = 16384
    # Activation checkpointing per decoder layer in forward_backward (one more forward, far less memory): "auto"
    # only for a batch whose activations would not fit otherwise, "on" always, "off" never (docs/planning.md).
    activation_checkpointing: str = "auto"
    # A shard group of a mixture-of-experts model: each rank holds E/N of every MoE layer's routed experts, and
    # tokens travel to them by all-to-all, instead of every rank gathering whole MoE layers (FSDP2). Full sessions
    # (worker/sharding/experts.py); LoRA bases keep FSDP's layout.
    expert_parallel: bool = False
    # Operator's cap on the worker process's own memory (RSS), MiB; 0 = no cap. New sessions, sampler
    # snapshots, sample requests and batches that would take it past the cap (or past what the host,
    # its cgroup or the device has free) are refused before anything is allocated (worker/memory/).
    memory_limit_mb: int = 0
    # Local state: the demo model, and checkpoints unless checkpoint_dir says otherwise.
    home: str = str(Path.home() / ".cache" / "tinkerq")
    # Where workers write weights (save_weights_for_sampler); must be shared by workers and users.
    # Empty: <home>/checkpoints.
    checkpoint_dir: str = ""
    # -- sharded models (docs/sharding.md) -----------------------------------------------------------------
    # A model served by N processes, each holding 1/N of the parameters, gradients and AdamW state.
    # Rank 0 is the Celery worker; ranks 1..N-1 follow it. All ranks name the same rendezvous: rank 0's
    # host and a free port, tcp://host:port.
    shards: int = 1
    shard_rank: int = 0
    rendezvous: str = ""
    # Seconds the ranks wait for each other when a group forms; then they say which ranks are missing.
    rendezvous_timeout_s: float = 300.0
    # Seconds any one collective may wait for a peer: a dead or hung shard fails requests within this.
    collective_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.checkpoint_dir:
            object.__setattr__(self, "checkpoint_dir", str(Path(self.home) / "checkpoints"))

    @property
    def is_embedded(self) -> bool:
        return self.broker_url is None or self.broker_url.startswith("memory://")

    def require_broker(self) -> str:
        """The broker URL, for commands that only make sense against a running fleet (a worker, the gateway,
        keys, healthcheck): without one they would run on an empty in-process fleet and answer nonsense."""
        if self.broker_url is None:
            raise SettingsError(NO_BROKER)
        return self.broker_url

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Defaults, then ``TINKERQ_<FIELD>`` variables, then explicit non-None ``overrides``."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None or raw == "":
                continue
            values[f.name] = _parse(f.name, raw, f.type)
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise SettingsError(f"unknown settings: {sorted(unknown)}")
        settings = cls(**values)
        settings.check()
        return settings

    def check(self) -> None:
        for name in ("claim_check_bytes", "blob_ttl_s", "result_ttl_s", "max_message_bytes", "max_datums",
                     "max_inline_bytes", "dead_letter_max", "intake_batch", "max_deliveries", "redis_retry_s",
                     "resend_after_s", "max_batch_tokens", "max_sessions", "max_lora_sessions", "max_lora_rank",
                     "lora_batch_max_datums", "microbatch_tokens", "max_samplers", "sample_max_rows",
                     "max_num_samples", "max_sample_tokens", "sampler_cache_size", "snapshot_ttl_s", "gateway_poll_s",
                     "gateway_keep_s", "gateway_capacity_wait_s", "gateway_session_stale_s"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{ENV_PREFIX}{name.upper()} must be positive, got {getattr(self, name)}")
        if self.shards < 1 or not 0 <= self.shard_rank < self.shards:
            raise SettingsError(
                f"shard rank {self.shard_rank} does not fit {self.shards} shards: ranks are 0..{self.shards - 1}"
            )
        if self.shards > 1 and not _is_tcp_address(self.rendezvous):
            raise SettingsError(
                f"a model in {self.shards} shards needs a rendezvous: pass --rendezvous tcp://HOST:PORT (rank "
                f"0's host and a free port, the same on every rank) or set TINKERQ_RENDEZVOUS"
                + (f"; got {self.rendezvous!r}" if self.rendezvous else "")
            )
        if self.auto_snapshot_steps < 0:
            raise SettingsError(f"{ENV_PREFIX}AUTO_SNAPSHOT_STEPS must be 0 (off) or positive, got "
                                f"{self.auto_snapshot_steps}")
        if self.journal_max_entries < 0:
            raise SettingsError(f"{ENV_PREFIX}JOURNAL_MAX_ENTRIES must be 0 (off) or positive, got "
                                f"{self.journal_max_entries}")
        if self.session_release_idle_s < 0:
            raise SettingsError(f"{ENV_PREFIX}SESSION_RELEASE_IDLE_S must be 0 (off) or positive, got "
                                f"{self.session_release_idle_s}")
        for name in ("rendezvous_timeout_s", "collective_timeout_s", "auto_snapshot_ttl_s", "adopt_timeout_s"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{ENV_PREFIX}{name.upper()} must be positive, got {getattr(self, name)}")
        if self.role not in ("trainer", "sampler"):
            raise SettingsError(f"TINKERQ_ROLE must be trainer or sampler, got {self.role!r}")
        if self.activation_checkpointing not in ("auto", "on", "off"):
            raise SettingsError(f"TINKERQ_ACTIVATION_CHECKPOINTING must be auto, on or off, got "
                                f"{self.activation_checkpointing!r}")
        if self.expert_parallel and self.shards < 2:
            raise SettingsError("--expert-parallel splits a MoE model's experts over a shard group: use --shards N "
                                "(N > 1), or leave it out")
        if self.quantized_base not in ("dequantize", "keep"):
            raise SettingsError(f"TINKERQ_QUANTIZED_BASE must be dequantize or keep, got {self.quantized_base!r}")
        if self.quantized_base == "keep" and self.shards > 1 and not self.expert_parallel:
            raise SettingsError("--quantized-base keep on a shard group keeps a MoE model's routed experts as stored, "
                                "split by expert: add --expert-parallel, or use --quantized-base dequantize (or "
                                "--shards 1)")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise SettingsError(f"TINKERQ_DTYPE must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.loss_backend not in ("auto", "apex", "torch", "reference"):
            raise SettingsError(
                f"TINKERQ_LOSS_BACKEND must be auto, apex, torch or reference, got {self.loss_backend!r}"
            )
        for url in (self.broker_url,):
            if url and not url.startswith(("redis://", "rediss://", "unix://", "memory://", "sentinel://")):
                raise SettingsError(
                    f"broker URL {url!r} is not supported: use redis://[:password@]host:port/db "
                    f"(or rediss:// for TLS, sentinel://host:port[;sentinel://host2:port2] for Redis Sentinel)"
                )
        # Checked here, not at the first connection: a typo in a path fails the command at once.
        from tinkerq import redis_client  # (it imports this module)

        urls = (self.broker_url,)
        for url in urls:
            if redis_client.is_sentinel(url):
                redis_client.parse_sentinel_url(url)  # type: ignore[arg-type]
        if any(redis_client.is_tls(url) for url in urls):
            redis_client.check_tls_files(self)
        if any(redis_client.is_sentinel(url) for url in urls) and not self.sentinel_master:
            raise SettingsError("sentinel:// URLs need the master's name: set TINKERQ_SENTINEL_MASTER")


def _is_tcp_address(url: str) -> bool:
    host, _, port = url.removeprefix("tcp://").rpartition(":")
    return url.startswith("tcp://") and bool(host) and port.isdigit() and 0 < int(port) < 65536


def _parse(name: str, raw: str, type_: Any) -> Any:
    kind = str(type_)
    if kind.startswith("bool"):
        if raw.lower() in ("1", "true", "on", "yes"):
            return True
        if raw.lower() in ("0", "false", "off", "no"):
            return False
        raise SettingsError(f"{ENV_PREFIX}{name.upper()}={raw!r}: 1 or 0 (true/false, on/off, yes/no)")
    try:
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
    except ValueError:
        raise SettingsError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a number") from None
    return raw

"""A shard group: the N processes that hold one model's shards, how they meet, and how rank 0 drives them.

Rank 0 is the Celery worker. It hosts the rendezvous (a ``torch.distributed.TCPStore`` on the
``tcp://host:port`` every rank is given) and, for each request, broadcasts one command that every rank
then executes in lockstep. Ranks 1..N-1 ("followers") only ever wait for the next command.

The group lives in *generations*. Rank 0 opens generation g in the store; the ranks check in (a rank
number can be held by one process only), and once all N have, they build a process group under the
prefix ``g<g>/``. When any collective fails (a peer died: gloo notices at once; or it hangs: the
collective times out), the generation is over: every survivor drops its sessions and leaves, rank 0
opens generation g+1, and a restarted shard joins it. Nothing is pickled: commands and answers are
msgpack bytes carried in uint8 tensors.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tinkerq.errors import ShardGroupError, TinkerqError, error_from_wire
from tinkerq.settings import Settings
from tinkerq.wire import codec

log = logging.getLogger("tinkerq.shards")

GENERATION_KEY = "tinkerq/generation"
POLL_S = 0.2


@dataclass(frozen=True)
class ShardSpec:
    shards: int
    rank: int
    host: str
    port: int
    device: str
    rendezvous_timeout_s: float
    collective_timeout_s: float

    @classmethod
    def from_settings(cls, settings: Settings) -> ShardSpec | None:
        """The spec of a sharded worker, or None for a plain (one-process) worker."""
        if settings.shards <= 1:
            return None
        host, _, port = settings.rendezvous.removeprefix("tcp://").rpartition(":")
        return cls(settings.shards, settings.shard_rank, host, int(port), settings.device,
                   settings.rendezvous_timeout_s, settings.collective_timeout_s)

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"


def describe_failure(exc: BaseException, collective_timeout_s: float) -> str:
    """What a failed collective means, in words an operator can act on (plus the engine's own, shortened)."""
    text = str(exc)
    if "Timed out" in text or "timed out" in text:
        what = (f"a shard did not answer within {collective_timeout_s:g} s (TINKERQ_COLLECTIVE_TIMEOUT_S): it "
                f"hangs, is far behind, or its host cannot be reached over the network")
    elif "closed by peer" in text or "reset by peer" in text or "Broken pipe" in text:
        what = "a shard closed its connection: it died or was stopped"
    else:
        what = "a collective failed"
    detail = text.split("This is typically", 1)[0].strip()[:200]
    return f"{what} ({type(exc).__name__}: {detail})"


class ShardGroup:
    """This process's membership in a shard group; collectives used by the sharded sessions."""

    def __init__(self, spec: ShardSpec) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.world = spec.shards
        self.generation = 0  # the last generation this process was part of
        self._opened: int | None = None  # rank 0: the generation it opened and that has not formed yet
        # rank 0: the newest generation it ever opened. One that failed to form is never opened again: a rank
        # that claimed its place in it and died before it formed would hold that place for good.
        self._newest_opened = 0
        self.mesh: DeviceMesh | None = None
        self.broken: str | None = "the shard group has not formed yet"
        # Held while a command runs: commands (and rank 0's pings) never interleave their collectives.
        self.lock = threading.RLock()
        self._store: dist.TCPStore | None = None
        self._me = f"{socket.gethostname()}:{os.getpid()}"
        device = torch.device(spec.device)
        self.device_type = device.type
        if device.type == "cuda":  # "cuda" alone: the first visible device (one GPU per container)
            torch.cuda.set_device(device.index if device.index is not None else 0)
        # CPU tensors (commands, answers) travel over gloo; on GPUs the model's collectives use NCCL.
        self._backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def healthy(self) -> bool:
        return self.broken is None

    # -- forming -------------------------------------------------------------------------------------------

    def form(self) -> None:
        """Join (rank 0: open) the next generation and wait for every rank; raises ShardGroupError on timeout.

        Called again after a timeout, rank 0 keeps the generation it opened, so ranks already waiting in
        it stay in it.
        """
        store = self._connect()
        if self.is_leader:
            if self._opened is None:
                self._opened = self._newest_opened = max(self.generation, self._newest_opened) + 1
                store.set(GENERATION_KEY, str(self._opened))
            generation = self._opened
        else:
            generation = self._next_open_generation(store, self.generation)
        prefix = f"g{generation}/"
        while (taken := store.compare_set(f"{prefix}rank{self.rank}", "", self._me).decode()) != self._me:
            held = (f"rank {self.rank} of {self.spec.address} is already held by {taken}; give each process its own "
                    f"--rank (0..{self.world - 1})")
            if self.is_leader:
                raise ShardGroupError(held)
            # Held by a process that may have died before this generation formed (a restarted shard finds its
            # predecessor's place): rank 0 then opens a newer one. A live duplicate --rank gets no newer one.
            log.warning("%s: waiting for rank 0 to open a newer generation than %d", held, generation)
            try:
                generation = self._next_open_generation(store, generation)
            except ShardGroupError:
                raise ShardGroupError(held) from None
            prefix = f"g{generation}/"
        self._wait_for_ranks(store, prefix)
        try:
            dist.init_process_group(
                self._backend, store=dist.PrefixStore(prefix, store), rank=self.rank, world_size=self.world,
                timeout=datetime.timedelta(seconds=self.spec.collective_timeout_s),
            )
            self.mesh = init_device_mesh(self.device_type, (self.world,))
        except Exception as exc:  # a rank that checked in died before the group formed: start over
            self._opened = None
            self.leave(f"generation {generation} did not form: {exc}")
            raise ShardGroupError(f"the shard group at {self.spec.address} did not form: {exc}") from None
        if self.is_leader:
            store.set(f"{prefix}formed", "1")
        self.generation, self._opened, self.broken = generation, None, None
        log.info("shard group formed: rank %d of %d, generation %d (%s)", self.rank, self.world, generation,
                 self.spec.address)

    def _connect(self) -> dist.TCPStore:
        if self._store is not None:
            return self._store
        timeout = datetime.timedelta(seconds=self.spec.rendezvous_timeout_s)
        try:
            if self.is_leader:
                self._store = dist.TCPStore(self.spec.host, self.spec.port, is_master=True, timeout=timeout,
                                            wait_for_workers=False, multi_tenant=False)
            else:
                # A follower may start before rank 0: the client retries until the timeout.
                self._store = dist.TCPStore(self.spec.host, self.spec.port, is_master=False, timeout=timeout)
        except Exception as exc:  # torch raises DistNetworkError / RuntimeError subclasses
            if self.is_leader:
                raise ShardGroupError(
                    f"rank 0 cannot host the rendezvous on {self.spec.address} ({exc}); pick a free port "
                    f"that the other ranks can reach"
                ) from None
            raise ShardGroupError(
                f"rank {self.rank} could not reach rank 0 at {self.spec.address} within "
                f"{self.spec.rendezvous_timeout_s:g} s (TINKERQ_RENDEZVOUS_TIMEOUT_S); start rank 0 "
                f"(`tinkerq worker ... --rank 0`) with the same --rendezvous"
            ) from None
        return self._store

    def _next_open_generation(self, store: dist.TCPStore, after: int) -> int:
        """A generation rank 0 has opened and not yet formed, newer than ``after`` (the one this process left, or
        one it could not take its place in)."""
        deadline = time.monotonic() + self.spec.rendezvous_timeout_s
        while True:
            raw = store.get(GENERATION_KEY) if store.check([GENERATION_KEY]) else b"0"
            generation = int(raw)
            if generation > after and not store.check([f"g{generation}/formed"]):
                return generation
            if time.monotonic() > deadline:
                raise ShardGroupError(
                    f"rank 0 at {self.spec.address} opened no new shard group for rank {self.rank} within "
                    f"{self.spec.rendezvous_timeout_s:g} s"
                )
            time.sleep(POLL_S)

    def _wait_for_ranks(self, store: dist.TCPStore, prefix: str) -> None:
        deadline = time.monotonic() + self.spec.rendezvous_timeout_s
        keys = [f"{prefix}rank{r}" for r in range(self.world)]
        while True:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise ShardGroupError(
                    f"the shard group at {self.spec.address} did not form within {self.spec.rendezvous_timeout_s:g}"
                    f" s (TINKERQ_RENDEZVOUS_TIMEOUT_S): rank(s) {missing} of {self.world} never joined. Start "
                    f"them with `tinkerq worker --model ... --shards {self.world} --rank R --rendezvous "
                    f"{self.spec.address}`"
                )
            time.sleep(POLL_S)

    def leave(self, reason: str) -> None:
        """End this generation here: later commands fail until :meth:`form` succeeds again."""
        self.broken = reason
        self.mesh = None
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a half-dead group may not tear down cleanly; it is gone either way
                log.warning("tearing down the process group: %s", exc)

    def require_healthy(self) -> None:
        if self.broken is not None:
            raise ShardGroupError(f"{self.broken}; the group re-forms by itself once every shard is back (restart a "
                                  f"failed one): try again then")

    # -- the command channel -----------------------------------------------------------------------------------

    def send_command(self, op: str, args: dict[str, Any]) -> None:
        """Rank 0: hand ``op(args)`` to every follower."""
        assert self.is_leader
        self._broadcast_bytes(codec.packb({"op": op, "args": args}))

    def receive_command(self) -> tuple[str, dict[str, Any]]:
        """A follower: wait for rank 0's next command (rank 0 pings while idle, so this never times out
        while the group is healthy)."""
        message = codec.unpackb(self._broadcast_bytes(None))
        return str(message["op"]), message["args"]

    def _broadcast_bytes(self, data: bytes | None) -> bytes:
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=0)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None
               else torch.empty(int(size.item()), dtype=torch.uint8))
        if buf.numel():
            dist.broadcast(buf, src=0)
        return data if data is not None else buf.numpy().tobytes()

    # -- collectives the sessions use ----------------------------------------------------------------------------

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order, on every rank."""
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64))
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(max(longest, 1), dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bufs = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(bufs, mine)
        return [b[: int(s.item())].numpy().tobytes() for b, s in zip(bufs, sizes, strict=True)]

    def agree(self, error: TinkerqError | None) -> None:
        """Raise, on every rank, the error of the lowest rank that has one; return if none has.

        Ranks meet here before anything changes state, so a bad input (a checkpoint a shard cannot read,
        a non-finite loss in one shard's datums) is refused by all of them together.
        """
        answers = self.gather_bytes(codec.packb(error.to_wire() if error is not None else None))
        for rank, raw in enumerate(answers):
            wire = codec.unpackb(raw)
            if wire is not None:
                if rank == self.rank and error is not None:
                    raise error
                raise error_from_wire(wire)

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Float64 sum or max over ranks."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return [float(v) for v in t]

    def sum_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Replace each tensor by its sum over ranks, in place (one collective per dtype: a flat buffer)."""
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for t in same])
            dist.all_reduce(flat)
            for t, piece in zip(same, torch.split(flat, [t.numel() for t in same]), strict=True):
                t.copy_(piece.view_as(t))

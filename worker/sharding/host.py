"""What every rank of a sharded worker holds, the commands it runs, and rank 0's view of a session.

:class:`ShardHost` is the same on every rank: the base model's skeleton (parameters on the meta device: no rank
ever holds the whole base), this rank's :class:`worker.training.TrainingEngine` per training session (over its FSDP2
shards, read from the checkpoint's files by worker/sharding/streaming.py), and :meth:`ShardHost.execute`, which runs
one command. Rank 0's sessions are :class:`worker.session.FullSession`
(:func:`leader_session`) whose runner broadcasts each command before running it locally; files are written
by rank 0 alone from tensors gathered to it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from tinkerq import optimizers, types
from tinkerq.errors import ServerError, ShardGroupError, TinkerqError
from tinkerq.threads import NamedThread
from tinkerq.wire import messages
from tinkerq.worker.loading.models import load_causal_lm
from tinkerq.worker.loading.quantized_base import FULL_SESSION_MESSAGE, FullSessionOnQuantizedBase
from tinkerq.worker.lora import routing
from tinkerq.worker.lora.adapter import FrozenAdapter
from tinkerq.worker.lora.batch import LossItem
from tinkerq.worker.lora.session import LoraBase, LoraSession, config_dict
from tinkerq.worker.sharding.experts import kept_base_bytes, shard_expert_factors
from tinkerq.worker.sharding.fsdp import shard_frozen, sharded_engine
from tinkerq.worker.sharding.group import ShardGroup, describe_failure
from tinkerq.worker.sharding.sampling import GroupSampling, join_forward, mirror_on_follower, send_mirrored
from tinkerq.worker.sharding.streaming import allocate, fill_shards
from tinkerq.worker.training.engine import TrainingEngine, tied_names
from tinkerq.worker.training.logprobs import LogprobComputer
from tinkerq.worker.training.session import FullSession, execute

log = logging.getLogger("tinkerq.shards")


class ShardHost:
    def __init__(self, group: ShardGroup, base_model: PreTrainedModel, *, model_dir: str,
                 logprobs: LogprobComputer, microbatch_tokens: int, expert_parallel: bool = False,
                 kept_quantized: bool = False) -> None:
        self.group = group
        self.expert_parallel = expert_parallel  # routed experts split by expert (sharding/experts.py)
        # (with it) the LoRA base's quantized routed experts kept as stored (--quantized-base keep): LoRA only
        self.kept_quantized = kept_quantized
        self.base_model = base_model  # the skeleton: every parameter on the meta device, never trained
        self.model_dir = model_dir
        self.logprobs = logprobs
        self.microbatch_tokens = microbatch_tokens
        self.sessions: dict[str, TrainingEngine] = {}  # every training session's engine on this rank
        self.lora_sessions: dict[str, LoraSession] = {}  # the LoRA ones (adapters whole, but for EP expert factors)
        self._lora_base: LoraBase | None = None  # made by the first LoRA session: the base sharded once, frozen
        self._sampling: GroupSampling | None = None  # rank 0: sampling over that base (sampling_model)
        # A follower of an expert-parallel group: its experts' slices of the LoRA snapshots rank 0 samples
        # (worker/sharding/sampling.py AdapterMirror), by serial.
        self._mirrored: dict[int, FrozenAdapter] = {}
        self.shapes = {n: list(p.shape) for n, p in base_model.named_parameters() if p.requires_grad}
        self.tied = tied_names(base_model)
        # Rank 0 only: called (outside the group lock) when the group breaks, and when it has re-formed.
        self.on_failure: Callable[[str], None] = lambda reason: None
        self.on_formed: Callable[[], None] = lambda: None

    # -- every rank -----------------------------------------------------------------------------------------

    def execute(self, op: str, args: dict[str, Any]) -> Any:
        """Run one command on this rank. Raises only TinkerqErrors that every rank raises alike."""
        if op == "ping":
            return self.group.agree(None)
        if op == "lora_pass":
            return self._lora_pass(args)
        if op == "sample_forward":  # rank 0 passes its forward; a follower joins its collectives
            call = args.get("call")
            base = self.lora_base()
            assert base.root is not None
            mirror = args.get("mirror")
            if call is not None:
                send_mirrored(args.get("tensors") or [])
                return call()
            passing = mirror_on_follower(self._mirrored, mirror, self.group.mesh, self.group.spec.device) \
                if mirror is not None else []
            with routing.routed([], passing=passing) if passing else contextlib.nullcontext():
                return join_forward(base.root, self.group.spec.device)
        model_id = str(args["model_id"])
        if op == "create":
            return self._create(model_id, args.get("lora"), str(args.get("base_model", "")), args.get("optimizer"))
        if op == "close":
            self.sessions.pop(model_id, None)
            self.lora_sessions.pop(model_id, None)
            return None
        return execute(self.sessions[model_id], op, args, self.tied)

    def _create(self, model_id: str, lora: dict[str, Any] | None, base_model: str,
                optimizer: dict[str, Any] | None = None) -> LoraSession | None:
        """Open a session on this rank: a full one (its own FSDP shards of a copy of the base, AdamW) or a LoRA one
        (an adapter over the shared sharded base, with ``optimizer``: None is AdamW). Every rank agrees before any
        keeps it."""
        error: TinkerqError | None = None
        session = None
        try:
            if lora is None:
                if self.kept_quantized:
                    raise FullSessionOnQuantizedBase(FULL_SESSION_MESSAGE)
                self.sessions[model_id] = sharded_engine(copy.deepcopy(self.base_model), self.group,
                                                         logprobs=self.logprobs, fill=self.fill,
                                                         microbatch_tokens=self.microbatch_tokens,
                                                         expert_parallel=self.expert_parallel)
            else:
                run = on_close = None
                if self.group.is_leader:  # rank 0's session runs each command on every rank
                    run = lambda op, **a: self.run(op, model_id=model_id, **a)  # noqa: E731
                    on_close = lambda: self.close_session(model_id)  # noqa: E731
                session = LoraSession(model_id, self.lora_base(), types.LoraConfig(**lora),
                                      base_model=base_model, run=run, on_close=on_close,
                                      optimizer=optimizers.config_of(optimizer))
                self.sessions[model_id], self.lora_sessions[model_id] = session.engine, session
        except TinkerqError as exc:  # a config every rank refuses alike
            error = exc
        except (RuntimeError, MemoryError) as exc:  # e.g. out of device memory on this rank
            error = ServerError(f"shard {self.group.rank} could not open session {model_id}: {exc}")
        try:
            self.group.agree(error)
        except TinkerqError:
            self.sessions.pop(model_id, None)
            self.lora_sessions.pop(model_id, None)
            raise
        return session

    def kept_base_bytes(self) -> int | None:
        """Per rank, the LoRA base a group keeping its experts quantized makes (None: a plain sharded base)."""
        if not (self.kept_quantized and self.expert_parallel):
            return None
        return kept_base_bytes(self.base_model, self.model_dir, self.group.world)

    @property
    def has_lora_base(self) -> bool:
        return self._lora_base is not None

    def lora_base(self) -> LoraBase:
        """The frozen base of every LoRA session on this rank: a copy of the base, sharded once (made on every rank
        by the first LoRA session's command). Rank 0 runs each pass on every rank (``leader``)."""
        if self._lora_base is None:
            model = copy.deepcopy(self.base_model)
            model.__dict__.pop("_tinkerq_lora_hooks", None)  # the copy gets hooks of its own (the original's are inert)
            base = LoraBase(model, self.logprobs, model_dir=self.model_dir, microbatch_tokens=self.microbatch_tokens,
                            group=self.group, device=self.group.spec.device)
            base.root = shard_frozen(model, self.group, self.logprobs, self.fill, expert_parallel=self.expert_parallel,
                                     kept_from=self.model_dir if self.kept_quantized else None)
            if self.expert_parallel:  # the tenants' per-expert factors live with their experts
                mesh = self.group.mesh
                assert mesh is not None  # a formed group
                base.shard_adapter = lambda adapter: shard_expert_factors(adapter, mesh)
            base.whole = self.whole_model  # merged files: rank 0 reads the whole base for them
            if self.group.is_leader:
                base.leader = lambda items, backward: self.run("lora_pass", items=items, backward=backward)
            self._lora_base = base
        return self._lora_base

    def fill(self, root: torch.nn.Module, model: PreTrainedModel) -> None:
        """This rank's shards of a copy of the skeleton (sharded on the meta device under ``root``), read from the
        files."""
        fill_shards(root, model, self.base_model, self.model_dir, device=self.group.spec.device,
                    dtype=self.base_model.dtype)

    def whole_model(self) -> PreTrainedModel:
        """Rank 0: the whole base, read from the files (on the CPU), for a merged LoRA save. Held only while that
        runs."""
        log.info("reading the whole base from %s for a merged save on rank 0", self.model_dir)
        return load_causal_lm(self.model_dir, device="cpu", dtype=str(self.base_model.dtype).removeprefix("torch."))

    def blank_model(self) -> PreTrainedModel:
        """Rank 0: a whole model to write every weight of into (a full session's sampling snapshot, a published
        one): the skeleton with storage on the CPU, its weights unset. Nothing is read from the files."""
        model = copy.deepcopy(self.base_model)
        model.__dict__.pop("_tinkerq_lora_hooks", None)  # the copy gets hooks of its own (the original's are inert)
        allocate(model, model, "cpu")
        return model

    def _lora_pass(self, args: dict[str, Any]) -> None:
        """A mixed LoRA pass: rank 0 passes its items; a follower makes the same from the command."""
        items = args.get("items")
        if items is None:
            items = [LossItem(self.lora_sessions[str(r["model_id"])], r["data"], r["loss_fn"], r["config"],
                              checkpointing=r["checkpointing"]) for r in args["requests"]]
        self.lora_base().pass_here(items, bool(args["backward"]))

    def drop_sessions(self) -> None:
        """The group broke: its sessions, and the sharded base (its shards live on the old process group), go."""
        self.sessions.clear()
        self.lora_sessions.clear()
        self._lora_base = self._sampling = None
        self._mirrored.clear()

    # -- rank 0 ---------------------------------------------------------------------------------------------

    def run(self, op: str, **args: Any) -> Any:
        """Rank 0: run ``op`` on every rank. A failure of the group fails this call (ShardGroupError)
        and starts re-forming the group; errors all ranks agree on pass through unchanged."""
        with self.group.lock:
            self.group.require_healthy()
            try:
                self.group.send_command(op, _to_wire(op, args))
                return self.execute(op, args)
            except TinkerqError:
                raise
            except Exception as exc:  # a peer died or hung (or this rank failed): the generation is over
                reason = self._failure(f"during {op}", exc)
                self._leave(reason)
        self._after_failure(reason)
        raise ShardGroupError(reason)

    def _failure(self, when: str, exc: BaseException) -> str:
        # The facts only: what becomes of the sessions (held and re-made, handed over, or lost) the worker says
        # (worker/recovery/, WorkerService.shard_group_failed).
        return (f"the shard group of this model failed {when}: "
                f"{describe_failure(exc, self.group.spec.collective_timeout_s)}")

    def _leave(self, reason: str) -> None:
        log.error(reason)
        self.drop_sessions()
        self.group.leave(reason)

    def _after_failure(self, reason: str) -> None:
        self.on_failure(reason)
        NamedThread(target=self._reform, name="tinkerq-shard-reform", daemon=True).start()

    def _reform(self) -> None:
        while True:
            try:
                self.group.form()
            except ShardGroupError as exc:
                log.error("still waiting for the shard group to re-form: %s", exc.message)
                continue
            except Exception:
                log.exception("re-forming the shard group failed; trying again")
                time.sleep(1.0)
                continue
            self.on_formed()
            return

    def start_pings(self, on_loop: Callable[[Callable[[], None]], bool] | None = None) -> threading.Event:
        """Rank 0: ping the followers whenever the group is idle, so they know rank 0 lives (and rank 0
        learns of a dead follower before the next request needs it).

        ``on_loop(fn)`` runs ``fn`` on the worker's compute loop when it has nothing else to run and says
        whether it did (worker/core/service.py ``run_when_idle``): the ping's collectives then never run beside the
        loop's, nor hold its next request back. Without it (a test driving the host alone) the ping runs on
        its own thread whenever the group's lock is free."""
        stop = threading.Event()
        period = max(0.5, self.group.spec.collective_timeout_s / 4)

        def ping() -> None:
            if not self.group.healthy or not self.group.lock.acquire(blocking=False):
                return
            reason = None
            try:
                if self.group.healthy:
                    self.group.send_command("ping", {})
                    self.execute("ping", {})
            except Exception as exc:
                reason = self._failure("while idle", exc)
                self._leave(reason)
            finally:
                self.group.lock.release()
            if reason is not None:
                self._after_failure(reason)

        def loop() -> None:
            while not stop.wait(period):
                if on_loop is None:
                    ping()
                elif self.group.healthy:
                    on_loop(ping)  # busy: the loop's own collectives tell rank 0 and the followers enough

        NamedThread(target=loop, name="tinkerq-shard-ping", daemon=True).start()
        return stop

    def open_lora(self, model_id: str, config: types.LoraConfig, *, base_model: str,
                  optimizer: types.OptimizerConfig | None = None) -> LoraSession:
        """Rank 0: open a LoRA session on every rank; returns rank 0's."""
        session = self.run("create", model_id=model_id, lora=config_dict(config), base_model=base_model,
                           optimizer=optimizers.encode_config(optimizer or types.AdamOptimizerConfig()))
        assert isinstance(session, LoraSession)
        return session

    def sampling_model(self) -> GroupSampling:
        """Rank 0: the model the sampling engine runs the base and LoRA snapshots on (worker/sharding/sampling.py);
        the first call shards the base on every rank, if no LoRA session has yet."""
        if self._lora_base is None:
            self.run("sample_forward")  # every rank makes its sharded base (lora_base()) and joins one forward
        base = self.lora_base()
        assert base.root is not None
        if self._sampling is None:
            self._sampling = GroupSampling(self, base.root, base.model)
        return self._sampling

    def close_session(self, model_id: str) -> None:
        """Rank 0: drop a session on every rank (nothing to do when the group already dropped it)."""
        if self.group.healthy and model_id in self.sessions:
            try:
                self.run("close", model_id=model_id)
            except ShardGroupError as exc:
                log.warning("closing %s: %s", model_id, exc.message)

    def shutdown(self) -> None:
        """Rank 0 stops: tell the followers to exit too."""
        with self.group.lock:
            if self.group.healthy:
                try:
                    self.group.send_command("shutdown", {})
                except Exception as exc:
                    log.warning("could not tell the shards to stop: %s", exc)
            self.group.leave("the worker stopped")


class LeaderSession(FullSession):
    """Rank 0's handle on a sharded training session (opened on every rank by the constructor)."""

    def __init__(self, host: ShardHost, model_id: str) -> None:
        host.run("create", model_id=model_id)
        self.host = host
        super().__init__(model_id, lambda op, **args: host.run(op, model_id=model_id, **args),
                         lambda: host.sessions.get(model_id), blank=host.blank_model, template=host.base_model,
                         model_dir=host.model_dir, shapes=host.shapes, world=host.group.world,
                         device=host.group.spec.device)

    def close(self) -> None:
        self.host.close_session(self.model_id)


def _to_wire(op: str, args: dict[str, Any]) -> dict[str, Any]:
    """A command's arguments as the followers receive them (msgpack: our own types are encoded)."""
    if op == "run_loss":
        request = messages.encode_loss_request(args["data"], args["loss_fn"], args["config"])
        args = {"model_id": args["model_id"], "backward": args["backward"], "request": request,
                "checkpointing": bool(args.get("checkpointing", False))}
    elif op == "optim_step":
        args = {**args, "hyper": messages.encode_optim(args["hyper"])}
    elif op == "sample_forward":
        args = {"mirror": args.get("mirror")}  # rank 0's forward stays on rank 0; new factors follow by broadcast
    elif op == "lora_pass":
        args = {"backward": args["backward"], "requests": [
            {"model_id": item.target.model_id, "checkpointing": item.checkpointing,
             "request": messages.encode_loss_request(item.data, item.loss_fn, item.config)} for item in args["items"]]}
    return args


def from_wire(op: str, args: dict[str, Any]) -> dict[str, Any]:
    """A follower: :func:`_to_wire` undone."""
    if op == "run_loss":
        data, loss_fn, config = messages.decode_loss_request(args["request"])
        args = {"model_id": args["model_id"], "backward": args["backward"], "data": data, "loss_fn": loss_fn,
                "config": config, "checkpointing": bool(args.get("checkpointing", False))}
    elif op == "optim_step":
        args = {**args, "hyper": messages.decode_optim(args["hyper"])}
    elif op == "lora_pass":
        requests = []
        for r in args["requests"]:
            data, loss_fn, config = messages.decode_loss_request(r["request"])
            requests.append({"model_id": r["model_id"], "data": data, "loss_fn": loss_fn, "config": config,
                             "checkpointing": bool(r.get("checkpointing", False))})
        args = {"backward": args["backward"], "requests": requests}
    return args

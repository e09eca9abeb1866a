"""What every rank of a sharded worker holds, the commands it runs, and rank 0's view of a session.

:class:`ShardHost` is the same on every rank: the base model (on the CPU, copied for each new session),
this rank's :class:`ShardedSession` per training session, and :meth:`ShardHost.execute`, which runs one
command. Rank 0's :class:`LeaderSession` has the interface of :class:`worker.session.TrainingSession`,
so the request handling in :mod:`worker.service` is the same for both: each of its calls broadcasts a
command and runs it locally, and files are written by rank 0 alone from tensors gathered to it.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from tinkerq import types
from tinkerq.errors import ServerError, ShardGroupError, TinkerqError
from tinkerq.wire import messages
from worker import checkpoints
from worker.logprobs import LogprobComputer
from worker.sharding.group import ShardGroup, describe_failure
from worker.sharding.session import ShardedSession

log = logging.getLogger("tinkerq.shards")


class ShardHost:
    def __init__(self, group: ShardGroup, base_model: PreTrainedModel, *, model_dir: str,
                 logprobs: LogprobComputer, microbatch_tokens: int) -> None:
        self.group = group
        self.base_model = base_model  # unsharded, on the CPU, never trained
        self.model_dir = model_dir
        self.logprobs = logprobs
        self.microbatch_tokens = microbatch_tokens
        self.sessions: dict[str, ShardedSession] = {}
        self.shapes = {n: list(p.shape) for n, p in base_model.named_parameters() if p.requires_grad}
        # Rank 0 only: called (outside the group lock) when the group breaks, and when it has re-formed.
        self.on_failure: Callable[[str], None] = lambda reason: None
        self.on_formed: Callable[[], None] = lambda: None

    # -- every rank -----------------------------------------------------------------------------------------

    def execute(self, op: str, args: dict[str, Any]) -> Any:
        """Run one command on this rank. Raises only TinkerqErrors that every rank raises alike."""
        if op == "ping":
            return self.group.agree(None)
        model_id = str(args["model_id"])
        if op == "create":
            return self._create(model_id)
        if op == "close":
            self.sessions.pop(model_id, None)
            return None
        session = self.sessions[model_id]
        if op == "run_loss":
            data, loss_fn, config = messages.decode_loss_request(args["request"])
            return session.run_loss(data, loss_fn, config, backward=bool(args["backward"]))
        if op == "optim_step":
            return session.optim_step(messages.decode_adam(args["adam"]))
        if op == "gather_weights":
            return session.gather_weights()
        if op == "gather_state":
            return session.gather_state()
        if op == "load_state":
            return self._load_state(session, Path(str(args["path"])))
        raise ServerError(f"unknown shard command {op!r}")

    def _create(self, model_id: str) -> None:
        error = None
        try:
            self.sessions[model_id] = ShardedSession(
                model_id, copy.deepcopy(self.base_model), self.group, logprobs=self.logprobs,
                microbatch_tokens=self.microbatch_tokens)
        except (RuntimeError, MemoryError) as exc:  # e.g. out of device memory on this rank
            error = ServerError(f"shard {self.group.rank} could not open session {model_id}: {exc}")
        try:
            self.group.agree(error)
        except TinkerqError:
            self.sessions.pop(model_id, None)
            raise

    def _load_state(self, session: ShardedSession, directory: Path) -> dict[str, Any]:
        # Each rank reads the files itself (the checkpoint directory is shared); all agree before any applies.
        error, saved = None, None
        try:
            saved = checkpoints.read_state(directory, session.shapes(), session.tied)
        except TinkerqError as exc:
            error = exc
        except OSError as exc:
            error = ServerError(f"shard {self.group.rank} cannot read checkpoint {directory}: {exc}")
        self.group.agree(error)
        assert saved is not None
        session.load(saved)
        return saved.meta

    def drop_sessions(self) -> None:
        self.sessions.clear()

    # -- rank 0 ---------------------------------------------------------------------------------------------

    def run(self, op: str, **args: Any) -> Any:
        """Rank 0: run ``op`` on every rank. A failure of the group fails this call (ShardGroupError)
        and starts re-forming the group; errors all ranks agree on pass through unchanged."""
        with self.group.lock:
            self.group.require_healthy()
            try:
                self.group.send_command(op, args)
                return self.execute(op, args)
            except TinkerqError:
                raise
            except Exception as exc:  # a peer died or hung (or this rank failed): the generation is over
                reason = self._failure(f"during {op}", exc)
                self._leave(reason)
        self._after_failure(reason)
        raise ShardGroupError(reason)

    def _failure(self, when: str, exc: BaseException) -> str:
        return (f"the shard group of this model failed {when}: "
                f"{describe_failure(exc, self.group.spec.collective_timeout_s)}. Open training sessions are lost; "
                f"restart the failed shard (the group re-forms by itself) and resume from your last save_state "
                f"checkpoint")

    def _leave(self, reason: str) -> None:
        log.error(reason)
        self.drop_sessions()
        self.group.leave(reason)

    def _after_failure(self, reason: str) -> None:
        self.on_failure(reason)
        threading.Thread(target=self._reform, name="tinkerq-shard-reform", daemon=True).start()

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

    def start_pings(self) -> threading.Event:
        """Rank 0: ping the followers whenever the group is idle, so they know rank 0 lives (and rank 0
        learns of a dead follower before the next request needs it)."""
        stop = threading.Event()
        period = max(0.5, self.group.spec.collective_timeout_s / 4)

        def loop() -> None:
            while not stop.wait(period):
                if not self.group.healthy or not self.group.lock.acquire(blocking=False):
                    continue
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

        threading.Thread(target=loop, name="tinkerq-shard-ping", daemon=True).start()
        return stop

    def shutdown(self) -> None:
        """Rank 0 stops: tell the followers to exit too."""
        with self.group.lock:
            if self.group.healthy:
                try:
                    self.group.send_command("shutdown", {})
                except Exception as exc:
                    log.warning("could not tell the shards to stop: %s", exc)
            self.group.leave("the worker stopped")


class LeaderSession:
    """Rank 0's handle on a sharded training session, with :class:`TrainingSession`'s interface."""

    def __init__(self, host: ShardHost, model_id: str) -> None:
        self.host = host
        self.model_id = model_id
        self.last_used = time.monotonic()
        host.run("create", model_id=model_id)

    @property
    def steps(self) -> int:
        session = self.host.sessions.get(self.model_id)
        return session.steps if session is not None else 0

    def _run(self, op: str, **args: Any) -> Any:
        self.last_used = time.monotonic()
        return self.host.run(op, model_id=self.model_id, **args)

    def run_loss(self, data: list[types.Datum], loss_fn: str, config: dict[str, Any] | None, *,
                 backward: bool) -> types.ForwardBackwardOutput:
        return self._run("run_loss", request=messages.encode_loss_request(data, loss_fn, config), backward=backward)

    def optim_step(self, adam: types.AdamParams) -> types.OptimStepResponse:
        return self._run("optim_step", adam=messages.encode_adam(adam))

    def snapshot(self) -> PreTrainedModel:
        """The full weights gathered to rank 0, as a frozen model for sampling."""
        weights = self._run("gather_weights")
        snapshot = copy.deepcopy(self.host.base_model)
        with torch.no_grad():
            for name, p in snapshot.named_parameters():
                p.copy_(weights[name])
        snapshot.requires_grad_(False)
        return snapshot.to(self.host.group.spec.device)

    def save_weights(self, checkpoint_dir: str, name: str, *, base_model: str) -> str:
        final = checkpoints.weights_path(checkpoint_dir, self.model_id, name)
        weights = self._run("gather_weights")

        def fill(tmp: Path) -> None:
            self.host.base_model.save_pretrained(tmp, state_dict=weights)
            checkpoints.copy_tokenizer_files(self.host.model_dir, tmp)
            checkpoints.write_weights_marker(tmp, base_model)

        checkpoints.write_atomically(final, fill)
        return str(final)

    def save_state(self, checkpoint_dir: str, name: str, *, base_model: str, seq_id: int) -> str:
        final = checkpoints.state_path(checkpoint_dir, self.model_id, name)
        saved = self._run("gather_state")
        checkpoints.write_atomically(final, lambda tmp: checkpoints.write_state(
            tmp, write_weights=lambda d: self.host.base_model.save_pretrained(d, state_dict=saved.weights),
            shapes=self.host.shapes, moments=saved.moments, grads=saved.grads, base_model=base_model,
            model_id=self.model_id, steps=int(saved.meta["optimizer_steps"]), seq_id=seq_id,
            shards=self.host.group.world))
        return str(final)

    def load_state(self, directory: Path) -> dict[str, Any]:
        checkpoints.check_state(directory, self.host.shapes)  # user errors before any shard is involved
        return self._run("load_state", path=str(directory))

    def close(self) -> None:
        if self.host.group.healthy and self.model_id in self.host.sessions:
            try:
                self._run("close")
            except ShardGroupError as exc:
                log.warning("closing %s: %s", self.model_id, exc.message)

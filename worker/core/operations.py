"""The operations of the Tinker API on one session, as the compute loop runs them (worker/core/compute.py).

Each takes the session and the decoded request body and returns the reply body (msgpack bytes) and the
number of tokens it processed; a refusal raises a :class:`tinkerq.errors.TinkerqError`. Everything here runs on
the compute loop's thread, which owns the model and the device.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from tinkerq import optimizers, types
from tinkerq.errors import TinkerqError, ValidationError, WorkerError
from tinkerq.settings import Settings
from tinkerq.threads import NamedThread
from tinkerq.validation import (
    Limits,
    validate_loss_request,
    validate_prompt_options,
    validate_sampling,
    validate_ttl_seconds,
)
from tinkerq.wire import codec, messages
from tinkerq.worker import checkpoints, memory
from tinkerq.worker.checkpoints import retention
from tinkerq.worker.loading import support
from tinkerq.worker.lora.batch import LossItem
from tinkerq.worker.sampling.engine import SampleJob
from tinkerq.worker.sampling.rules import StopRule
from tinkerq.worker.sampling.snapshots import Snapshots
from tinkerq.worker.training.logprobs import LogprobComputer
from tinkerq.worker.training.session import Session

log = logging.getLogger("tinkerq.worker")

Op = Callable[[Session, Any], tuple[bytes, int]]


class Operations:
    def __init__(self, settings: Settings, model: PreTrainedModel, model_dir: str, base_model: str,
                 logprobs: LogprobComputer, snapshots: Snapshots, *, vocab_size: int, max_seq_len: int,
                 position: Callable[[str], int], admit_sampler: Callable[[Session], None],
                 on_metrics: Callable[[dict[str, float]], None] = lambda _: None) -> None:
        self.settings = settings
        self.model = model
        self.model_class = type(model).__name__  # what worker/loading/support.py's table is keyed by
        self.model_dir = model_dir
        self.base_model = base_model
        self.logprobs = logprobs
        self.snapshots = snapshots
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.limits = Limits(max_datums=settings.max_datums, max_batch_tokens=settings.max_batch_tokens)
        self._position = position  # model_id -> the last request applied before the running one
        self._admit_sampler = admit_sampler
        self._on_metrics = on_metrics
        self._tokenizer: Any = None
        self._sweeping = threading.Lock()  # held while expired checkpoints are being deleted
        # One handler per operation of a session's order (tinkerq.operations.ORDERED; tests check they match).
        self.ops: dict[str, Op] = {
            "forward_backward": lambda s, body: self.loss(s, body, backward=True),
            "forward": lambda s, body: self.loss(s, body, backward=False),
            "optim_step": self.optim_step,
            "save_weights_for_sampler": self.save_weights,
            "save_state": self.save_state,
            "load_state": self.load_state,
            "create_sampler": self.create_sampler,
            "echo": lambda s, body: (codec.packb(body), 0),
            "close_model": lambda s, body: (codec.packb({}), 0),
        }

    # -- training -----------------------------------------------------------------------------------------------

    def checked_loss(self, body: Any, *, backward: bool, lora: bool = False) -> LossItem:
        """A loss request decoded, validated whole and admitted to memory, before anything touches the model
        (its ``target`` is set by the caller)."""
        data, loss_fn, config = messages.decode_loss_request(body)
        validate_loss_request(data, loss_fn, config, limits=self.limits, vocab_size=self.vocab_size,
                              max_seq_len=self.max_seq_len)
        checkpointing = memory.admit_batch(self.model, self.settings, [d.model_input.length for d in data],
                                           backward=backward, logprobs=self.logprobs, lora=lora)
        if checkpointing:
            log.info("forward_backward of %d datum(s), %d tokens: decoder layers checkpointed (activation "
                     "checkpointing %s)", len(data), sum(d.model_input.length for d in data),
                     self.settings.activation_checkpointing)
        return LossItem(None, data, loss_fn, config, checkpointing=checkpointing)  # type: ignore[arg-type]

    def loss_alone(self, session: Session, body: Any, *, backward: bool) -> bytes:
        """A LoRA loss request replayed by an adopter: the same pass code as it ran in, one request alone
        (batch-invariant, so its numbers are those of the mixed pass it ran in); raises its refusal."""
        item = self.checked_loss(body, backward=backward, lora=True)
        item.target = session  # type: ignore[assignment]
        run_pass([item], backward)
        if item.output is None:
            raise item.error or WorkerError("the LoRA pass gave no answer")
        return codec.packb(messages.encode_forward_backward_output(item.output))

    def loss(self, session: Session, body: Any, *, backward: bool) -> tuple[bytes, int]:
        item = self.checked_loss(body, backward=backward)
        out = session.run_loss(item.data, item.loss_fn, item.config, backward=backward,
                               checkpointing=item.checkpointing)
        return codec.packb(messages.encode_forward_backward_output(out)), tokens_of(item)

    def optim_step(self, session: Session, body: Any) -> tuple[bytes, int]:
        hyper = messages.decode_optim(body)
        optimizers.validate(hyper)
        metrics = session.optim_step(hyper).metrics or {}  # a family not the session's optimizer's is refused
        self._on_metrics(metrics)  # the automatic snapshot, if due, follows once the step is journaled
        return codec.packb({"metrics": metrics}), 0

    # -- files --------------------------------------------------------------------------------------------------

    def save_state(self, session: Session, body: Any) -> tuple[bytes, int]:
        name = checkpoints.check_name(body.get("name") if isinstance(body, dict) else None)
        overwrite = flag(body, "overwrite", True, "save_state")  # absent: replace, as before the field existed
        expires_at = expires_at_of(body)
        keep_newest = retention.keep_newest_of(body, "save_state")
        # The state saved is the state after the last request applied before this one.
        path = session.save_state(self.settings.checkpoint_dir, name, base_model=self.base_model,
                                  seq_id=self._position(session.model_id), expires_at=expires_at,
                                  overwrite=overwrite)
        self.sweep_checkpoints()
        return codec.packb(self.saved(session, "save_state", path, expires_at, keep_newest)), 0

    def load_state(self, session: Session, body: Any) -> tuple[bytes, int]:
        path = body.get("path") if isinstance(body, dict) else None
        optimizer = flag(body, "optimizer", True, "load_state")  # absent: weights and optimizer, as before
        directory = checkpoints.resolve_state_path(path, self.settings.checkpoint_dir)
        meta = session.load_state(directory, optimizer=optimizer)
        # optimizer_steps: the session's count now (0 when the optimizer starts afresh).
        return codec.packb({"path": str(directory), "optimizer": optimizer, "optimizer_steps": session.steps,
                            "seq_id": meta["seq_id"]}), 0

    def save_weights(self, session: Session, body: Any) -> tuple[bytes, int]:
        name: Any = body.get("name") if isinstance(body, dict) else None  # checked where the path is built
        merged = flag(body, "merged", False, "save_weights_for_sampler")
        # external: the gateway's save_weights_external, the same archive in a folder of its own (checkpoint_paths)
        external = flag(body, "external", False, "save_weights_for_sampler")
        expires_at = expires_at_of(body)
        keep_newest = retention.keep_newest_of(body, "save_weights_for_sampler")
        if merged and session.kind == "lora":  # a full session's weights are merged already: nothing more is made
            adapter = session.describe()["lora"]["trainable_parameters"]
            memory.admit_merged_save(self.model, self.settings, adapter, whole_base=self.settings.shards > 1)
        path = session.save_weights(self.settings.checkpoint_dir, name, base_model=self.base_model, merged=merged,
                                    expires_at=expires_at, external=external)
        self.sweep_checkpoints()
        return codec.packb(self.saved(session, "save_weights_for_sampler", path, expires_at, keep_newest)), 0

    def saved(self, session: Session, op: str, path: str, expires_at: float | None,
              keep_newest: int | None) -> dict[str, Any]:
        """A save's reply: its path, its size in bytes (usage accounting), when it expires if it does, and the
        names of the session's older checkpoints of that kind deleted for ``keep_newest``
        (worker/checkpoints/retention.py)."""
        pruned = [] if keep_newest is None else retention.prune(
            self.settings.checkpoint_dir, session.model_id, op, keep_newest, written=Path(path))
        reply: dict[str, Any] = {"path": path, "bytes": retention.directory_bytes(path), "pruned": pruned}
        if expires_at is not None:
            reply["expires_at"] = expires_at
        return reply

    def sweep_checkpoints(self) -> None:
        """Delete expired checkpoints on a thread of its own (best effort, files only), so no reply waits for
        it. Skipped while a sweep runs: the next save sweeps again."""
        if not self._sweeping.acquire(blocking=False):
            return

        def sweep() -> None:
            try:
                checkpoints.remove_expired(self.settings.checkpoint_dir)
            except Exception:  # never fatal: an expired checkpoint is also refused (and deleted) when named
                log.exception("deleting expired checkpoints failed")
            finally:
                self._sweeping.release()

        NamedThread(target=sweep, name="tinkerq-checkpoint-sweep", daemon=True).start()

    # -- sampling -----------------------------------------------------------------------------------------------

    def create_sampler(self, session: Session, body: Any) -> tuple[bytes, int]:
        # Refused (CapacityError) before the weights are copied when the copy would not fit.
        self._admit_sampler(session)
        sampler_id = self.snapshots.add(session.snapshot(), session.model_id)
        return codec.packb({"sampler_id": sampler_id}), 0

    def sample_job(self, body: Any, on_done: Callable[..., None], prompt_logprobs: list[Any],
                   prompt_scores: list[Any] | None = None) -> tuple[SampleJob, int]:
        """A checked sample request as a job for the sampling engine, and its prompt length. The prompt's logprobs
        and its top-k / target / alternative-token answers, when asked, are appended to the two lists."""
        request = messages.decode_sample_request(body)
        support.check(self.model_class, "sampling")  # a class whose sampling is not proven: refused before compute
        prompt, num_samples, params = request.prompt, request.num_samples, request.params
        s = self.settings
        validate_sampling(prompt, num_samples, params, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len,
                          max_num_samples=s.max_num_samples, max_tokens=s.max_sample_tokens)
        max_tokens = params.max_tokens or min(self.max_seq_len - prompt.length, s.max_sample_tokens)
        options = request.options
        validate_prompt_options(options, prompt.length, max_tokens, vocab_size=self.vocab_size)
        scores = prompt_scores if prompt_scores is not None else []
        memory.admit_sample(self.model, s, prompt.length, max_tokens, num_samples)
        key, model, adapter = self.snapshots.resolve(request.source)
        stop = StopRule(params.stop, self._default_stop_ids(), self._tokenizer_for(params.stop))
        job = SampleJob(model=model, model_key=key, prompt=prompt.to_ints(), num_samples=num_samples,
                        params=params, stop=stop, max_tokens=max_tokens, on_done=on_done, adapter=adapter,
                        on_prompt_logprobs=prompt_logprobs.append if request.prompt_logprobs else None,
                        options=options if options.topk_sample or options.asks_prompt() else None,
                        on_prompt_scores=scores.append if options.asks_prompt() else None)
        return job, prompt.length

    def _default_stop_ids(self) -> list[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None) or self.model.config.eos_token_id
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]

    def _tokenizer_for(self, stop: Any) -> Any:
        """The model's tokenizer when stop strings need decoding (loaded once), else None."""
        if not (isinstance(stop, str) or (isinstance(stop, list) and stop and isinstance(stop[0], str))):
            return None
        if self._tokenizer is None:
            try:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            except (OSError, ValueError) as exc:
                raise ValidationError(
                    f"stop strings need the model's tokenizer, which cannot be loaded from {self.model_dir} "
                    f"({exc}); pass stop token ids instead"
                ) from exc
        return self._tokenizer


def tokens_of(item: LossItem) -> int:
    return sum(d.model_input.length for d in item.data)


def sample_response(sequences: list[types.SampledSequence], prompt_logprobs: list[Any],
                    prompt_scores: list[Any] | None = None) -> bytes:
    response = types.SampleResponse(sequences=sequences)
    if prompt_logprobs:
        response.prompt_logprobs = [None, *prompt_logprobs[0][1:].tolist()]
    if prompt_scores:
        scores = prompt_scores[0]  # worker/sampling/prompt_scores.PromptScores
        response.topk_prompt_logprobs = scores.topk
        if scores.targets is not None:
            response.target_prompt_logprobs = types.TensorData(scores.targets, "float32")
        if scores.alt_tokens is not None:
            response.prompt_alt_tokens = types.PromptAltTokens(
                tokens=types.TensorData(scores.alt_tokens, "int64"),
                logprobs=types.TensorData(scores.alt_logprobs, "float32"))
    return codec.packb(messages.encode_sample_response(response))


def flag(body: Any, key: str, default: bool, op: str) -> bool:
    """A True/False field of a request body (``default`` when absent); anything else is a user error."""
    value = body.get(key, default) if isinstance(body, dict) else default
    if not isinstance(value, bool):
        raise ValidationError(f"{op} {key}= must be True or False, got {value!r:.80}")
    return value


def expires_at_of(body: Any) -> float | None:
    """When a save with the body's ``ttl_seconds`` expires (unix seconds), or None: kept until deleted."""
    ttl_seconds = body.get("ttl_seconds") if isinstance(body, dict) else None
    validate_ttl_seconds(ttl_seconds)
    return None if ttl_seconds is None else checkpoints.now() + ttl_seconds


def run_pass(items: list[LossItem], backward: bool) -> None:
    """One LoRA pass over ``items`` (loss requests checked by :meth:`Operations.checked_loss`, each with its
    session as ``target``): each item gets its ``output``, or its ``error`` when the pass refused or failed (then
    every engine was put back as it was)."""
    base = items[0].target.pass_group  # the frozen base they share (a shard group's runs it on every rank)
    try:
        base.run_pass(items, backward)
    except TinkerqError as exc:
        for item in items:
            item.error = exc
    except Exception as exc:
        log.exception("a LoRA pass over %d requests failed", len(items))
        for item in items:
            item.error = WorkerError(f"the LoRA pass failed in the worker ({type(exc).__name__}: {exc}); "
                                     f"nothing was applied")

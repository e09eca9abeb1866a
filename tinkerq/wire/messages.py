"""Requests and results as msgpack maps, and their conversion to and from :mod:`tinkerq.types`.

A Celery task of tinkerq takes exactly one argument, the *envelope*::

    {"v": 1, "op": "forward_backward", "model_id": "...", "seq_id": 7, "payload": <payload ref>, "sent_at": t}

and returns a *reply*: ``{"ok": True, "payload": <payload ref>}`` or ``{"ok": False, "error": {...}}``, both
with an optional ``"timing"`` map (queue_wait_s, compute_s, tokens, tokens_per_s).
A payload ref is a claim check (:mod:`tinkerq.wire.claimcheck`) on msgpack bytes of the op's body.
Keeping the body as separately encoded bytes lets the worker decode it inside the task, so a malformed
body becomes an error on the caller's future instead of a message Celery drops.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from tinkerq import optimizers, types
from tinkerq.errors import MalformedMessageError, TinkerqError, error_from_wire
from tinkerq.validation import PromptOptions
from tinkerq.wire import codec

WIRE_VERSION = 1
MODEL_ID_RE = re.compile(r"^[0-9a-f]{32}$")
TASK_ID_RE = re.compile(r"^[A-Za-z0-9-]{1,64}$")
# Message header naming the sender's reply inbox (tinkerq.keys.reply_list): readable even when a body is not.
REPLY_HEADER = "tinkerq_reply"


# -- envelope -----------------------------------------------------------------------------------------

def make_envelope(op: str, model_id: str, seq_id: int, payload_ref: dict[str, Any]) -> dict[str, Any]:
    # sent_at (wall clock) lets the worker report how long the request waited in the queue.
    return {"v": WIRE_VERSION, "op": op, "model_id": model_id, "seq_id": seq_id, "payload": payload_ref,
            "sent_at": time.time()}


def check_envelope(envelope: Any, expected_op: str) -> tuple[str, int, Any]:
    """Return (model_id, seq_id, payload_ref) or raise MalformedMessageError naming the defect."""
    if not isinstance(envelope, dict):
        raise MalformedMessageError(f"request envelope must be a map, got {type(envelope).__name__}")
    if envelope.get("v") != WIRE_VERSION:
        raise MalformedMessageError(
            f"request envelope version {envelope.get('v')!r} is not supported (this worker speaks "
            f"{WIRE_VERSION}); upgrade the producer and worker to the same tinkerq release"
        )
    if envelope.get("op") != expected_op:
        raise MalformedMessageError(f"envelope op {envelope.get('op')!r} sent to the {expected_op} task")
    model_id, seq_id = envelope.get("model_id"), envelope.get("seq_id")
    # Session ids name directories under the checkpoint directory: only what the producer mints (uuid4 hex).
    if not isinstance(model_id, str) or not MODEL_ID_RE.match(model_id):
        raise MalformedMessageError(f"envelope model_id must be 32 lowercase hex digits, got {model_id!r:.80}")
    if not isinstance(seq_id, int) or isinstance(seq_id, bool) or seq_id < 0:
        raise MalformedMessageError(f"envelope seq_id must be a non-negative integer, got {seq_id!r}")
    return model_id, seq_id, envelope.get("payload")


def ok_reply(payload_ref: dict[str, Any]) -> dict[str, Any]:
    return {"ok": True, "payload": payload_ref}


def error_reply(error: TinkerqError) -> dict[str, Any]:
    return {"ok": False, "error": error.to_wire()}


def make_reply_item(task_id: str, reply: dict[str, Any]) -> bytes:
    """What a worker pushes to a producer's reply inbox: the task id and its reply, in one msgpack map."""
    return codec.packb({"task_id": task_id, "reply": reply})


def make_sample_item(task_id: str, inbox: str, envelope: dict[str, Any]) -> bytes:
    """A sample request as pushed to a worker's sampling intake (tinkerq.keys.sample_queue)."""
    return codec.packb({"task_id": task_id, "inbox": inbox, "envelope": envelope})


def make_publish_item(snapshot_id: str) -> bytes:
    """A worker's request to a snapshot's owner, through the owner's sampling intake: publish its weights."""
    return codec.packb({"publish": snapshot_id})


def read_intake_item(item: bytes, max_bytes: int) -> tuple[str, str | None, Any] | str:
    """A sampling intake item: (task id, reply inbox or None, envelope) for a sample request, or the snapshot
    id of a publish request; MalformedMessageError naming the defect."""
    decoded = codec.unpackb(item, max_bytes=max_bytes)
    if not isinstance(decoded, dict):
        raise MalformedMessageError(f"sample intake item is a {type(decoded).__name__}, not a map")
    if "publish" in decoded:
        snapshot_id = decoded["publish"]
        if not isinstance(snapshot_id, str) or not MODEL_ID_RE.match(snapshot_id):
            raise MalformedMessageError(f"publish request for {snapshot_id!r:.80}: not a snapshot id")
        return snapshot_id
    task_id, inbox = decoded.get("task_id"), decoded.get("inbox")
    if not isinstance(task_id, str) or not TASK_ID_RE.match(task_id):
        raise MalformedMessageError(f"sample intake item has no valid task id (got {task_id!r:.80})")
    return task_id, inbox if isinstance(inbox, str) else None, decoded.get("envelope")


def read_reply_item(item: bytes) -> tuple[str, Any]:
    """(task id, reply) from an inbox item; MalformedMessageError if it is not one."""
    decoded = codec.unpackb(item)
    if not isinstance(decoded, dict) or not isinstance(decoded.get("task_id"), str):
        raise MalformedMessageError("reply inbox item is not a {task_id, reply} map")
    return decoded["task_id"], decoded.get("reply")


def reply_error(reply: Any) -> TinkerqError | None:
    """The error a reply carries, or None if it succeeded."""
    if isinstance(reply, dict) and reply.get("ok") is True:
        return None
    if isinstance(reply, dict) and reply.get("ok") is False:
        return error_from_wire(reply.get("error"))
    return error_from_wire(None)


# -- datums ---------------------------------------------------------------------------------------------

def encode_datum(datum: types.Datum) -> dict[str, Any]:
    return {
        "tokens": datum.model_input.to_numpy(),
        "inputs": {k: v.to_numpy() for k, v in datum.loss_fn_inputs.items()},
    }


def decode_datum(obj: Any, index: int) -> types.Datum:
    if not isinstance(obj, dict):
        raise MalformedMessageError(f"datum {index}: must be a map, got {type(obj).__name__}")
    tokens, inputs = obj.get("tokens"), obj.get("inputs")
    if not isinstance(tokens, np.ndarray):
        raise MalformedMessageError(f"datum {index}: model_input tokens must be an array")
    if not isinstance(inputs, dict):
        raise MalformedMessageError(f"datum {index}: loss_fn_inputs must be a map")
    loss_fn_inputs: dict[str, types.TensorData] = {}
    for key, value in inputs.items():
        if not isinstance(value, np.ndarray):
            raise MalformedMessageError(f"datum {index}: loss_fn_inputs[{key!r}] must be an array")
        loss_fn_inputs[key] = types.TensorData.from_numpy(value)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens))
    datum.loss_fn_inputs = loss_fn_inputs  # already TensorData: skip coercion, the validator checks dtypes
    return datum


# -- request bodies ---------------------------------------------------------------------------------------

def encode_loss_request(data: list[types.Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None) -> dict:
    return {"loss_fn": loss_fn, "loss_fn_config": loss_fn_config, "data": [encode_datum(d) for d in data]}


def decode_loss_request(body: Any) -> tuple[list[types.Datum], str, dict[str, Any] | None]:
    if not isinstance(body, dict):
        raise MalformedMessageError("forward/forward_backward body must be a map")
    data, loss_fn, config = body.get("data"), body.get("loss_fn"), body.get("loss_fn_config")
    if not isinstance(data, list):
        raise MalformedMessageError("forward/forward_backward body needs a list 'data'")
    if not isinstance(loss_fn, str):
        raise MalformedMessageError("forward/forward_backward body needs a string 'loss_fn'")
    if config is not None and not isinstance(config, dict):
        raise MalformedMessageError("loss_fn_config must be a map or None")
    return [decode_datum(d, i) for i, d in enumerate(data)], loss_fn, config


def encode_adam(params: types.AdamParams) -> dict[str, Any]:
    return {"adam": asdict(params)}


def encode_optim(params: types.OptimParams) -> dict[str, Any]:
    """An optim_step body: ``{"adam": AdamParams' fields}`` or ``{"dimuon": DimuonParams' fields}``."""
    if isinstance(params, types.DimuonParams):
        return {"dimuon": asdict(params)}
    return encode_adam(params)


def decode_optim(body: Any) -> types.OptimParams:
    """An optim_step body's hyperparameters (values are checked by :func:`tinkerq.optimizers.validate`)."""
    family = next((k for k in ("adam", "dimuon") if isinstance(body, dict) and k in body), None)
    if family is None:
        raise MalformedMessageError("optim_step body needs a map 'adam' or 'dimuon'")
    cls: type[types.AdamParams] | type[types.DimuonParams] = types.AdamParams if family == "adam" \
        else types.DimuonParams
    fields = body[family]
    if not isinstance(fields, dict):
        raise MalformedMessageError(f"optim_step body's '{family}' must be a map, got {type(fields).__name__}")
    _reject_unknown_fields(cls, fields)
    for key, value in fields.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise MalformedMessageError(f"{cls.__name__}.{key} must be a number, got {value!r}")
    if cls is types.DimuonParams and "learning_rate" not in fields:
        raise MalformedMessageError("DimuonParams.learning_rate is missing from the optim_step body")
    return cls(**{k: float(v) for k, v in fields.items()})


def encode_optimizer(config: types.OptimizerConfig) -> dict[str, Any]:
    """A create_model body's ``optimizer`` (the client's optimizer family, fixed for its life)."""
    return optimizers.encode_config(config)


def decode_optimizer(raw: Any) -> types.OptimizerConfig:
    """A create_model body's ``optimizer`` map (absent: AdamW, as before the field existed); a config this server
    does not serve is a ValidationError."""
    if raw is not None and not isinstance(raw, dict):
        raise MalformedMessageError(f"create_model 'optimizer' must be a map, got {type(raw).__name__}")
    return optimizers.config_of(raw)


def encode_lora(config: types.LoraConfig) -> dict[str, Any]:
    return asdict(config)


def decode_lora(raw: Any) -> types.LoraConfig | None:
    """A create_model body's ``lora`` map (None: a full-parameter session). Values are checked by
    :func:`tinkerq.validation.validate_lora`."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise MalformedMessageError(f"create_model 'lora' must be a map, got {type(raw).__name__}")
    _reject_unknown_fields(types.LoraConfig, raw)
    return types.LoraConfig(**raw)


# -- results ------------------------------------------------------------------------------------------------

def encode_forward_backward_output(out: types.ForwardBackwardOutput) -> dict[str, Any]:
    return {
        "loss_fn_output_type": out.loss_fn_output_type,
        "outputs": [{k: v.to_numpy() for k, v in o.items()} for o in out.loss_fn_outputs],
        "metrics": {k: float(v) for k, v in out.metrics.items()},
    }


def decode_forward_backward_output(body: Any) -> types.ForwardBackwardOutput:
    try:
        return types.ForwardBackwardOutput(
            loss_fn_output_type=str(body["loss_fn_output_type"]),
            loss_fn_outputs=[{k: types.TensorData.from_numpy(v) for k, v in o.items()} for o in body["outputs"]],
            metrics={str(k): float(v) for k, v in body["metrics"].items()},
        )
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise MalformedMessageError(f"forward_backward result is malformed: {exc}") from exc


def decode_optim_step_response(body: Any) -> types.OptimStepResponse:
    metrics = body.get("metrics") if isinstance(body, dict) else None
    if not isinstance(metrics, dict):
        raise MalformedMessageError("optim_step result is malformed")
    return types.OptimStepResponse(metrics={str(k): float(v) for k, v in metrics.items()})


def decode_model_info(body: Any) -> types.ModelInfo:
    try:
        return types.ModelInfo(**body)
    except TypeError as exc:
        raise MalformedMessageError(f"create_model result is malformed: {exc}") from exc


# -- sampling -----------------------------------------------------------------------------------------------

@dataclass
class SampleRequest:
    """A decoded sample body. Values are checked by :func:`tinkerq.validation.validate_sampling`."""

    source: dict[str, Any]
    prompt: types.ModelInput
    num_samples: Any
    params: types.SamplingParams
    # Tinker's include_prompt_logprobs (and compute_logprobs): log p(prompt[i] | prompt[:i]) in the reply too.
    prompt_logprobs: bool = False
    # Tinker's top-k, target-token and alternative-token options (checked by validate_prompt_options).
    options: PromptOptions = field(default_factory=PromptOptions)


def encode_sample_request(source: dict[str, Any], prompt: types.ModelInput, num_samples: int,
                          params: types.SamplingParams, *, prompt_logprobs: bool = False,
                          options: PromptOptions | None = None) -> dict[str, Any]:
    """``source`` names the weights: ``{"snapshot": id}``, ``{"path": dir}`` or ``{"base": True}``."""
    stop: Any = params.stop
    if stop is not None and not isinstance(stop, str):
        stop = list(stop)
    body = {
        "source": source, "prompt": prompt.to_numpy(), "num_samples": num_samples,
        "params": {"max_tokens": params.max_tokens, "seed": params.seed, "stop": stop,
                   "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p},
    }
    if prompt_logprobs:  # absent when not asked: the body an older worker understands
        body["prompt_logprobs"] = True
    if options is not None:  # likewise, each only when asked
        for name, value in _option_fields(options):
            if value:
                body[name] = value
        if options.targets is not None:
            body["targets"] = np.asarray(options.targets, dtype=np.int64)
    return body


def _option_fields(options: PromptOptions) -> list[tuple[str, int]]:
    return [("topk_prompt", options.topk_prompt), ("topk_sample", options.topk_sample), ("alt_k", options.alt_k)]


def decode_sample_request(body: Any) -> SampleRequest:
    if not isinstance(body, dict):
        raise MalformedMessageError("sample body must be a map")
    source, prompt, params = check_source(body.get("source")), body.get("prompt"), body.get("params")
    if not isinstance(prompt, np.ndarray):
        raise MalformedMessageError("sample body needs an array 'prompt'")
    if not isinstance(params, dict):
        raise MalformedMessageError("sample body needs a map 'params'")
    _reject_unknown_fields(types.SamplingParams, params)
    prompt_logprobs = body.get("prompt_logprobs", False)
    if not isinstance(prompt_logprobs, bool):
        raise MalformedMessageError(f"sample body 'prompt_logprobs' must be true or false, got {prompt_logprobs!r:.80}")
    targets = body.get("targets")
    if targets is not None and not isinstance(targets, np.ndarray):
        raise MalformedMessageError("sample body 'targets' must be an array")
    options = PromptOptions(topk_prompt=body.get("topk_prompt", 0), topk_sample=body.get("topk_sample", 0),
                            targets=targets, alt_k=body.get("alt_k", 0))
    return SampleRequest(source, types.ModelInput.from_ints(prompt), body.get("num_samples"),
                         types.SamplingParams(**params), prompt_logprobs, options)


def check_source(source: Any) -> dict[str, Any]:
    """The weights a sample request names: exactly one of a snapshot id (32 hex), a saved path, the base model."""
    if not isinstance(source, dict) or len(source) != 1:
        raise MalformedMessageError("sample body needs a map 'source' with one of: snapshot, path, base")
    (kind, value), = source.items()
    if kind == "snapshot" and isinstance(value, str) and MODEL_ID_RE.match(value):
        return source
    if kind == "path" and isinstance(value, str) and value:
        return source
    if kind == "base" and value is True:
        return source
    raise MalformedMessageError(f"sample source {kind!r}: {value!r:.80} is not a snapshot id (32 hex digits), "
                                f"a saved path or base=True")


def encode_sample_response(response: types.SampleResponse) -> dict[str, Any]:
    body: dict[str, Any] = {"sequences": [_encode_sequence(s) for s in response.sequences]}
    if response.prompt_logprobs is not None:  # (P,) float32; NaN where there is no number (position 0)
        body["prompt_logprobs"] = np.array([np.nan if x is None else x for x in response.prompt_logprobs],
                                           dtype=np.float32)
    if response.topk_prompt_logprobs is not None:
        body["topk_prompt"] = _encode_topk(response.topk_prompt_logprobs)
    if response.target_prompt_logprobs is not None:
        body["targets"] = np.asarray(response.target_prompt_logprobs.to_numpy(), dtype=np.float32)
    if response.prompt_alt_tokens is not None:
        alt = response.prompt_alt_tokens
        body["alt"] = {"tokens": np.asarray(alt.tokens.to_numpy(), dtype=np.int64),
                       "logprobs": np.asarray(alt.logprobs.to_numpy(), dtype=np.float32)}
    return body


def _encode_topk(topk: types.TopkLogprobs) -> dict[str, Any]:
    return {"ids": np.asarray(topk.token_ids, dtype=np.int32), "logprobs": np.asarray(topk.logprobs, dtype=np.float32)}


def _decode_topk(raw: Any) -> types.TopkLogprobs | None:
    if raw is None:
        return None
    ids, lps = raw["ids"], raw["logprobs"]
    if not isinstance(ids, np.ndarray) or not isinstance(lps, np.ndarray) or ids.ndim != 2 or ids.shape != lps.shape:
        raise ValueError("top-k logprobs must be two (N, k) arrays of one shape")
    return types.TopkLogprobs(token_ids=np.array(ids, dtype=np.int32), logprobs=np.array(lps, dtype=np.float32))


def _encode_sequence(s: types.SampledSequence) -> dict[str, Any]:
    out: dict[str, Any] = {"stop_reason": s.stop_reason, "tokens": np.asarray(s.tokens, dtype=np.int64),
                           "logprobs": None if s.logprobs is None else np.asarray(s.logprobs, dtype=np.float32)}
    if s.sequence_id is not None:
        out["sequence_id"] = s.sequence_id
    if s.topk_logprobs is not None:
        out["topk"] = _encode_topk(s.topk_logprobs)
    return out


def decode_sample_response(body: Any) -> types.SampleResponse:
    try:
        sequences = [
            types.SampledSequence(
                stop_reason=s["stop_reason"], tokens=[int(t) for t in s["tokens"]],
                logprobs=None if s["logprobs"] is None else [float(x) for x in s["logprobs"]],
                sequence_id=None if s.get("sequence_id") is None else str(s["sequence_id"]),
                topk_logprobs=_decode_topk(s.get("topk")),
            )
            for s in body["sequences"]
        ]
        targets, alt = body.get("targets"), body.get("alt")
        return types.SampleResponse(
            sequences=sequences, prompt_logprobs=_decode_prompt_logprobs(body.get("prompt_logprobs")),
            topk_prompt_logprobs=_decode_topk(body.get("topk_prompt")),
            target_prompt_logprobs=None if targets is None else types.TensorData(targets, "float32"),
            prompt_alt_tokens=None if alt is None else types.PromptAltTokens(
                tokens=types.TensorData(alt["tokens"], "int64"), logprobs=types.TensorData(alt["logprobs"], "float32")),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise MalformedMessageError(f"sample result is malformed: {exc}") from exc


def _decode_prompt_logprobs(raw: Any) -> list[float | None] | None:
    """The reply's (P,) array as Tinker's list: None at position 0 (nothing predicts the first token)."""
    if raw is None:
        return None
    if not isinstance(raw, np.ndarray) or raw.ndim != 1 or raw.shape[0] < 1:
        raise MalformedMessageError("sample result 'prompt_logprobs' must be a non-empty 1-D array")
    return [None, *(float(x) for x in raw[1:])]


def _reject_unknown_fields(cls: type, values: dict[str, Any]) -> None:
    """A map meant for dataclass ``cls`` may hold only its fields (a newer client's extras are refused)."""
    unknown = set(values) - {f.name for f in fields(cls)}
    if unknown:
        raise MalformedMessageError(f"unknown {cls.__name__} fields: {sorted(unknown)}")

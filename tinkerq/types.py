"""Tinker-compatible data types: the same names and fields as the public ``tinker`` SDK.

These are plain classes over numpy arrays (no torch, no pydantic). ``TensorData`` keeps its values as a
numpy array internally, so a 16x4096 batch is never turned into Python lists on the hot path; the
Tinker-style ``data`` / ``tolist()`` views are computed on demand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

import numpy as np

# dtypes the Tinker API speaks for TensorData.
TensorDtype = Literal["int64", "float32"]
_TENSOR_DTYPES: dict[str, np.dtype] = {"int64": np.dtype(np.int64), "float32": np.dtype(np.float32)}

# Plain lists / arrays given as loss_fn_inputs are coerced by key (Tinker does the same).
LOSS_INPUT_DTYPES: dict[str, TensorDtype] = {
    "target_tokens": "int64",
    "weights": "float32",
    "advantages": "float32",
    "logprobs": "float32",
    "sequence_ratio_mask": "float32",
}


class TensorData:
    """A flat tensor with a dtype ("int64" | "float32") and an optional shape."""

    __slots__ = ("_array",)

    def __init__(self, data: Any, dtype: str | None = None, shape: Sequence[int] | None = None) -> None:
        array = np.asarray(data)
        if dtype is not None:
            if dtype not in _TENSOR_DTYPES:
                raise ValueError(f"TensorData dtype must be one of {sorted(_TENSOR_DTYPES)}, got {dtype!r}")
            array = array.astype(_TENSOR_DTYPES[dtype], copy=False)
        if shape is not None:
            array = array.reshape(tuple(shape))
        self._array = array

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        return cls(array)

    @classmethod
    def from_torch(cls, tensor: Any) -> TensorData:
        return cls(tensor.detach().cpu().numpy())

    def to_numpy(self) -> np.ndarray:
        return self._array

    def to_torch(self) -> Any:
        import torch  # lazy: the core never imports torch at module level

        return torch.from_numpy(np.array(self._array))  # a writable copy

    def tolist(self) -> list[Any]:
        return self._array.reshape(-1).tolist()

    @property
    def data(self) -> list[Any]:
        return self.tolist()

    @property
    def dtype(self) -> str:
        return self._array.dtype.name

    @property
    def shape(self) -> list[int]:
        return list(self._array.shape)

    def __len__(self) -> int:
        return int(self._array.shape[0]) if self._array.ndim else 1

    def __repr__(self) -> str:
        return f"TensorData(dtype={self.dtype}, shape={self.shape})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TensorData)
            and self.dtype == other.dtype
            and np.array_equal(self._array, other._array)
        )


@dataclass
class EncodedTextChunk:
    tokens: Sequence[int]
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class ModelInput:
    chunks: list[EncodedTextChunk] = field(default_factory=list)

    @classmethod
    def from_ints(cls, tokens: Sequence[int] | np.ndarray) -> ModelInput:
        return cls(chunks=[EncodedTextChunk(tokens=tokens)])  # type: ignore[arg-type]  # an array is kept as is

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(chunks=[])

    def append_int(self, token: int) -> ModelInput:
        return ModelInput(chunks=[*self.chunks, EncodedTextChunk(tokens=[token])])

    def to_ints(self) -> list[int]:
        return [int(t) for chunk in self.chunks for t in chunk.tokens]

    def to_numpy(self) -> np.ndarray:
        """All tokens as one array, int64 when they are integers.

        Non-integer tokens are passed through unchanged (not truncated) so validation can name them.
        """
        parts = [np.asarray(c.tokens) for c in self.chunks]
        parts = [p.astype(np.int64, copy=False) if p.dtype.kind in "iu" or p.size == 0 else p for p in parts]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(parts)

    @property
    def length(self) -> int:
        return sum(c.length for c in self.chunks)


def _coerce_loss_input(key: str, value: Any) -> TensorData:
    if isinstance(value, TensorData):
        return value  # explicit TensorData keeps its dtype; the validator checks it
    dtype = LOSS_INPUT_DTYPES.get(key)
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    elif hasattr(value, "to_numpy"):  # the tinker SDK's TensorData (its own class, same fields)
        return TensorData(value.to_numpy())
    return TensorData(value, dtype=dtype)


@dataclass
class Datum:
    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.loss_fn_inputs = {k: _coerce_loss_input(k, v) for k, v in dict(self.loss_fn_inputs).items()}


@dataclass
class AdamParams:
    """AdamW hyper-parameters with Tinker's defaults (decoupled weight decay, as torch.optim.AdamW)."""

    type: ClassVar[str] = "adamw"  # the optimizer family these parameters step (AdamOptimizerConfig)

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 = no clipping; otherwise the global L2 norm


@dataclass
class DimuonParams:
    """One Dimuon step's hyper-parameters (docs/optimizers.md: tinkerq's definition of the update). Tinker's
    fields: ``learning_rate`` (required), ``grad_clip_norm`` (<= 0: no clipping), ``beta1`` (the momentum's EMA
    coefficient); and the two its docs list that SDK 0.38's class no longer carries, ``damping`` (of the
    row/column preconditioner) and ``rank_lr_correction_exponent`` (of the learning rate's correction relative to
    LoRA rank 32). An omitted setting takes its default at every step."""

    type: ClassVar[str] = "dimuon"

    learning_rate: float
    grad_clip_norm: float = 0.0
    beta1: float = 0.9
    damping: float = 1e-4
    rank_lr_correction_exponent: float = 0.175


OptimParams = AdamParams | DimuonParams


@dataclass(frozen=True)
class AdamOptimizerConfig:
    """The optimizer a training client is created with (``optimizer=``; fixed for its life): AdamW, the default,
    stepped with :class:`AdamParams`."""

    type: Literal["adamw"] = "adamw"


@dataclass(frozen=True)
class DimuonOptimizerConfig:
    """Dimuon (version 1, docs/optimizers.md), stepped with :class:`DimuonParams`."""

    type: Literal["dimuon"] = "dimuon"
    version: Literal[1] = 1


OptimizerConfig = AdamOptimizerConfig | DimuonOptimizerConfig


LossFnOutput = dict[str, TensorData]


@dataclass
class ForwardBackwardOutput:
    loss_fn_output_type: str
    loss_fn_outputs: list[LossFnOutput]
    metrics: dict[str, float]


@dataclass
class OptimStepResponse:
    metrics: dict[str, float] | None = None


@dataclass
class LoraConfig:
    """A LoRA session's adapter (Tinker's semantics, docs/lora.md): ``W + (32 / rank) * B @ A`` on the attention
    projections (``train_attn``), the MLP projections (``train_mlp``) and the output projection
    (``train_unembed``); A starts as PEFT initialises it from ``seed``, B at zero."""

    rank: int = 32
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    ALPHA = 32  # fixed, as Tinker: scaling = ALPHA / rank, so the best learning rate hardly depends on rank

    @property
    def scaling(self) -> float:
        return self.ALPHA / self.rank


@dataclass
class ModelInfo:
    """What a worker tells a new training client about the model it serves."""

    model_id: str
    base_model: str
    vocab_size: int
    max_seq_len: int
    num_parameters: int
    worker: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class SaveWeightsResponse:
    path: str


# Tinker's names for what save_weights_for_sampler / load_state* give back.
SaveWeightsForSamplerResponse = SaveWeightsResponse


@dataclass
class LoadWeightsResponse:
    path: str | None = None
    model_id: str | None = None


@dataclass
class SupportedModel:
    model_name: str | None = None
    max_context_length: int | None = None
    trainable: bool | None = None
    sampleable: bool | None = None


@dataclass
class GetServerCapabilitiesResponse:
    supported_models: list[SupportedModel] = field(default_factory=list)

    @classmethod
    def from_workers(cls, records: list[dict[str, Any]]) -> GetServerCapabilitiesResponse:
        """What the fleet serves, from the live workers' registrations (the producer and the gateway both answer
        with this): each base model some worker serves, trainable where a worker that is not a sampler
        (``--role sampler``) serves it, sampleable always (trainers sample too), with the longest context any of
        its workers takes."""
        models: dict[str, SupportedModel] = {}
        for record in records:
            name = str(record["base_model"])
            model = models.setdefault(name, SupportedModel(model_name=name, trainable=False, sampleable=True))
            if record.get("role", "trainer") != "sampler":
                model.trainable = True
            if isinstance(record.get("max_seq_len"), int):
                model.max_context_length = max(model.max_context_length or 0, record["max_seq_len"])
        return cls(supported_models=[models[name] for name in sorted(models)])


@dataclass
class SamplingParams:
    """Tinker's sampling parameters. ``stop``: strings, token ids, or None (= the model's end-of-sequence)."""

    max_tokens: int | None = None
    seed: int | None = None
    stop: str | Sequence[str] | Sequence[int] | None = None
    temperature: float = 1.0
    top_k: int = -1  # -1 = no top-k filter
    top_p: float = 1.0


# An empty cell of a TopkLogprobs (Tinker's sentinel): token id 0 with this logprob.
TOPK_MASK_LOGPROB = -99999.0


@dataclass
class TopkLogprobs:
    """The k most likely tokens at each of N positions, most likely first (Tinker's ``TopkLogprobs``): log p at
    temperature 1, as ``logprobs`` are. A position with nothing computed is a row of sentinels (id 0,
    TOPK_MASK_LOGPROB)."""

    token_ids: np.ndarray  # (N, k) int32
    logprobs: np.ndarray  # (N, k) float32

    def to_lists(self) -> list[list[tuple[int, float]] | None]:
        """Per position: k (token id, logprob) pairs, or None where nothing was computed (the SDK's list form)."""
        return [None if row_ids.size and row_ids[0] == 0 and row_lps[0] == TOPK_MASK_LOGPROB
                else list(zip(row_ids.tolist(), row_lps.tolist(), strict=True))
                for row_ids, row_lps in zip(self.token_ids, self.logprobs, strict=True)]


@dataclass
class PromptAltTokens:
    """Tinker's ``prompt_alt_tokens``: row i holds k independent draws, at the request's temperature, from the
    model's distribution over prompt token i + 1, and their log p (temperature 1); both (len(prompt) - 1, k)."""

    tokens: TensorData  # int64
    logprobs: TensorData  # float32


@dataclass
class SampledSequence:
    stop_reason: Literal["stop", "length"]
    tokens: list[int]
    # log p(token) under the sampled weights at temperature 1: what ``forward`` computes for the same tokens.
    logprobs: list[float] | None = None
    sequence_id: str | None = None  # set by the HTTP gateway's clients (Tinker's sample_sequence_ids)
    # With topk_sample_logprobs=k: the k most likely tokens at each sampled position, (len(tokens), k).
    topk_logprobs: TopkLogprobs | None = None


@dataclass
class SampleResponse:
    sequences: list[SampledSequence]
    # With include_prompt_logprobs: log p(prompt[i] | prompt[:i]) for every prompt position, None at 0.
    prompt_logprobs: list[float | None] | None = None
    # With topk_prompt_logprobs=k: the k most likely tokens at every prompt position, (len(prompt), k), row 0 empty.
    topk_prompt_logprobs: TopkLogprobs | None = None
    # With target_prompt_logprobs=ids ((len(prompt) - 1, K) int64): log p(ids[i, j] | prompt[:i + 1]), float32 of
    # the same shape, 0.0 where ids has -1.
    target_prompt_logprobs: TensorData | None = None
    # With prompt_alt_tokens_k=k: k draws per prompt position after the first.
    prompt_alt_tokens: PromptAltTokens | None = None




# Code written for the official SDK builds tinker.types objects. They have the same fields as ours (pydantic
# models there, dataclasses here), so the producer converts them by shape, without importing the SDK (which
# would pull in torch). Anything that does not look like the expected type is returned unchanged, and
# validation then refuses it with its usual message.


def as_model_input(obj: Any) -> Any:
    if isinstance(obj, ModelInput) or not isinstance(getattr(obj, "chunks", None), (list, tuple)):
        return obj
    chunks = []
    for chunk in obj.chunks:
        tokens = getattr(chunk, "tokens", None)
        if tokens is None:
            return obj  # an image chunk: validation says only token input is served
        chunks.append(EncodedTextChunk(tokens=list(tokens)))
    return ModelInput(chunks=chunks)


def as_datum(obj: Any) -> Any:
    inputs = getattr(obj, "loss_fn_inputs", None)
    if isinstance(obj, Datum) or not hasattr(obj, "model_input") or not isinstance(inputs, Mapping):
        return obj
    return Datum(model_input=as_model_input(obj.model_input), loss_fn_inputs=dict(inputs))


def target_ids(obj: Any) -> Any:
    """Tinker's ``target_prompt_logprobs`` as a dense (len(prompt) - 1, K) int64 array, -1 in the cells a sparse
    CSR tensor leaves out: from a numpy array, our TensorData, the SDK's TensorData (dense or CSR: ``data``,
    ``shape``, ``sparse_crow_indices``, ``sparse_col_indices``) or a torch tensor. Anything else is returned
    unchanged (validation refuses it)."""
    if obj is None or isinstance(obj, np.ndarray):
        return obj
    if isinstance(obj, TensorData):
        return obj.to_numpy()
    crow, col = getattr(obj, "sparse_crow_indices", None), getattr(obj, "sparse_col_indices", None)
    data: Any = getattr(obj, "data", None)
    shape: Any = getattr(obj, "shape", None)
    try:
        values = np.asarray(data, dtype=np.int64).reshape(-1)  # (a CPU torch tensor's .data converts too)
        if crow is None:
            return values.reshape(tuple(shape)) if shape is not None else values
        dense = np.full(tuple(shape), -1, dtype=np.int64)
        crow_a, col_a = np.asarray(crow, dtype=np.int64), np.asarray(col, dtype=np.int64)
        rows = np.repeat(np.arange(len(crow_a) - 1), np.diff(crow_a))
        dense[rows, col_a] = values
        return dense
    except (TypeError, ValueError, IndexError):
        return obj


def as_sampling_params(obj: Any) -> Any:
    if obj is None or isinstance(obj, SamplingParams) or not hasattr(obj, "max_tokens"):
        return obj
    return SamplingParams(**{f.name: getattr(obj, f.name) for f in fields(SamplingParams) if hasattr(obj, f.name)})

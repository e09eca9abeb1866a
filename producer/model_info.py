"""What ``TrainingClient.get_info()`` answers: tinkerq's ModelInfo that also reads as Tinker's GetInfoResponse."""

from __future__ import annotations

import dataclasses

from tinkerq import optimizers, types


@dataclasses.dataclass
class ModelData:
    """Tinker's ``GetInfoResponse.model_data``."""

    arch: str | None = None
    model_name: str | None = None
    tokenizer_id: str | None = None


@dataclasses.dataclass
class GetInfoResponse(types.ModelInfo):
    """``TrainingClient.get_info()``: tinkerq's :class:`tinkerq.types.ModelInfo` (vocab_size, max_seq_len,
    worker, extra...) that also reads as Tinker's ``GetInfoResponse`` (model_data.model_name, is_lora,
    lora_rank, model_name, optimizer_config)."""

    @classmethod
    def of(cls, info: types.ModelInfo) -> GetInfoResponse:
        if isinstance(info, cls):
            return info
        return cls(**{f.name: getattr(info, f.name) for f in dataclasses.fields(types.ModelInfo)})

    @property
    def model_data(self) -> ModelData:
        # The tokenizer is loaded from the model's directory (get_tokenizer()), so that is its id too.
        return ModelData(arch=self.extra.get("arch"), model_name=self.base_model, tokenizer_id=self.base_model)

    @property
    def model_name(self) -> str:
        return self.base_model

    @property
    def is_lora(self) -> bool:
        return isinstance(self.extra.get("lora"), dict)

    @property
    def lora_rank(self) -> int | None:
        lora = self.extra.get("lora")
        return int(lora["rank"]) if isinstance(lora, dict) and "rank" in lora else None

    @property
    def optimizer_config(self) -> types.OptimizerConfig:
        """The optimizer the session was created with (fixed for its life; docs/optimizers.md)."""
        return optimizers.config_of(self.extra.get("optimizer"))

"""The optimizers a training client can be created with, read from whatever spells them, and checked.

A training client's optimizer is chosen at creation (Tinker's ``optimizer=``, an ``OptimizerConfig``) and fixed for
its life; each ``optim_step`` then takes that family's hyperparameters: AdamW (the default) with ``AdamParams``,
Dimuon with ``DimuonParams`` (docs/optimizers.md: its update, as tinkerq defines it). Both sides use this module: the
producer and the gateway to refuse a mistake before it is sent, the worker because it trusts nothing on the wire.
Everything wrong is a :class:`~tinkerq.errors.ValidationError` (a user error) that names what to send instead.

Spellings read: tinkerq's dataclasses (:mod:`tinkerq.types`), the official SDK's pydantic classes
(``tinker.AdamOptimizerConfig``, ``tinker.DimuonOptimizerConfig``, ``tinker.DimuonParams`` and a raw
``tinker.types.optimizer.OptimParamsBase(type="dimuon", ...)``, which may carry the ``damping`` and
``rank_lr_correction_exponent`` that SDK 0.38's ``DimuonParams`` no longer has), and their JSON maps (the gateway's
request bodies, the wire).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tinkerq import types
from tinkerq.errors import ValidationError
from tinkerq.validation import validate_adam

ADAMW, DIMUON = "adamw", "dimuon"
DIMUON_VERSION = 1
# Dimuon's learning-rate correction is relative to this LoRA rank (Tinker's docs); full-parameter sessions use it
# as their rank, so they get no correction (docs/optimizers.md).
REFERENCE_RANK = 32
_PARAMS = {ADAMW: types.AdamParams, DIMUON: types.DimuonParams}
_CONFIG_NAMES = {ADAMW: "AdamOptimizerConfig", DIMUON: "DimuonOptimizerConfig"}
_DIMUON_FIELDS = tuple(f.name for f in dataclasses.fields(types.DimuonParams))


def _fields(raw: Any, what: str) -> dict[str, Any]:
    """The fields of a dataclass, a pydantic model (the SDK's, extra fields included) or a map."""
    if isinstance(raw, dict):
        return dict(raw)
    if dataclasses.is_dataclass(raw) and not isinstance(raw, type):
        found = dataclasses.asdict(raw)
        family = getattr(type(raw), "type", None)  # tinkerq's params: the family is a class attribute
        if isinstance(family, str):
            found["type"] = family
        return found
    dump = getattr(raw, "model_dump", None)
    if callable(dump):
        found = dump()
        if isinstance(found, dict):
            return found
    raise ValidationError(f"{what} must be an optimizer object or a map, got {type(raw).__name__}")


def config_of(raw: Any) -> types.OptimizerConfig:
    """The optimizer a client is created with: None is AdamW (Tinker's default)."""
    if raw is None or isinstance(raw, (types.AdamOptimizerConfig, types.DimuonOptimizerConfig)):
        return raw or types.AdamOptimizerConfig()
    fields = _fields(raw, "optimizer")
    kind = fields.pop("type", ADAMW)
    if kind == ADAMW:
        if fields:
            raise ValidationError(f"the AdamW optimizer config takes no fields beyond type, got {sorted(fields)}")
        return types.AdamOptimizerConfig()
    if kind == DIMUON:
        version = fields.pop("version", DIMUON_VERSION)
        if fields:
            raise ValidationError(f"DimuonOptimizerConfig takes type and version only, got also {sorted(fields)}")
        if version != DIMUON_VERSION or isinstance(version, bool):
            raise ValidationError(f"Dimuon version {version!r} is not served: this server implements version "
                                  f"{DIMUON_VERSION} (tinker.DimuonOptimizerConfig())")
        return types.DimuonOptimizerConfig()
    raise ValidationError(f"optimizer type {kind!r} is not served: this server trains with 'adamw' "
                          f"(AdamOptimizerConfig, the default) or 'dimuon' (DimuonOptimizerConfig)")


def encode_config(config: types.OptimizerConfig) -> dict[str, Any]:
    """The config as a JSON/msgpack map (the wire, records, checkpoint markers); :func:`config_of` reads it back."""
    return dataclasses.asdict(config)


def params_of(raw: Any) -> types.OptimParams:
    """An optim_step's hyperparameters, checked: AdamParams (any spelling; None: tinkerq's defaults) or Dimuon's,
    whose omitted fields take their defaults."""
    if raw is None:
        return types.AdamParams()
    if isinstance(raw, (types.AdamParams, types.DimuonParams)):
        validate(raw)
        return raw
    fields = _fields(raw, "optim_params")
    kind = fields.pop("type", ADAMW)
    if kind not in _PARAMS:
        raise ValidationError(f"optim_params of type {kind!r} are not served: this server takes AdamParams "
                              f"(type 'adamw') or DimuonParams (type 'dimuon')")
    known = [f.name for f in dataclasses.fields(_PARAMS[kind])]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ValidationError(f"{_PARAMS[kind].__name__} has no field(s) {unknown}; it takes {known}")
    if kind == DIMUON and "learning_rate" not in fields:
        raise ValidationError("DimuonParams.learning_rate is required (e.g. DimuonParams(learning_rate=1e-3))")
    params: types.OptimParams = _PARAMS[kind](**fields)
    validate(params)
    return params


def validate(params: Any) -> None:
    """ValidationError for the first bad value of an optim_step's hyperparameters."""
    if isinstance(params, types.DimuonParams):
        validate_dimuon(params)
    else:
        validate_adam(params)


def validate_dimuon(params: types.DimuonParams) -> None:
    for name in _DIMUON_FIELDS:
        value = getattr(params, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValidationError(f"DimuonParams.{name} must be a finite number, got {value!r}")
    if params.learning_rate < 0:
        raise ValidationError(f"DimuonParams.learning_rate must be >= 0, got {params.learning_rate}")
    if not 0.0 <= params.beta1 < 1.0:
        raise ValidationError(f"DimuonParams.beta1 must be in [0, 1), got {params.beta1}")
    if params.damping <= 0:
        raise ValidationError(f"DimuonParams.damping must be > 0 (it smooths the row/column preconditioner), got "
                              f"{params.damping}")
    if params.rank_lr_correction_exponent < 0:
        raise ValidationError(f"DimuonParams.rank_lr_correction_exponent must be >= 0 (0: no correction), got "
                              f"{params.rank_lr_correction_exponent}")


def check_matches(config: types.OptimizerConfig, params: types.OptimParams) -> None:
    """A client created with one optimizer steps with its hyperparameters only (the optimizer is fixed for the
    client's life)."""
    if params.type == config.type:
        return
    wanted, got = _PARAMS[config.type].__name__, type(params).__name__
    raise ValidationError(
        f"this training client was created with optimizer={_CONFIG_NAMES[config.type]}() and steps with {wanted}, "
        f"not {got}: the optimizer is fixed for a client's life; create a training client with "
        f"optimizer={_CONFIG_NAMES[params.type]}() to train with {got}")


def corrected_learning_rate(learning_rate: float, rank: int, exponent: float) -> float:
    """Dimuon's effective learning rate: ``learning_rate * (32 / rank) ** exponent`` (docs/optimizers.md)."""
    return learning_rate * (REFERENCE_RANK / rank) ** exponent


def describe(config: types.OptimizerConfig) -> str:
    return _CONFIG_NAMES[config.type] + "()"

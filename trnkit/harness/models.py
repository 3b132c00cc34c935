"""Model families behind one interface: ``model.spec = "<family>:<argument>"`` -> a :class:`ModelSpec`.

:data:`FAMILIES` maps each family to the module that implements it; a module offers
``build_spec(argument, overrides, *, name, seq_len, aux_loss_coef, kernels) -> ModelSpec`` and, when its model
config is a dataclass, ``CONFIG_CLASS``: ``model.config``'s overrides are then checked against that
class's fields and types here. A new model family is one module and one line in this table.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import typing

from trnkit.harness.config import ConfigError, TrainerConfig, _suggest, coerce
from trnkit.model_spec import ModelSpec

# family -> (the module implementing it, what follows "<family>:")
FAMILIES: dict[str, tuple[str, str]] = {
    "qwen3": ("trnkit.qwen3.spec", "<flavor>"),      # trnkit's native Qwen3 / Qwen3-MoE
    "hf": ("trnkit.harness.hf_spec", "<path>"),      # transformers v5 AutoModelForCausalLM from a folder
}


def spec_family(spec: str) -> tuple[str, str]:
    """``(family, argument)`` of a ``model.spec`` string; a ConfigError unless the family is known."""
    family, _, arg = spec.partition(":")
    if family not in FAMILIES or not arg:
        forms = " or ".join(f"'{f}:{form}'" for f, (_, form) in FAMILIES.items())
        raise ConfigError(f"config model.spec: must be {forms}, got {spec!r}")
    return family, arg


def build_spec(cfg: TrainerConfig) -> ModelSpec:
    """The :class:`ModelSpec` of ``cfg.model`` for a run of ``cfg.training.seq_len`` tokens; every mistake is a
    ConfigError naming the key, the rule and the value."""
    spec = cfg.model.spec
    family, arg = spec_family(spec)
    module = importlib.import_module(FAMILIES[family][0])
    overrides = dict(cfg.model.config)
    schema = getattr(module, "CONFIG_CLASS", None)
    if schema is not None:
        known = [f.name for f in dataclasses.fields(schema) if f.name != "kernels"]  # set from [overrides]
        unknown = [k for k in overrides if k not in known]
        if unknown:
            raise ConfigError(f"model.config: unknown {schema.__name__} field {unknown[0]!r}"
                              f"{_suggest(unknown[0], known)}; fields: {known}")
        hints = typing.get_type_hints(schema)
        overrides = {k: coerce(f"model.config.{k}", hints[k], v) for k, v in overrides.items()}  # the typed schema
    # the kernel choices of [overrides], for a family that binds them when it builds the model
    kernels = cfg.overrides.kernels() if cfg.overrides.policy != "off" else {}
    return module.build_spec(arg, overrides, name=spec, seq_len=cfg.training.seq_len,
                             aux_loss_coef=cfg.training.moe_aux_loss_coef, kernels=kernels)


def has_hf_weights(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return any(n.endswith(".safetensors") for n in names) or "model.safetensors.index.json" in names


__all__ = ["FAMILIES", "build_spec", "has_hf_weights", "spec_family"]

"""Model families behind one interface: ``model.spec = "<family>:<argument>"`` -> a :class:`ModelSpec`.

:data:`trnkit.harness.families.FAMILIES` maps each shipped family to the module that implements it (a family of
your own is named by its module path, ``"<package.module>:<argument>"``); a module offers
``build_spec(argument, overrides, *, name, seq_len, aux_loss_coef, kernels) -> ModelSpec`` and, when its model
config is a dataclass, ``CONFIG_CLASS``: ``model.config``'s overrides are then checked against that
class's fields and types here. A new model family is one module.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import typing

from trnkit.harness.config import ConfigError, TrainerConfig, _suggest, coerce
from trnkit.errors import TrnkitError
from trnkit.harness.families import FAMILIES, family_module, spec_family
from trnkit.harness.plugins import user_code_error
from trnkit.model_spec import ModelSpec


def build_spec(cfg: TrainerConfig, lnc: int = 0) -> ModelSpec:
    """The :class:`ModelSpec` of ``cfg.model`` for a run of ``cfg.training.seq_len`` tokens; every mistake is a
    ConfigError naming the key, the rule and the value. ``lnc``: the run's resolved LNC for the kernel choices
    (0: ``overrides.lnc`` as configured)."""
    spec = cfg.model.spec
    family, arg = spec_family(spec)
    name = family_module(family)
    own = family not in FAMILIES  # a family of your own: an error in its code is the user's to fix, as a plugin's
    try:
        module = importlib.import_module(name)
    except (Exception, SystemExit) as e:
        if isinstance(e, ModuleNotFoundError) and e.name is not None and (name == e.name or
                                                                            name.startswith(e.name + ".")):
            raise ConfigError(f"config model.spec: no module {name!r} for the family of {spec!r} ({e}); it must be "
                              "importable (on sys.path or PYTHONPATH)") from e
        if not own:
            raise
        raise ConfigError(f"config model.spec: cannot import the family module {name!r} of {spec!r}: "
                          f"{user_code_error(e, name)}") from e
    if not callable(getattr(module, "build_spec", None)):
        raise ConfigError(f"config model.spec: module {name!r} has no build_spec(argument, overrides, *, name, "
                          "seq_len, aux_loss_coef, kernels) function")
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
    if lnc:
        kernels = {op: dataclasses.replace(choice, lnc=lnc) for op, choice in kernels.items()}
    try:
        return module.build_spec(arg, overrides, name=spec, seq_len=cfg.training.seq_len,
                                 aux_loss_coef=cfg.training.moe_aux_loss_coef, kernels=kernels)
    except TrnkitError:  # the family's own message for the user
        raise
    except (Exception, SystemExit) as e:
        if not own:
            raise
        raise ConfigError(f"config model.spec: {name}.build_spec raised for {spec!r}: "
                          f"{user_code_error(e, name, 'in build_spec')}") from e


def has_hf_weights(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return any(n.endswith(".safetensors") for n in names) or "model.safetensors.index.json" in names


__all__ = ["build_spec", "has_hf_weights"]

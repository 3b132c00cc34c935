"""The model families a run can name: ``model.spec = "<family>:<argument>"``.

:data:`FAMILIES` maps each shipped family to the module that implements it (see :mod:`trnkit.harness.models`).
A family of your own needs no change here: name its module, ``model.spec = "<package.module>:<argument>"``
(a dotted name is a module path). The config check reads this table too, so it imports nothing of the harness.
"""

from __future__ import annotations

from trnkit.errors import ConfigError

# family -> (the module implementing it, what follows "<family>:")
FAMILIES: dict[str, tuple[str, str]] = {
    "qwen3": ("trnkit.qwen3.spec", "<flavor>"),      # trnkit's native Qwen3 / Qwen3-MoE
    "hf": ("trnkit.harness.hf_spec", "<path>"),      # transformers v5 AutoModelForCausalLM from a folder
}


def spec_family(spec: str) -> tuple[str, str]:
    """``(family, argument)`` of a ``model.spec`` string; a ConfigError unless the family is known or a dotted
    module path."""
    family, _, arg = spec.partition(":")
    if not arg or not (family in FAMILIES or _is_module_path(family)):
        forms = " or ".join(f"'{f}:{form}'" for f, (_, form) in FAMILIES.items())
        raise ConfigError(f"config model.spec: must be {forms}, got {spec!r} (a family of your own: "
                          "'<package.module>:<argument>', the module offering build_spec)")
    return family, arg


def family_module(family: str) -> str:
    """The module implementing ``family``: its :data:`FAMILIES` entry, else the family itself (a module path)."""
    return FAMILIES[family][0] if family in FAMILIES else family


def _is_module_path(name: str) -> bool:
    parts = name.split(".")
    return len(parts) > 1 and all(part.isidentifier() for part in parts)


__all__ = ["FAMILIES", "family_module", "spec_family"]

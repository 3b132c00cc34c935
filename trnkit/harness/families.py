"""The model families a run can name: ``model.spec = "<family>:<argument>"``.

:data:`FAMILIES` maps each family to the module that implements it (see :mod:`trnkit.harness.models`); a new
model family is one module and one line in this table. The config check reads it too, so it imports nothing
of the harness.
"""

from __future__ import annotations

from trnkit.errors import ConfigError

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


__all__ = ["FAMILIES", "spec_family"]

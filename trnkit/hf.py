"""trnkit's kernels in transformers models: one explicit entry point per supported model family.

::

    from trnkit.hf import apply_trnkit_to_qwen3_moe, revert

    report = apply_trnkit_to_qwen3_moe(model, rope=True, router=True, experts=True, rmsnorm=False)
    print(report.table())
    revert(model)

Each op argument is ``True`` (the entry point's ``impl`` / ``policy`` / ``block_size`` / ``lnc``, and for
``attention`` its ``fixed_shift``), an impl name, a :class:`~trnkit.overrides.KernelChoice` of its own, or
``False`` (the module keeps its code). The swap is validated on the model's real shapes (a dry run on fake
tensors of ``[batch_size, seq_len]`` tokens) and reported per module; :func:`revert` undoes it. trnkit's
native Qwen3 needs none of this: it takes its kernels from its config (``Qwen3Config.kernels``).
"""

from __future__ import annotations

from torch import nn

from trnkit.overrides import KernelChoice, OverrideConfig, OverrideReport, apply_overrides
from trnkit.overrides.apply import undo_swaps

__all__ = ["SUPPORTED", "apply_trnkit_to_deepseek_v3", "apply_trnkit_to_glm4_moe", "apply_trnkit_to_gpt_oss",
           "apply_trnkit_to_qwen3", "apply_trnkit_to_qwen3_moe", "revert"]

OpArg = bool | str | KernelChoice

# entry point -> transformers model_type(s) it serves (the table in docs/overrides.md)
SUPPORTED = {"apply_trnkit_to_qwen3": ("qwen3",), "apply_trnkit_to_qwen3_moe": ("qwen3_moe",),
             "apply_trnkit_to_deepseek_v3": ("deepseek_v3",), "apply_trnkit_to_glm4_moe": ("glm4_moe",),
             "apply_trnkit_to_gpt_oss": ("gpt_oss",)}


# the entry points' keyword for each op whose keyword is not the op's name
ARG_NAMES = {"rope_hf": "rope", "router_topk": "router", "moe_experts": "experts"}


def _choice(where: str, arg: OpArg, impl: str, policy: str, block_size: int, lnc: int | None,
            fixed_shift: bool | None = None) -> KernelChoice | None:
    """The KernelChoice of one op's argument (``where``: the entry point and keyword, for the message)."""
    if arg is False or arg is None:
        return None
    if isinstance(arg, KernelChoice):
        return arg
    if isinstance(arg, str):
        return KernelChoice(arg, policy, block_size, lnc or 0, fixed_shift)
    if arg is True:
        return KernelChoice(impl, policy, block_size, lnc or 0, fixed_shift)
    raise TypeError(f"{where} expects True / False, an impl name or a KernelChoice, got {type(arg).__name__} "
                    f"{arg!r}")


def _apply(entry: str, model: nn.Module, ops: dict[str, OpArg], impl: str, policy: str, block_size: int,
           lnc: int | None, seq_len: int | None, batch_size: int, dry_run: bool | None,
           fixed_shift: bool | None = None) -> OverrideReport:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED[entry]:
        others = [name for name, types in SUPPORTED.items() if model_type in types]
        hint = f"; use trnkit.hf.{others[0]}" if others else ""
        raise ValueError(f"trnkit.hf.{entry}: expects a transformers model of type {list(SUPPORTED[entry])}, got "
                         f"{type(model).__name__} (model_type {model_type!r}){hint}")
    config = OverrideConfig(ops=[], impl=impl, policy=policy, block_size=block_size, lnc=lnc, seq_len=seq_len,
                            batch_size=batch_size, dry_run=dry_run)
    if fixed_shift is not None and not (isinstance(fixed_shift, bool) and ops.get("attention") is True):
        why = ("must be true or false (or None: the impl's default)" if not isinstance(fixed_shift, bool) else
               "applies to attention=True (an attention impl name or KernelChoice carries its own)")
        raise ValueError(f"trnkit.hf.{entry}: fixed_shift {why}, got fixed_shift={fixed_shift!r} with "
                         f"attention={ops.get('attention')!r}")
    choices = {op: c for op, arg in ops.items()
               if (c := _choice(f"trnkit.hf.{entry}: {ARG_NAMES.get(op, op)}", arg, impl, policy, block_size, lnc,
                                fixed_shift if op == "attention" else None))
               is not None}
    return apply_overrides(model, config, choices=choices)


def apply_trnkit_to_qwen3(model: nn.Module, *, rope: OpArg = True, rmsnorm: OpArg = False, mlp: OpArg = False,
                          attention: OpArg = False, impl: str = "nki", policy: str = "strict", lnc: int | None = None,
                          seq_len: int | None = None, batch_size: int = 1, dry_run: bool | None = None,
                          fixed_shift: bool | None = None) -> OverrideReport:
    """trnkit's kernels in a transformers v5 dense Qwen3 (``Qwen3ForCausalLM`` / ``Qwen3Model``): ``rope``
    (``rope_hf`` in every attention), ``rmsnorm`` (every norm), ``mlp`` (every SwiGLU MLP), ``attention``
    (the attention function; ``fixed_shift`` with ``attention=True``: None the impl's default, ``nki``'s
    fixed softmax shift per row, False its exact row max); returns the per-module report."""
    ops = {"rope_hf": rope, "rmsnorm": rmsnorm, "mlp": mlp, "attention": attention}
    return _apply("apply_trnkit_to_qwen3", model, ops, impl, policy, 0, lnc, seq_len, batch_size, dry_run,
                  fixed_shift)


def apply_trnkit_to_qwen3_moe(model: nn.Module, *, rope: OpArg = True, router: OpArg = True, experts: OpArg = True,
                              rmsnorm: OpArg = False, mlp: OpArg = False, attention: OpArg = False, impl: str = "nki",
                              policy: str = "strict", block_size: int = 0, lnc: int | None = None,
                              seq_len: int | None = None, batch_size: int = 1, dry_run: bool | None = None,
                              fixed_shift: bool | None = None) -> OverrideReport:
    """trnkit's kernels in a transformers v5 Qwen3-MoE (``Qwen3MoeForCausalLM`` / ``Qwen3MoeModel``): ``rope``,
    ``router`` (``router_topk`` in every ``mlp.gate``), ``experts`` (``moe_experts`` in every
    ``mlp.experts``; ``block_size`` 0 = the kernel's tuned sizes), ``rmsnorm``, ``mlp`` (the dense MLPs of
    ``mlp_only_layers``), ``attention`` (``fixed_shift`` as in :func:`apply_trnkit_to_qwen3`); returns the
    per-module report."""
    ops = {"rope_hf": rope, "router_topk": router, "moe_experts": experts, "rmsnorm": rmsnorm, "mlp": mlp,
           "attention": attention}
    return _apply("apply_trnkit_to_qwen3_moe", model, ops, impl, policy, block_size, lnc, seq_len, batch_size,
                  dry_run, fixed_shift)


def apply_trnkit_to_deepseek_v3(model: nn.Module, *, router: OpArg = True, experts: OpArg = True, impl: str = "nki",
                                policy: str = "strict", block_size: int = 0, lnc: int | None = None,
                                seq_len: int | None = None, batch_size: int = 1, dry_run: bool | None = None,
                                ) -> OverrideReport:
    """trnkit's kernels in a transformers v5 DeepSeek-V3 (``DeepseekV3ForCausalLM`` / ``DeepseekV3Model``):
    ``router`` (``router_topk``, sigmoid scoring, in every ``mlp.gate``; grouped top-K only when every group is
    searched) and ``experts`` (``moe_experts`` in every ``mlp.experts``); returns the per-module report."""
    ops = {"router_topk": router, "moe_experts": experts}
    return _apply("apply_trnkit_to_deepseek_v3", model, ops, impl, policy, block_size, lnc, seq_len, batch_size,
                  dry_run)


def apply_trnkit_to_glm4_moe(model: nn.Module, *, router: OpArg = True, experts: OpArg = True, impl: str = "nki",
                             policy: str = "strict", block_size: int = 0, lnc: int | None = None,
                             seq_len: int | None = None, batch_size: int = 1, dry_run: bool | None = None,
                             ) -> OverrideReport:
    """trnkit's kernels in a transformers v5 GLM-4-MoE (``Glm4MoeForCausalLM`` / ``Glm4MoeModel``): ``router``
    (``router_topk``, sigmoid scoring, in every ``mlp.gate``) and ``experts`` (``moe_experts`` in every
    ``mlp.experts``); returns the per-module report."""
    ops = {"router_topk": router, "moe_experts": experts}
    return _apply("apply_trnkit_to_glm4_moe", model, ops, impl, policy, block_size, lnc, seq_len, batch_size, dry_run)


def apply_trnkit_to_gpt_oss(model: nn.Module, *, experts: OpArg = True, impl: str = "nki", policy: str = "strict",
                            block_size: int = 0, lnc: int | None = None, seq_len: int | None = None,
                            batch_size: int = 1, dry_run: bool | None = None) -> OverrideReport:
    """trnkit's kernels in a transformers v5 GPT-OSS (``GptOssForCausalLM`` / ``GptOssModel``): ``experts``
    (``moe_experts`` with the clamped SwiGLU and biases, in every ``mlp.experts``; its router keeps its own code:
    its logits have a bias ``router_topk`` has no term for); returns the per-module report."""
    return _apply("apply_trnkit_to_gpt_oss", model, {"moe_experts": experts}, impl, policy, block_size, lnc, seq_len,
                  batch_size, dry_run)


def revert(model: nn.Module) -> int:
    """Give every module of a transformers ``model`` swapped by an entry point (or by
    :func:`~trnkit.overrides.apply_overrides`) its own code back; returns how many were restored."""
    return undo_swaps(model)

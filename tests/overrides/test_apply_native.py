"""apply_overrides / bind_kernels on trnkit's native Qwen3: parity, checkpoints, policies, call-time guard."""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import subprocess
import sys
import warnings
from unittest import mock

import pytest
import torch

from tests.overrides.conftest import native_model
from tests.tolerances import assert_close
from trnkit.overrides import (
    DEFAULT_OPS,
    OverrideConfig,
    OverrideConstraintError,
    apply_overrides,
    bind_kernels,
)


def _bound(module) -> bool:
    """A native swap point takes its kernel choice itself: its ``kernel`` is set (nothing is rebuilt)."""
    return getattr(module, "kernel", None) is not None


TOKENS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
SWAP_PATHS = ["layers.0.attention.rope", "layers.1.attention.rope", "layers.0.moe.router", "layers.0.moe.experts"]


@contextlib.contextmanager
def _spy_kernels():
    """Count calls of the NKI kernel entry points (the nki impls look them up at call time)."""
    from trnkit.kernels import moe, rope, router

    calls: dict[str, int] = {}
    targets = [(rope, "rope_hf_bshd"), (router, "router_topk"), (router, "router_topk_bwd"),
               (moe, "moe_experts"), (moe, "moe_experts_bwd")]
    with contextlib.ExitStack() as stack:
        for mod, name in targets:
            real = getattr(mod, name)
            key = f"{mod.__name__.rsplit('.', 1)[-1]}.{name}"

            def spy(*a, _real=real, _key=key, **k):
                calls[_key] = calls.get(_key, 0) + 1
                return _real(*a, **k)

            stack.enter_context(mock.patch.object(mod, name, spy))
        yield calls


def _logits_and_grads(model, tokens=TOKENS):
    model.zero_grad()
    logits = model(tokens)
    (logits.float() ** 2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_swap_matches_original_logits_and_grads():
    model = native_model(init_std=0.2)
    original = copy.deepcopy(model)
    keys = list(model.state_dict())
    report = apply_overrides(model, OverrideConfig(impl="nki", seq_len=8))

    assert [(r.module, r.op, r.status) for r in report.rows] == [
        ("layers.0.attention.rope", "rope_hf", "swapped"), ("layers.0.moe.router", "router_topk", "swapped"),
        ("layers.0.moe.experts", "moe_experts", "swapped"), ("layers.1.attention.rope", "rope_hf", "swapped")]
    for path in SWAP_PATHS:
        assert _bound(model.get_submodule(path))
    assert list(model.state_dict()) == keys  # parameter names unchanged

    with _spy_kernels() as calls:
        got_logits, got_grads = _logits_and_grads(model)
    # 2 rope layers x (fwd + bwd); 1 MoE layer: router and experts, fwd and bwd each
    assert calls == {"rope.rope_hf_bshd": 4, "router.router_topk": 1, "router.router_topk_bwd": 1,
                     "moe.moe_experts": 1, "moe.moe_experts_bwd": 1}
    want_logits, want_grads = _logits_and_grads(original)
    assert_close(got_logits, want_logits)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        assert_close(got_grads[name], want_grads[name], msg=name)

    assert bind_kernels(model, dict.fromkeys(DEFAULT_OPS)) == 4  # each back to its torch code
    for path in SWAP_PATHS:
        assert not _bound(model.get_submodule(path))
    assert_close(model(TOKENS).detach(), want_logits)


def test_checkpoints_load_and_save_unchanged_while_swapped():
    model, other = native_model(seed=0), native_model(seed=1)
    apply_overrides(model, OverrideConfig(impl="reference", seq_len=8))
    model.load_state_dict(other.state_dict())  # load into the swapped model
    for (n, p), (n2, p2) in zip(model.state_dict().items(), other.state_dict().items(), strict=True):
        assert n == n2 and torch.equal(p, p2)
    expected = other(TOKENS)
    assert_close(model(TOKENS), expected)
    bind_kernels(model, dict.fromkeys(DEFAULT_OPS))  # the loaded weights stay in the modules
    assert_close(model(TOKENS), expected)


def test_strict_rejects_a_model_the_kernel_cannot_serve_before_the_first_step():
    model = native_model(head_dim=160)  # rope_hf kernel: D <= 128
    with pytest.raises(OverrideConstraintError) as err:
        apply_overrides(model, OverrideConfig(ops=["rope_hf"], impl="nki", policy="strict", seq_len=8))
    msg = str(err.value)
    assert "rope_hf[nki]" in msg and "'D <= 128' violated (got 160)" in msg
    assert "layers.0.attention.rope" in msg and "layers.1.attention.rope" in msg
    assert msg.count("'D <= 128' violated") == 1  # both layers' one reason, said once
    assert len(err.value.violations) == 1
    assert not any(_bound(m) for m in model.modules())  # left unchanged
    assert not getattr(model, "_trnkit_overrides", None)


@pytest.mark.parametrize("policy", ["strict", "fallback"])
def test_the_experts_backward_limit_is_checked_before_training(policy: str) -> None:
    """H = I = 1024 fp32: one expert's weights fit the forward's 96 KiB of SBUF, not the backward's weight and
    its transpose. The backward used to raise the bare kernel error at the first step, under fallback too."""
    model = native_model(dim=1024, moe_inter_dim=1024, mlp_only_layers=[])
    cfg = OverrideConfig(ops=["moe_experts"], impl="nki", policy=policy, seq_len=8)
    if policy == "strict":
        with pytest.raises(OverrideConstraintError, match=r"moe_experts\[nki\] at layers\.0\.moe\.experts, "
                           r"layers\.1\.moe\.experts cannot serve .*'backward working set fits 96 KiB per partition' "
                           r"violated \(got '131072 bytes \(H=1024, I=1024, float32\)'\)"):
            apply_overrides(model, cfg)
        return
    with pytest.warns(UserWarning, match="backward working set"):
        report = apply_overrides(model, cfg)
    assert {r.status for r in report.rows} == {"fallback"}
    model(TOKENS).square().mean().backward()  # the module's own code, forward and backward
    for p in model.parameters():  # without gradients the forward's limits alone apply: the kernel serves it
        p.requires_grad_(False)
    assert {r.status for r in apply_overrides(model, cfg).rows} == {"swapped"}


def test_fallback_warns_once_matches_the_original_and_reports_it():
    model = native_model(head_dim=160)
    original = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = apply_overrides(model, OverrideConfig(ops=["rope_hf"], impl="nki", policy="fallback", seq_len=8))
        logits = model(TOKENS)
        model(TOKENS)
    ours = [w for w in caught if "trnkit override" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert "rope_hf[nki] falls back" in str(ours[0].message) and "D <= 128" in str(ours[0].message)
    assert [(r.status, r.impl) for r in report.rows] == [("fallback", "original")] * 2
    assert all("D <= 128" in r.reason for r in report.rows)
    table = report.table()
    assert "layers.0.attention.rope" in table and "fallback" in table and "original (requested nki)" in table
    assert torch.equal(logits, original(TOKENS))


@pytest.mark.parametrize("policy", ["strict", "fallback"])
def test_a_router_gate_with_a_bias_is_not_served(policy):
    # the kernel computes x @ W^T from gate.weight alone: a bias would be silently dropped
    model = native_model()
    router = model.layers[0].moe.router
    router.gate.bias = torch.nn.Parameter(torch.randn(router.gate.out_features))
    original = copy.deepcopy(model)
    cfg = OverrideConfig(ops=["router_topk"], impl="nki", policy=policy, seq_len=8)
    if policy == "strict":
        with pytest.raises(OverrideConstraintError, match=r"router_topk\[native adapter\]: constraint "
                                                          r"'gate without bias' violated"):
            apply_overrides(model, cfg)
        return
    with pytest.warns(UserWarning, match="gate without bias"):
        report = apply_overrides(model, cfg)
        logits = model(TOKENS)
    assert [(r.module, r.status, r.impl) for r in report.rows] == [("layers.0.moe.router", "fallback", "original")]
    assert "gate without bias" in report.rows[0].reason
    assert torch.equal(logits, original(TOKENS))  # the original module code, bias included


def test_off_swaps_nothing():
    model = native_model()
    report = apply_overrides(model, OverrideConfig(policy="off"))
    assert {r.status for r in report.rows} == {"off"} and len(report.rows) == 4
    assert not any(_bound(m) for m in model.modules())


def test_call_time_guard_strict_raises_on_a_shape_change(short_rope):
    model = native_model()
    apply_overrides(model, OverrideConfig(ops=["rope_hf"], impl=short_rope, seq_len=8))
    model(TOKENS)  # S = 8: served
    with pytest.raises(OverrideConstraintError, match=r"rope_hf\[short\] at layers.0.attention.rope.*'S <= 8'.*12"):
        model(torch.zeros(1, 12, dtype=torch.long))


def test_call_time_guard_fallback_on_a_shape_change(short_rope):
    model = native_model()
    original = copy.deepcopy(model)
    report = apply_overrides(model, OverrideConfig(ops=["rope_hf"], impl=short_rope, policy="fallback", seq_len=8))
    assert {r.status for r in report.rows} == {"swapped"}
    long_batch = torch.randint(0, 64, (1, 12))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(long_batch)
        model(long_batch)
    assert len([w for w in caught if "'S <= 8'" in str(w.message)]) == 1
    assert torch.equal(out, original(long_batch))


def test_apply_again_switches_the_choice_and_unknown_names_are_named():
    model = native_model()
    apply_overrides(model, OverrideConfig(impl="reference", seq_len=8))
    apply_overrides(model, OverrideConfig(ops=["rope_hf"], impl="nki", seq_len=8))  # a native module: re-set
    assert [model.get_submodule(p).kernel.impl for p in SWAP_PATHS] == ["nki", "nki", "reference", "reference"]
    with pytest.raises(KeyError, match="no implementation 'fast' registered for op 'rope_hf'"):
        OverrideConfig(impl="fast")
    with pytest.raises(ValueError, match="unknown op.*'rope'"):
        OverrideConfig(ops=["rope"])
    with pytest.raises(ValueError, match="policy must be one of"):
        OverrideConfig(policy="warn")
    with pytest.raises(ValueError, match="seq_len must be a positive int or None, got 0"):
        OverrideConfig(seq_len=0)


def test_a_deep_copy_of_a_swapped_model_switches_back_on_its_own():
    model = native_model()
    apply_overrides(model, OverrideConfig(impl="reference", seq_len=8))
    twin = copy.deepcopy(model)
    assert bind_kernels(twin, dict.fromkeys(DEFAULT_OPS)) == 4
    assert not any(_bound(m) for m in twin.modules())
    assert all(_bound(model.get_submodule(p)) for p in SWAP_PATHS)  # the original keeps its swaps
    assert_close(twin(TOKENS), model(TOKENS))


def test_without_the_dry_run_the_call_time_guard_still_catches_it():
    model = native_model(head_dim=160)
    report = apply_overrides(model, OverrideConfig(ops=["rope_hf"], impl="nki", dry_run=False))
    assert {r.status for r in report.rows} == {"swapped"}  # nothing seen yet: only static checks ran
    with pytest.raises(OverrideConstraintError, match="'D <= 128' violated"):
        model(TOKENS)


_DTENSOR_SCRIPT = """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from tests.overrides.conftest import native_model
from trnkit.overrides import OverrideConfig, OverrideConstraintError, apply_overrides
m = native_model()
e = m.layers[0].moe.experts
e.w_gate_up = torch.nn.Parameter(distribute_tensor(e.w_gate_up.data, init_device_mesh("cpu", (1,)), [Shard(2)]))
x, idx, w = torch.randn(4, 32), torch.zeros(4, 2, dtype=torch.long), torch.rand(4, 2)
call = lambda: e.kernel.choose(x=x, topk_idx=idx, topk_weights=w, w_gate_up=e.w_gate_up, w_down=e.w_down,
                               block_size=128)
try:
    apply_overrides(m, OverrideConfig(ops=["moe_experts"], seq_len=8, dry_run=True))
except OverrideConstraintError as err:
    print("STRICT", err)
try:
    apply_overrides(m, OverrideConfig(ops=["moe_experts"], policy="fallback", seq_len=8, dry_run=True))
except RuntimeError as err:
    print("DRYRUN", err)
r = apply_overrides(m, OverrideConfig(ops=["moe_experts"], seq_len=8))
print("NOTES", *r.notes)
try:
    call()
except OverrideConstraintError as err:
    print("STRICT_CALL", err)
r = apply_overrides(m, OverrideConfig(ops=["moe_experts"], policy="fallback", seq_len=8))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    impl = call()
print("FALLBACK", r.rows[0].status, impl, [str(c.message) for c in caught])
"""


def _run_with_gloo(script: str) -> str:
    """Run ``script`` in a fresh interpreter with a single-process gloo group; returns its stdout."""
    with socket.socket() as s:  # a free port for the group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    prologue = ("import os, warnings, torch, torch.distributed as dist\n"
                f"os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='{port}', RANK='0', WORLD_SIZE='1')\n"
                "dist.init_process_group('gloo')\n")
    out = subprocess.run([sys.executable, "-c", prologue + script + "\ndist.destroy_process_group()\n"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": root}, timeout=120,
                         cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_a_model_with_dtensor_parameters_skips_the_dry_run_unless_asked(monkeypatch):
    """``OverrideConfig.dry_run`` unset: the validation dry run runs on a plain model, and is skipped (the report
    saying so, naming a parameter) when the model holds DTensors (here a Parameter subclass stands in for the
    DTensor class); ``True`` runs it and ``False`` skips it without a note."""
    from trnkit.overrides import apply as apply_module, guard

    class Sharded(torch.nn.Parameter):
        pass

    runs = []
    monkeypatch.setattr(apply_module, "_dry_run", lambda *a, **k: runs.append(1) or {})
    monkeypatch.setattr(guard, "_DTensor", Sharded)
    plain, sharded = native_model(), native_model()
    experts = sharded.layers[0].moe.experts
    experts.w_gate_up = Sharded(experts.w_gate_up.data)
    assert apply_overrides(plain, OverrideConfig(ops=["rope_hf"], seq_len=8)).notes == [] and runs == [1]
    report = apply_overrides(sharded, OverrideConfig(ops=["rope_hf"], seq_len=8))
    assert runs == [1] and len(report.notes) == 1 and report.notes[0] in report.table()
    assert report.notes[0].startswith("validation dry run skipped: 1 of the model's parameters are DTensors (sharded "
                                      "by FSDP2 or tensor parallelism; the first: layers.0.moe.experts.w_gate_up)")
    assert apply_overrides(sharded, OverrideConfig(ops=["rope_hf"], seq_len=8, dry_run=True)).notes == []
    assert apply_overrides(sharded, OverrideConfig(ops=["rope_hf"], seq_len=8, dry_run=False)).notes == []
    assert runs == [1, 1]
    # the transformers entry points leave it unset too
    from tests.overrides.conftest import hf_moe_model
    from trnkit.hf import apply_trnkit_to_qwen3_moe

    hf = hf_moe_model()
    hf.model.layers[0].mlp.gate.weight = Sharded(hf.model.layers[0].mlp.gate.weight.data)
    report = apply_trnkit_to_qwen3_moe(hf, seq_len=8)
    assert runs == [1, 1] and report.notes[0].startswith("validation dry run skipped: 1 of the model's parameters")


@pytest.mark.slow  # a fresh interpreter with torch.distributed: ~5-12 s
def test_sharded_dtensor_weights_are_a_constraint_not_a_crash():
    """A tensor-parallel expert weight (a DTensor): the dry run, when forced (``dry_run=True``), stops a strict apply
    on the constraint and a fallback one on the fake-tensor forward it cannot run (naming ``dry_run=False``);
    unset, it is skipped saying why, and each call checks its inputs: strict raises, fallback falls back."""
    out = _run_with_gloo(_DTENSOR_SCRIPT)
    violated = "'plain (non-DTensor) inputs' violated (got ['w_gate_up'])"
    assert "STRICT " in out and violated in out.split("STRICT ")[1].splitlines()[0]
    assert "DRYRUN" in out and "dry_run=False" in out
    assert "NOTES validation dry run skipped: 1 of the model's parameters are DTensors" in out
    assert "STRICT_CALL" in out and violated in out.split("STRICT_CALL")[1].splitlines()[0]
    assert "FALLBACK swapped None" in out and "falls back" in out


_FSDP_SCRIPT = """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from tests.overrides.conftest import native_model
from trnkit.overrides import OverrideConfig, apply_overrides
mesh = init_device_mesh("cpu", (1,))
m = native_model()
for layer in m.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(m, mesh=mesh)
report = apply_overrides(m, OverrideConfig(impl="nki", seq_len=8))
m(torch.randint(0, 64, (2, 8))).sum().backward()
print("ROWS", sorted({r.status for r in report.rows}), len(report.rows))
print("NOTES", *report.notes)
"""


@pytest.mark.slow
def test_fsdp2_sharded_model_swaps_and_trains():
    """FSDP2 keeps DTensor parameters between steps but gathers them for forward: all swaps serve."""
    out = _run_with_gloo(_FSDP_SCRIPT)
    assert "ROWS ['swapped'] 4" in out
    assert "NOTES validation dry run skipped: " in out and "parameters are DTensors" in out


def test_native_aux_loss_gradient_flows_through_the_router_kernel():
    model = native_model(init_std=0.2, router_aux_loss_coef=0.01)
    original = copy.deepcopy(model)
    apply_overrides(model, OverrideConfig(impl="nki", seq_len=8))
    for m in (model, original):
        m.train()
        (m(TOKENS).float().pow(2).mean() + m.aux_loss).backward()
    assert_close(model.aux_loss.detach(), original.aux_loss.detach())
    gate, gate0 = model.layers[0].moe.router.gate.weight, original.layers[0].moe.router.gate.weight
    assert_close(gate.grad, gate0.grad)


def test_a_model_without_swap_points_gets_an_empty_report():
    report = apply_overrides(torch.nn.Sequential(torch.nn.Linear(2, 2)), OverrideConfig())
    assert report.rows == [] and "no swap points found" in report.table()


@pytest.mark.parametrize("kwargs, message", [
    ({"impl": 3}, r"OverrideConfig.impl must be an impl name or \{op: impl name\}, got int 3"),
    ({"impl": {"rope_hf": 3}}, r"OverrideConfig.impl must be an impl name or \{op: impl name\}, got \{'rope_hf': 3\}"),
    # a string is an iterable of its letters: it used to import the module 'e'
    ({"plugins": "examples.my_kernels"},
     r"OverrideConfig.plugins must be a list of module names \(e.g. \['examples.my_kernels'\]\), got str "
     r"'examples.my_kernels'"),
])
def test_override_config_values_of_the_wrong_type_are_named(kwargs, message) -> None:
    from trnkit.overrides import OverrideConfig

    with pytest.raises(ValueError, match=rf"^{message}$"):
        OverrideConfig(ops=["rope_hf"], **kwargs)


def test_apply_overrides_to_something_that_is_not_a_module_is_named() -> None:
    from trnkit.overrides import OverrideConfig, apply_overrides

    with pytest.raises(TypeError, match=r"^apply_overrides: model must be a torch.nn.Module, got str 'model'$"):
        apply_overrides("model", OverrideConfig())


@pytest.mark.parametrize("compute", ["bf16 autocast", "bf16 weights"])
def test_router_kernel_in_bf16_routes_as_the_torch_router_near_ties_included(compute):
    """The native router's own code computes ``gate(x)`` in the compute dtype (bf16 under bf16 autocast or with bf16
    weights) and routes from those rounded logits, ties to the lower expert index. The kernel rounds its
    fp32-accumulated logits to the dtype of its operands and routes from them by the same rule, so where two
    experts' logits are equal in bf16 it picks the torch router's expert. Expert 1's router row is expert 0's times
    1 + 2^-10 here: the swapped router returns the torch router's indices and logits exactly and its weights to
    fp32 rounding (the kernel's softmax is over the selected logits, the torch router's over all of them)."""
    model = native_model(init_std=0.2)
    with torch.no_grad():
        gate = model.layers[0].moe.router.gate.weight
        gate[1] = gate[0] * (1 + 2 ** -10)
    if compute == "bf16 weights":
        model = model.to(torch.bfloat16)
    original = copy.deepcopy(model)
    apply_overrides(model, OverrideConfig(ops=["router_topk"], impl="nki", seq_len=8))
    outs = {}

    def keep(name):
        def hook(mod, args, out):
            outs[name] = (args, out)
        return hook

    for name, m in (("kernel", model), ("torch", original)):
        m.layers[0].moe.router.register_forward_hook(keep(name))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute == "bf16 autocast"):
        model(tokens), original(tokens)
    (x,), (w_want, idx_want, logits_want) = outs["torch"]
    w_got, idx_got, logits_got = outs["kernel"][1]
    assert idx_got.dtype == idx_want.dtype and torch.equal(idx_got, idx_want)
    assert logits_got.dtype == logits_want.dtype and torch.equal(logits_got, logits_want)
    torch.testing.assert_close(w_got, w_want, rtol=2 ** -22, atol=0)
    # the case is a near-tie: choosing from the fp32 logits of the bf16 operands picks otherwise
    exact = x.to(torch.bfloat16).float() @ gate.to(torch.bfloat16).float().T
    assert (torch.sort(exact, dim=-1, descending=True, stable=True).indices[:, :2] != idx_want).any()

"""The attention override's ``fixed_shift`` option (``KernelChoice(fixed_shift=...)``, ``OverrideConfig`` and the
trainer's ``[overrides] fixed_shift``, ``apply_trnkit_to_qwen3(..., fixed_shift=...)``,
``register_hf_attention(..., fixed_shift=...)``): unset, the ``nki`` impl runs its default, the fixed-shift
forward (:mod:`trnkit.kernels.attention.flash_fwd_shift`); ``False`` the exact forward; bad values and
combinations are refused naming the key, the rule and the value; the option reaches the kernels from trnkit's
native Qwen3 and from transformers' Qwen3; at S = 600 (rows past the shift's 512 keys) logits and every
parameter gradient match the exact forward's at the fp32 tolerance when the launches pass the certificate (and
differ from them in some bits: the fast pass ran), and equal them bit for bit when scores in the hundreds make
every launch fall back."""

from __future__ import annotations

import copy
import re
import tomllib

import pytest
import torch

from tests.overrides.conftest import _logits_and_grads, hf_dense_model, native_model
from tests.tolerances import assert_close
from trnkit.hf import apply_trnkit_to_qwen3, revert
from trnkit.kernels import attention as attention_pkg
from trnkit.kernels.attention import flash_fwd, flash_fwd_shift
from trnkit.overrides import KernelChoice, OverrideConfig, apply_overrides, bind_kernels, ops, register_hf_attention

S = 600  # past the 512 keys the shift is taken over
SHARPEN = 10.0  # q / k norm gain that makes every launch fall back (scores x 100: rows far past the bound)


@pytest.fixture
def forwards(monkeypatch):
    """The attention forward kernels launched, in order: "shift" or "exact"."""
    seen: list[str] = []
    launch = attention_pkg.launch

    def spy(kernel, lnc):
        if kernel is flash_fwd_shift.attention_fwd_shift_kernel:
            seen.append("shift")
        elif kernel is flash_fwd.attention_fwd_kernel:
            seen.append("exact")
        return launch(kernel, lnc)

    monkeypatch.setattr(attention_pkg, "launch", spy)
    return seen


def _tokens(vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (1, S), generator=torch.Generator().manual_seed(5))


def _sharpen(norms, gain: float) -> None:
    """Scale the q / k head-norm weights: scores grow by gain**2 (into the hundreds: every launch falls back)."""
    with torch.no_grad():
        for n in norms:
            n.weight.mul_(gain)


def _compare(got, want, fell_back: bool) -> None:
    """Logits and every gradient: bit for bit when the launches fell back (the exact forward ran), else at the
    fp32 tolerance, with some logit differing (the fast pass's own rounding: it ran)."""
    (gl, gg), (wl, wg) = got, want
    assert gg.keys() == wg.keys() and gg
    if fell_back:
        assert torch.equal(gl, wl) and all(torch.equal(gg[n], wg[n]) for n in wg)
        return
    assert not torch.equal(gl, wl)
    assert_close(gl, wl, torch.float32)
    for n in wg:
        assert_close(gg[n], wg[n], torch.float32, msg=n)


# ------------------------------------------------------------------------------------------ checks


@pytest.mark.parametrize("value", [1, "yes", 0.5])
def test_a_non_bool_names_the_key_rule_and_value(value):
    rule = re.escape(f"must be true or false (or unset: the impl's default), got {value!r}")
    with pytest.raises(ValueError, match=rf"KernelChoice.fixed_shift {rule}"):
        KernelChoice(fixed_shift=value)
    with pytest.raises(ValueError, match=rf"OverrideConfig.fixed_shift {rule}"):
        OverrideConfig(ops=["attention"], fixed_shift=value)


def test_only_attention_and_an_impl_that_takes_it():
    KernelChoice(fixed_shift=True).check_impl("attention")
    KernelChoice(fixed_shift=False).check_impl("attention")
    KernelChoice("reference").check_impl("attention")  # unset: any impl, its own default
    with pytest.raises(ValueError, match=r"fixed_shift=False needs an attention impl .*takes fixed_shift.*'reference'"):
        KernelChoice("reference", fixed_shift=False).check_impl("attention")
    with pytest.raises(ValueError, match=r"fixed_shift=True applies to the 'attention' op only, got it for op 'mlp'"):
        KernelChoice(fixed_shift=True).check_impl("mlp")
    with pytest.raises(ValueError, match=r"fixed_shift=True needs an attention impl .*takes fixed_shift.*'reference'"):
        KernelChoice("reference", fixed_shift=True).check_impl("attention")
    with pytest.raises(ValueError, match=r"OverrideConfig.fixed_shift=True applies to the 'attention' op, which must "
                                         r"be in ops, got ops \['mlp'\]"):
        OverrideConfig(ops=["mlp"], fixed_shift=True)
    with pytest.raises(ValueError, match=r"OverrideConfig.fixed_shift=True needs .*got impl 'reference'"):
        OverrideConfig(ops=["attention"], impl={"attention": "reference"}, fixed_shift=True)
    with pytest.raises(ValueError, match=r"KernelChoice.fixed_shift=True applies to the 'attention' op only, got it "
                                         r"for op 'rmsnorm'"):
        bind_kernels(native_model(), {"rmsnorm": KernelChoice(fixed_shift=True)})
    with pytest.raises(ValueError, match=r"KernelChoice.fixed_shift=True needs an attention impl.*'reference'"):
        register_hf_attention("trnkit_fs_bad", impl="reference", fixed_shift=True)
    with pytest.raises(ValueError, match=r"apply_trnkit_to_qwen3: fixed_shift applies to attention=True .*got "
                                         r"fixed_shift=True with attention=False"):
        apply_trnkit_to_qwen3(hf_dense_model(), fixed_shift=True)
    # only the attention op's choice carries it
    kernels = OverrideConfig(ops=["attention", "mlp"], fixed_shift=False).kernels()
    assert kernels["attention"].fixed_shift is False and kernels["mlp"].fixed_shift is None
    assert OverrideConfig(ops=["attention"]).kernels()["attention"].fixed_shift is None  # default: the impl's
    OverrideConfig(ops=["attention"], impl={"attention": "reference"})  # unset goes with any impl


def test_the_op_refuses_an_impl_without_the_option():
    q = torch.randn(1, 4, 2, 8)
    for value in (True, False):
        with pytest.raises(ValueError, match=rf"trnkit::attention: fixed_shift={value} needs .*got impl 'reference'"):
            ops.attention(q, q[:, :, :1], q[:, :, :1], 0.3, "reference", fixed_shift=value)


def test_opcheck_with_fixed_shift():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 5, h, 8, generator=g).requires_grad_() for h in (2, 1, 1))
    for value in (True, False, None):
        torch.library.opcheck(torch.ops.trnkit.attention, (q, k, v, 0.3, "nki", 0, value))


def test_trainer_toml(tmp_path):
    """``[overrides] fixed_shift = false`` reaches the native model's attention modules (left out: None, the
    impl's default); bad values and combinations stop the config check naming the key, the rule and the
    value."""
    from trnkit.harness.config import ConfigError, from_dict
    from trnkit.harness.models import build_spec
    from trnkit.qwen3.model import Qwen3Model

    base = tomllib.loads('[model]\nspec = "qwen3:debug"\n[training]\nseq_len = 128\n'
                         '[overrides]\nops = ["attention"]\npolicy = "strict"\nfixed_shift = false\n')
    cfg = from_dict(base)
    cfg.validate()
    assert cfg.overrides.kernels()["attention"].fixed_shift is False
    with torch.device("meta"):
        model = Qwen3Model(build_spec(cfg).config)
    cores = [m for n, m in model.named_modules() if n.endswith("attention.core")]
    assert len(cores) == 4 and all(m.kernel.fixed_shift is False for m in cores)
    unset = copy.deepcopy(base)
    del unset["overrides"]["fixed_shift"]
    assert from_dict(unset).overrides.kernels()["attention"].fixed_shift is None
    for change, message in (({"ops": ["mlp"]}, r"overrides.fixed_shift = false applies to the 'attention' op, which "
                                                r"must be in ops, got ops \['mlp'\]"),
                            ({"impl": "reference"}, r"overrides.fixed_shift = false needs .*got impl 'reference'"),
                            ({"fixed_shift": 2}, r"overrides.fixed_shift.*2")):
        bad = copy.deepcopy(base)
        bad["overrides"].update(change)
        with pytest.raises((ConfigError, ValueError), match=message):
            from_dict(bad).validate()


# ------------------------------------------------------------------------------------------ models


@pytest.mark.parametrize("fell_back", [False, True], ids=["fast", "falls-back"])
def test_native_qwen3(forwards, fell_back):
    model = native_model(init_std=0.2, max_seq_len=S)
    if fell_back:
        _sharpen([m for n, m in model.named_modules() if n.endswith(("q_norm", "k_norm"))], SHARPEN)
    exact = copy.deepcopy(model)
    apply_overrides(model, OverrideConfig(ops=["attention"], seq_len=S))  # the default: the fixed shift
    apply_overrides(exact, OverrideConfig(ops=["attention"], fixed_shift=False, seq_len=S))
    assert all(m.kernel.fixed_shift is False for n, m in exact.named_modules() if n.endswith("attention.core"))
    forwards.clear()
    got = _logits_and_grads(model, _tokens())
    assert forwards == ["shift", "shift"]  # one launch per layer
    forwards.clear()
    want = _logits_and_grads(exact, _tokens())
    assert forwards == ["exact", "exact"]
    _compare(got, want, fell_back)


@pytest.mark.parametrize("fell_back", [False, True], ids=["fast", "falls-back"])
def test_transformers_qwen3(forwards, fell_back):
    model = hf_dense_model(max_position_embeddings=S)
    if fell_back:
        _sharpen([m for n, m in model.named_modules() if n.endswith(("q_norm", "k_norm"))], SHARPEN)
    exact = copy.deepcopy(model)
    apply_trnkit_to_qwen3(model, rope=False, attention=True, fixed_shift=True, seq_len=S)
    apply_trnkit_to_qwen3(exact, rope=False, attention=True, fixed_shift=False, seq_len=S)
    forwards.clear()
    got = _logits_and_grads(model, _tokens())
    assert forwards == ["shift", "shift"]
    forwards.clear()
    want = _logits_and_grads(exact, _tokens())
    assert forwards == ["exact", "exact"]
    _compare(got, want, fell_back)
    revert(model)
    forwards.clear()
    model(_tokens())
    assert forwards == []


def test_transformers_attn_implementation(forwards):
    """``register_hf_attention(name)`` (the default: the fixed shift) and ``attn_implementation=name``; with
    ``fixed_shift=False`` the exact forward."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    name = register_hf_attention("trnkit_fixed_shift")
    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=S)
    torch.manual_seed(0)
    ref = Qwen3ForCausalLM(Qwen3Config(**cfg, attn_implementation="sdpa"))
    model = Qwen3ForCausalLM(Qwen3Config(**cfg, attn_implementation=name))
    model.load_state_dict(ref.state_dict())
    got = _logits_and_grads(model, _tokens())
    assert forwards == ["shift", "shift"]
    want = _logits_and_grads(ref, _tokens())
    assert_close(got[0], want[0], torch.float32)
    for n in want[1]:
        assert_close(got[1][n], want[1][n], torch.float32, msg=n)
    exact = register_hf_attention("trnkit_exact", fixed_shift=False)
    forwards.clear()
    model.config._attn_implementation = exact
    model(_tokens())
    assert forwards == ["exact", "exact"]

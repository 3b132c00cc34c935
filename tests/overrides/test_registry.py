"""Registry: registration, conflicts, selection under each policy, warn-once."""

from __future__ import annotations

import warnings

import pytest
import torch

from trnkit.kernels.constraints import Violation
from trnkit.overrides import (
    OverrideConstraintError,
    RegistrationError,
    get_impl,
    list_impls,
    register,
    reset_warnings,
    select,
    unregister,
)
from trnkit.overrides.registry import warn_once


@pytest.fixture
def scratch():
    """Names registered by a test are removed afterwards."""
    names: list[tuple[str, str]] = []
    yield names
    for op, impl in names:
        try:
            unregister(op, impl)
        except KeyError:
            pass


def _fn(*a, **k):
    raise AssertionError("not called in these tests")


def _even_d(q, k, **_):
    return [] if q.shape[-1] % 4 == 0 else [Violation("my", "D % 4 == 0", q.shape[-1], "test rule")]


def test_builtins_registered():
    impls = list_impls()
    assert set(impls) == {"rope_hf", "router_topk", "grouped_mm", "moe_experts", "rmsnorm", "rmsnorm_qk",
                          "linear_cross_entropy", "attention", "mlp"}
    for names in impls.values():
        assert {"reference", "nki"} <= set(names)
    nki = get_impl("router_topk", "nki")
    assert nki.has_backward and nki.backward is not None and nki.devices == ("cpu", "neuron")


def test_register_function_and_decorator(scratch):
    entry = register("grouped_mm", "plain", _fn, backward=_fn, devices=["cpu"])
    scratch.append(("grouped_mm", "plain"))
    assert entry.has_backward and entry.devices == ("cpu",)

    @register("grouped_mm", "decorated", compile_ok=False)
    def decorated(x, w, offs):
        return x

    scratch.append(("grouped_mm", "decorated"))
    assert decorated(1, 2, 3) == 1  # the decorator returns the function unchanged
    assert get_impl("grouped_mm", "decorated").fn is decorated
    assert {"plain", "decorated"} <= set(list_impls("grouped_mm")["grouped_mm"])


def test_conflicting_double_registration_is_a_clear_error(scratch):
    register("rope_hf", "mine", _fn)
    scratch.append(("rope_hf", "mine"))
    register("rope_hf", "mine", _fn)  # identical: idempotent

    def other(*a, **k):
        pass

    with pytest.raises(RegistrationError, match=r"rope_hf\[mine\] is already registered to .*_fn.*other"):
        register("rope_hf", "mine", other)
    with pytest.raises(RegistrationError, match="already registered"):
        register("rope_hf", "nki", other)  # built-ins are protected too
    register("rope_hf", "mine", other, replace=True)
    assert get_impl("rope_hf", "mine").fn is other


def test_registration_errors_name_the_problem():
    with pytest.raises(RegistrationError, match="unknown op 'rope'.*rope_hf"):
        register("rope", "x", _fn)
    with pytest.raises(RegistrationError, match="identifier"):
        register("rope_hf", "my impl", _fn)
    with pytest.raises(RegistrationError, match="needs backward="):
        register("router_topk", "x", _fn, has_backward=True)
    with pytest.raises(RegistrationError, match="fn.*backward=True"):
        register("rope_hf", "x", _fn, backward=_fn)
    with pytest.raises(KeyError, match=r"no implementation 'nope' registered for op 'rope_hf'.*nki"):
        get_impl("rope_hf", "nope")


def test_select_policies(scratch):
    register("rope_hf", "by4", _fn, constraints=_even_d, has_backward=False, devices=("cpu",))
    scratch.append(("rope_hf", "by4"))
    good, bad = torch.empty(1, 2, 3, 8), torch.empty(1, 2, 3, 6)

    sel = select("rope_hf", "by4", q=good, k=good)
    assert (sel.impl, sel.fell_back, sel.reasons) == ("by4", False, ())

    with pytest.raises(OverrideConstraintError, match=r"rope_hf\[by4\].*'D % 4 == 0' violated \(got 6\)"):
        select("rope_hf", "by4", policy="strict", q=bad, k=bad)
    sel = select("rope_hf", "by4", policy="fallback", q=bad, k=bad)
    assert sel.impl == "reference" and sel.fell_back and "D % 4 == 0" in sel.reason
    assert select("rope_hf", "by4", policy="off", q=bad, k=bad).impl == "reference"

    # device, backward and compile flags are constraints too
    reasons = select("rope_hf", "by4", policy="fallback", device="neuron", needs_backward=True,
                     compiling=True, q=good, k=good).reasons
    rules = [v.constraint for v in reasons]
    assert rules == ["device in ['cpu']", "has_backward"]  # compile_ok defaults to True
    meta = torch.empty(1, 2, 3, 8, device="meta")
    assert select("rope_hf", "by4", policy="fallback", q=meta, k=meta).reasons[0].value == "meta"

    with pytest.raises(ValueError, match="policy must be one of"):
        select("rope_hf", "by4", policy="lenient", q=good, k=good)


def test_nki_select_uses_the_kernel_constraints():
    q = torch.empty(1, 4, 2, 160)  # [B, S, H, D], D > 128
    sel = select("rope_hf", "nki", policy="fallback", q=q, k=q, rope_cache=torch.empty(4, 320), layout="bshd")
    assert [v.constraint for v in sel.reasons] == ["D <= 128"]
    assert select("rope_hf", "reference", q=q, k=q, rope_cache=torch.empty(4, 320), layout="bshd").impl == "reference"


def test_warn_once():
    reset_warnings()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert warn_once("k", "1", message="first")
        assert not warn_once("k", "1", message="again")
        assert warn_once("k", "2", message="other reason")
    assert [str(x.message) for x in w] == ["first", "other reason"]


@pytest.mark.parametrize("kwargs, message", [
    # a string is an iterable of its letters: devices ('c', 'p', 'u') then refused every device
    ({"devices": "cpu"}, r"devices must be a list of device types such as \['cpu', 'neuron'\], got str 'cpu'"),
    ({"devices": ["cpu", 3]}, r"devices must be a list of device types such as \['cpu', 'neuron'\], got \['cpu', 3\]"),
    ({"constraints": 5}, r"constraints must be callable \(inputs by name -> list of Violation\) or None, got int 5"),
    ({"backward": 5}, r"backward must be callable or None, got int 5"),
    ({"has_backward": "no"}, r"has_backward must be True or False, got str 'no'"),
    ({"compile_ok": 1}, r"compile_ok must be True or False, got int 1"),
    ({"autograd_backward": None}, r"autograd_backward must be True or False, got NoneType None"),
])
def test_bad_registration_arguments_are_refused_at_registration(scratch, kwargs, message) -> None:
    """Each used to be accepted and to fail (or misbehave) only when the impl was selected or its backward ran."""
    with pytest.raises(RegistrationError, match=rf"^trnkit overrides: router_topk\[probe\]: {message}$"):
        register("router_topk", "probe", lambda *a, **k: None, **kwargs)
    assert "probe" not in list_impls("router_topk")["router_topk"]

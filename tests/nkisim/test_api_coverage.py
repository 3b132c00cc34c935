"""Every documented nki / nki.language / nki.isa / nki.collectives name resolves: implemented, or a
placeholder whose first use raises NotImplementedError naming the API (never an AttributeError)."""

from __future__ import annotations

import numpy as np
import pytest

import trnkit.nkisim as nki
from trnkit.nkisim import collectives
from trnkit.nkisim import isa as nisa
from trnkit.nkisim import language as nl
from trnkit.nkisim.api_names import DOCUMENTED, MissingApi, missing_names

MODULES = {"nki": nki, "nki.language": nl, "nki.isa": nisa, "nki.collectives": collectives}
# What the interpreter lacks today (docs/interpreter.md lists the same): keep both in sync.
NOT_IMPLEMENTED = {
    "nki": [],
    "nki.language": ["prelu", "tan", "ceil", "floor", "trunc", "negative", "fmod", "mod", "var",
                     "all", "rms_norm", "where", "dropout", "random_seed", "load_transpose2d",
                     "gather_flattened", "rand"],
    "nki.isa": ["NkiInstruction", "nc_matmul_mx", "activate2", "rng", "dropout", "set_rng_seed",
                "rand_set_state", "rand_get_state", "rand2", "exponential", "sequence_bounds",
                "quantize_mx", "topk"],
    "nki.collectives": ["all_gather_v", "all_to_all_v"],
}


@pytest.mark.parametrize("module", list(MODULES))
def test_every_documented_name_resolves(module: str) -> None:
    mod = MODULES[module]
    for name in DOCUMENTED[module]:
        value = getattr(mod, name)  # no AttributeError for any documented name
        if isinstance(value, MissingApi):
            with pytest.raises(NotImplementedError, match=rf"{module}\.{name} is part of the documented "
                                                          r"NKI API, but trnkit's interpreter"):
                value(np.zeros(1))
            with pytest.raises(NotImplementedError, match=rf"{module}\.{name}"):
                _ = value.some_member
            assert not hasattr(value, "__wrapped__")  # introspection still works
    assert sorted(missing_names(vars(mod), module)) == sorted(NOT_IMPLEMENTED[module])


def test_missing_operator_passed_as_op_is_a_clear_not_implemented_error() -> None:
    x = nl.ndarray((4, 8), nl.float32)
    with pytest.raises(NotImplementedError, match="nki.language.prelu"):
        nisa.activation(dst=nl.ndarray((4, 8), nl.float32), op=nl.prelu, data=x)


def test_import_of_a_missing_name_succeeds_and_fails_on_use() -> None:
    from trnkit.nkisim.isa import rng  # a kernel module importing it still loads

    with pytest.raises(NotImplementedError, match="nki.isa.rng"):
        rng(dst=None)


def test_small_helpers_now_implemented() -> None:
    assert nl.is_hbm(nl.shared_hbm) and nl.is_hbm(nl.hbm) and not nl.is_hbm(nl.sbuf)
    assert nl.is_on_chip(nl.psum) and nl.is_psum(nl.psum) and nl.is_sbuf(nl.sbuf)
    assert not nl.is_sbuf(nl.psum)
    assert nisa.get_nc_sub_version() == 0

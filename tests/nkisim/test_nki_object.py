"""``nl.NKIObject`` subclasses as AWS's tested kernels build them (nki-library d2ad3a5)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from trnkit.nkisim import language as nl


@dataclass
class TileConfig(nl.NKIObject):  # nki-library style: annotated fields, some without a default
    rows: int
    cols: int = 128
    tags: list = field(default_factory=list)

    def __post_init__(self):
        self.area = self.rows * self.cols


@dataclass
class Dims(nl.NKIObject):  # AttnTKGConfig / MLP configs: plain fields
    rows: int
    cols: int = 128


@dataclass(frozen=True)
class Limits(nl.NKIObject):
    upper: float = 1.0
    lower: float = -1.0


class Explicit(nl.NKIObject):
    def __init__(self, n):
        self.n = 2 * n


class ExplicitChild(Explicit):
    pass


def test_dataclass_fields_positional_keyword_and_defaults():
    c = TileConfig(4)
    assert (c.rows, c.cols, c.tags, c.area) == (4, 128, [], 512)
    assert TileConfig(rows=2, cols=3).area == 6 and TileConfig(2, 3) == TileConfig(rows=2, cols=3)
    assert TileConfig(1).tags is not TileConfig(1).tags  # default_factory per instance


def test_a_field_without_default_may_be_omitted_and_extra_keywords_set():
    """mlp_tkg / moe_tkg / attention_cte build configs without some fields and with un-annotated ones."""
    d = Dims(cols=8, scratch="sbuf")  # rows missing, scratch not a field
    assert d.cols == 8 and d.scratch == "sbuf"
    with pytest.raises(AttributeError, match="rows"):  # never set: reading it is an error
        d.cols = d.rows


def test_frozen_dataclass_and_explicit_init_are_kept():
    lim = Limits(lower=-2.0)
    assert (lim.upper, lim.lower) == (1.0, -2.0)
    with pytest.raises(Exception, match="cannot assign"):
        lim.upper = 3.0
    assert Explicit(3).n == 6 and ExplicitChild(4).n == 8


def test_invalid_constructions_still_raise():
    with pytest.raises(TypeError, match="at most 3 positional"):
        TileConfig(1, 2, [], 4)
    with pytest.raises(TypeError, match="multiple values for argument 'rows'"):
        TileConfig(1, rows=2)
    with pytest.raises(TypeError, match="keyword arguments only"):
        nl.NKIObject(1)
    assert nl.NKIObject(a=1).a == 1

"""The conformance harness itself, on a tiny stand-in nki-library checkout (no nki-library needed)."""

from __future__ import annotations

import dataclasses
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from trnkit.conformance import harness
from trnkit.conformance.harness import Case

KERNELS = '''
import nki
import nki.isa as nisa
import nki.language as nl


def scale(x, out, factor):
    """out = x * factor through SBUF, 128 rows per tile (an LNC-aware stand-in kernel)."""
    n = x.shape[0] // nl.num_programs()
    for r0 in range(nl.program_id(0) * n, (nl.program_id(0) + 1) * n, 128):
        t = nl.ndarray((128, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[r0:r0 + 128, :])
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=factor)
        nisa.dma_copy(dst=out[r0:r0 + 128, :], src=t)
    return out


def scale_on_one_slot(x, out, factor, wrong=False):
    """out = x * factor through two tiles placed on one SBUF slot per 128 rows, each read before the other is
    written; wrong: both written first, so the product of the first read is the second's data (a stale read)."""
    for r0 in range(0, x.shape[0], 128):
        a = nl.ndarray((128, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf, address=(0, 0))
        b = nl.ndarray((128, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf, address=(0, 0))
        nisa.dma_copy(dst=a, src=x[r0:r0 + 128, :])
        if wrong:
            nisa.memset(dst=b, value=0.0)
        nisa.tensor_scalar(dst=a, data=a, op0=nl.multiply, operand0=factor)
        nisa.dma_copy(dst=out[r0:r0 + 128, :], src=a)
        if not wrong:
            nisa.memset(dst=b, value=0.0)
    return out


def uses_missing_api(x, out, factor):
    nisa.no_such_instruction(dst=out, src=x)
    return out


def too_many_partitions(x, out, factor):
    nl.ndarray((256, 4), dtype=x.dtype, buffer=nl.sbuf)
    return out


def checks_factor(x, out, factor):
    assert factor > 0, "factor must be positive"
    return scale(x, out, factor)


def scale_via_bf16(x, out, factor):
    """out = x * factor, the product written into a bf16 tile (rounded to nearest even) on its way."""
    for r0 in range(0, x.shape[0], 128):
        t = nl.ndarray((128, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
        b = nl.ndarray((128, x.shape[1]), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[r0:r0 + 128, :])
        nisa.tensor_scalar(dst=b, data=t, op0=nl.multiply, operand0=factor)
        nisa.tensor_copy(dst=t, src=b)
        nisa.dma_copy(dst=out[r0:r0 + 128, :], src=t)
    return out


def _bf16_product(t, factor):
    """t * factor in a bf16 tile: two halves, each rounded to bf16, added into it (a bf16 accumulation)."""
    half = nl.ndarray(t.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
    total = nl.ndarray(t.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=half, data=t, op0=nl.multiply, operand0=factor / 2)
    nisa.tensor_tensor(dst=total, data1=half, data2=half, op=nl.add)
    return total


def scale_tapped(x, out, factor, gain=1.0, bump=0.0):
    """out = _bf16_product(x, factor * gain) + bump: gain is an error before the tapped tile, bump one after."""
    n = x.shape[0] // nl.num_programs()
    for r0 in range(nl.program_id(0) * n, (nl.program_id(0) + 1) * n, 128):
        t = nl.ndarray((128, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[r0:r0 + 128, :])
        b = _bf16_product(t, factor * gain)
        nisa.tensor_scalar(dst=t, data=b, op0=nl.add, operand0=bump)
        nisa.dma_copy(dst=out[r0:r0 + 128, :], src=t)
    return out


def every_other_column(x, out):
    """out = x[:, 1::2] ([128, 16] -> [128, 8]) through SBUF: a tensor_copy reads a strided view of the loaded tile
    (the operand an operand tap records)."""
    t = nl.ndarray((128, 16), dtype=x.dtype, buffer=nl.sbuf)
    o = nl.ndarray((128, 8), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_copy(dst=o, src=t.ap(pattern=[[16, 128], [2, 8]], offset=1))
    nisa.dma_copy(dst=out, src=o)
    return out


def every_other_column_added(x, out, positional=False):
    """out = x[:, 1::2] + x[:, 0::2] through SBUF and a float32 PSUM tile: the even columns copied into PSUM, then
    one tensor_tensor adds the odd columns' strided view and the PSUM tile, its arguments passed by position (as
    qkv_tkg's partial-sum adds) or by keyword."""
    t = nl.ndarray((128, 16), dtype=x.dtype, buffer=nl.sbuf)
    p = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.psum)
    o = nl.ndarray((128, 8), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_copy(dst=p, src=t.ap(pattern=[[16, 128], [2, 8]], offset=0))
    odd = t.ap(pattern=[[16, 128], [2, 8]], offset=1)
    if positional:
        nisa.tensor_tensor(o, odd, p, nl.add)
    else:
        nisa.tensor_tensor(dst=o, data1=odd, data2=p, op=nl.add)
    nisa.dma_copy(dst=out, src=o)
    return out
'''

REFS = '''
import torch


def scale_ref(x, out, factor):
    return {"out": x * factor}


def scale_ref_any(x, out, factor, **kw):
    return {"out": x * factor}


def off_by_one_ref_any(x, out, factor, **kw):
    return {"out": x * factor + 1.0}


def off_by_one_ref(x, out, factor):
    return {"out": x * factor + 1.0}


def failing_ref(x, out, factor):
    raise ValueError("reference broke")


def trailing_one_ref(x, out, factor):
    return {"out": (x * factor).reshape(*x.shape, 1)}


def half_ref(x, out, factor):
    return {"out": (x * factor)[:, : x.shape[1] // 2]}


def float32_ref(x, out, factor, rounded=False, shift=0.0):
    """x * factor in float32 (+ shift); rounded: the product rounded to bf16 first, as scale_via_bf16's tile."""
    y = x * factor
    return {"out": (y.to(torch.bfloat16).float() if rounded else y) + shift}


def tapped_ref(x, out, factor, gain=1.0, bump=0.0, tile=None, shift=0.0):
    """x * factor in float32 (+ shift); tile: the product fed in (the kernel's tapped tile), the rest (nothing)
    on it."""
    return {"out": (x * factor if tile is None else tile) + shift}
'''


@pytest.fixture
def fake_checkout(tmp_path):
    pkg = tmp_path / "src" / "nkilib_src"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels.py").write_text(textwrap.dedent(KERNELS))
    (pkg / "refs.py").write_text(textwrap.dedent(REFS))
    return tmp_path


def _case(entry="scale", reference="scale_ref", lnc=1, factor=3.0, **kw):
    def make():
        np.random.seed(0)
        x = np.random.randn(256, 8).astype(np.float32)
        return {"x": x, "out": np.zeros_like(x), "factor": factor}
    return Case(kernel="fake", name=entry, shapes="x[256,8]", entry=f"nkilib_src.kernels:{entry}",
                reference=f"nkilib_src.refs:{reference}", inputs=make, outputs=("out",), lnc=lnc,
                rtol=1e-6, atol=1e-6, **kw)


@pytest.mark.parametrize("lnc", [1, 2])
def test_matching_kernel_passes_with_its_error_and_time(fake_checkout, lnc):
    row = harness.run_case(_case(lnc=lnc), fake_checkout, "abc123")
    assert row.result == harness.PASS, row.message
    assert row.max_abs_err == 0.0 and row.seconds is not None and row.nkilib_commit == "abc123"
    # allowed = atol + rtol * max|expected|
    np.random.seed(0)
    x = np.random.randn(256, 8).astype(np.float32)
    assert row.allowed_err == pytest.approx(1e-6 + 1e-6 * float(np.abs(3.0 * x).max()))


def test_wrong_result_is_a_mismatch_with_the_error(fake_checkout):
    row = harness.run_case(_case(reference="off_by_one_ref"), fake_checkout)
    assert row.result == harness.MISMATCH
    assert row.max_abs_err == pytest.approx(1.0) and "out: max|err| 1 >" in row.message


def test_an_output_is_compared_in_its_references_shape_as_nkilibs_validator_reads_it(fake_checkout):
    """nki-library reads each output back with its golden's shape (np.fromfile(...).reshape(golden.shape)): the same
    elements in another shape pass, and the row says so; a different element count is still a mismatch."""
    row = harness.run_case(_case(reference="trailing_one_ref"), fake_checkout)
    assert row.result == harness.PASS and row.max_abs_err == 0.0
    assert "out (256, 8) compared in its reference's shape (256, 8, 1)" in row.message
    row = harness.run_case(_case(reference="half_ref"), fake_checkout)
    assert row.result == harness.MISMATCH and row.max_abs_err == float("inf")


def test_missing_api_and_rejection_are_reported_as_such(fake_checkout):
    missing = harness.run_case(_case(entry="uses_missing_api"), fake_checkout)
    assert missing.result == harness.MISSING and "no_such_instruction" in missing.message
    rejected = harness.run_case(_case(entry="too_many_partitions"), fake_checkout)
    assert rejected.result == harness.REJECTED
    assert "partition dim 256 exceeds pmax (128)" in rejected.message


def test_negative_case_must_be_rejected(fake_checkout):
    ok = harness.run_case(_case(entry="checks_factor", factor=-1.0, negative=True), fake_checkout)
    assert ok.result == harness.PASS and "factor must be positive" in ok.message
    ran = harness.run_case(_case(entry="checks_factor", factor=2.0, negative=True), fake_checkout)
    assert ran.result == harness.ACCEPTED


def test_nki_modules_are_restored_after_a_case(fake_checkout):
    before = sys.modules.get("nki")
    harness.run_case(_case(), fake_checkout)
    assert sys.modules.get("nki") is before
    assert "nkilib_src" not in sys.modules and str(fake_checkout / "src") not in sys.path


def test_nkilib_root_accepts_the_checkout_or_its_src(fake_checkout, monkeypatch, tmp_path_factory):
    assert harness.nkilib_root(fake_checkout) == fake_checkout
    assert harness.nkilib_root(fake_checkout / "src") == fake_checkout
    monkeypatch.setenv("NKILIB_SRC", str(fake_checkout))
    assert harness.nkilib_root() == fake_checkout
    monkeypatch.delenv("NKILIB_SRC")
    assert harness.nkilib_root(use_tarball=False) is None
    assert harness.nkilib_root(tmp_path_factory.mktemp("empty")) is None


def test_compare_is_nkilibs_max_mode_rule():
    e = np.array([1.0, -4.0, 2.0])
    # allowed = atol + rtol * max|e| = 0.1 + 0.01 * 4 = 0.14, the same for every element
    assert harness.compare(e + [0.139, 0, -0.139], e, 0.01, 0.1)[0]
    ok, err, allowed = harness.compare(e + [0.0, 0.0, 0.15], e, 0.01, 0.1)
    assert not ok and err == pytest.approx(0.15) and allowed == pytest.approx(0.14)
    inf = np.array([np.inf, 1.0])
    assert harness.compare(inf, inf, 0.0, 0.0)[0]  # equal infinities: no difference
    assert not harness.compare(np.array([1e30, 1.0]), inf, 1.0, 0.0)[0]  # finite vs inf
    assert not harness.compare(np.array([np.nan, 1.0]), np.array([0.0, 1.0]), 1.0, 1.0)[0]
    assert not harness.compare(np.zeros(3), np.zeros(4), 1.0, 1.0)[0]  # shapes differ


def test_compare_in_chunks_gives_the_whole_array_result(monkeypatch):
    """compare() takes its float64 differences a chunk at a time: the same (ok, error, allowed) as one
    chunk, wherever the largest reference value, the worst error, an infinity or a NaN falls."""
    rng = np.random.default_rng(0)
    e = rng.normal(size=(7, 5)).astype(np.float32)
    e[6, 4] = 9.0  # max|e| in the last chunk
    a = e + np.float32(0.01)
    a[0, 1] += 0.5  # the worst error in the first chunk
    e[3, 0] = a[3, 0] = -np.inf
    whole = harness.compare(a, e, 0.01, 0.1)
    assert not whole[0] and whole[1] == pytest.approx(0.51) and whole[2] == pytest.approx(0.19)
    monkeypatch.setattr(harness, "COMPARE_CHUNK", 3)
    assert harness.compare(a, e, 0.01, 0.1) == whole
    a[6, 4] = np.nan  # a NaN in the last chunk only
    ok, err, _ = harness.compare(a, e, 0.01, 0.1)
    assert not ok and np.isnan(err)
    a[6, 4], a[3, 0] = e[6, 4], 1.0  # a finite value where the reference is infinite
    assert not harness.compare(a, e, 1e6, 1e6)[0]


def test_a_kernel_failure_decides_the_row_before_a_reference_failure(fake_checkout):
    """The reference runs before the kernel (memory), but the row reports the kernel's failure first."""
    row = harness.run_case(_case(entry="too_many_partitions", reference="failing_ref"), fake_checkout)
    assert row.result == harness.REJECTED and "partition" in row.message
    row = harness.run_case(_case(reference="failing_ref"), fake_checkout)
    assert row.result == harness.ERROR and row.message == "reference failed: ValueError: reference broke"


def test_cli_without_checkout_says_how_to_get_one(monkeypatch, capsys):
    from trnkit.__main__ import main

    monkeypatch.delenv("NKILIB_SRC", raising=False)
    monkeypatch.delenv("NKILIB_TARBALL", raising=False)
    monkeypatch.setattr(harness, "TARBALL_DIRS", ())
    assert main(["conformance", "-k", "cumsum"]) == 2
    assert "git clone https://github.com/aws-neuron/nki-library" in capsys.readouterr().err


def test_cli_lists_cases_with_their_nkilib_test_files(capsys):
    from trnkit.__main__ import main

    assert main(["conformance", "--list", "-k", "rope_hf"]) == 0
    out = capsys.readouterr().out.splitlines()
    # test_rope_hf.py: 7 rows at LNC 1 and 2 (test_rope_hf_lnc) and the same 7 in the packed-cache test at LNC 2
    assert len(out) == 21 and all("test/integration/nkilib/core/embeddings/test_rope_hf.py" in x for x in out)


def test_an_archive_is_extracted_once_with_its_commit(fake_checkout, monkeypatch, tmp_path_factory):
    """git archive's tarball (its pax header carries the commit) found via NKILIB_TARBALL."""
    import tarfile

    tarball = tmp_path_factory.mktemp("archive") / "nki-library-abc1234.tar.gz"
    with tarfile.open(tarball, "w:gz", format=tarfile.PAX_FORMAT,
                      pax_headers={"comment": "abc1234def5678"}) as tf:
        tf.add(fake_checkout / "src", arcname="src")
    monkeypatch.delenv("NKILIB_SRC", raising=False)
    monkeypatch.setenv("NKILIB_TARBALL", str(tarball))
    assert harness.nkilib_tarball() == tarball
    cache = tmp_path_factory.mktemp("cache") / "nkilib"
    root = harness.extract_tarball(tarball, cache)
    assert root == cache and harness.nkilib_root(root) == cache
    assert harness.nkilib_commit(root) == "abc1234"
    (root / "src" / "nkilib_src" / "marker").write_text("kept")
    assert harness.extract_tarball(tarball, cache) == cache  # not extracted again
    assert (root / "src" / "nkilib_src" / "marker").read_text() == "kept"
    row = harness.run_case(_case(), root, harness.nkilib_commit(root))
    assert row.result == harness.PASS and row.nkilib_commit == "abc1234"
    monkeypatch.setenv("NKILIB_TARBALL", str(tarball.with_name("missing.tar.gz")))
    assert harness.nkilib_tarball() is None


def test_the_fast_tier_names_real_cases_and_covers_every_kernel():
    from trnkit.conformance import cases

    all_cases = cases.all_cases()
    ids = [cases.case_id(c) for c in all_cases]
    assert len(set(ids)) == len(ids)
    assert set(cases.FAST) <= set(ids), set(cases.FAST) - set(ids)
    fast_kernels = {c.kernel for c in cases.fast_cases()}
    assert fast_kernels | set(cases.SLOW_ONLY) == {c.kernel for c in all_cases}
    assert not fast_kernels & set(cases.SLOW_ONLY)


SPILLING = '''
import nki.isa as nisa
import nki.language as nl


def spill(x, out, factor):
    """Two [128, 30000] fp32 tiles live at once: 240,000 bytes per partition, beyond SBUF."""
    a = nl.ndarray((128, 30000), dtype=nl.float32, buffer=nl.sbuf)
    b = nl.ndarray((128, 30000), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=a, value=1.0)
    nisa.memset(dst=b, value=2.0)
    nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.add)
    t = nl.ndarray((128, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
    for r0 in range(0, x.shape[0], 128):
        nisa.dma_copy(dst=t, src=x[r0:r0 + 128, :])
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=factor)
        nisa.dma_copy(dst=out[r0:r0 + 128, :], src=t)
    return out
'''


def test_sbuf_beyond_capacity_compiles_with_a_spill_note(fake_checkout):
    """AWS's kernels run as neuronx-cc's default allocator compiles them: SBUF beyond capacity in
    program order is spilled (capacity="sbuf_spills"), reported in the row, not rejected."""
    (fake_checkout / "src" / "nkilib_src" / "spilling.py").write_text(textwrap.dedent(SPILLING))
    case = _case()
    case = harness.Case(**{**case.__dict__, "entry": "nkilib_src.spilling:spill"})
    row = harness.run_case(case, fake_checkout)
    assert row.result == harness.PASS, row.message
    assert "exceed SBUF in program order: SBUF spill: 240000 bytes per partition live at the peak, " \
           "27008 more than the capacity 212992" in row.message


def test_a_filtered_save_replaces_only_its_own_rows(fake_checkout, tmp_path):
    import csv

    first, second = _case(), _case(lnc=2)
    path = tmp_path / "ref.csv"
    harness.write_csv([harness.run_case(first, fake_checkout), harness.run_case(second, fake_checkout)], path)
    rerun = harness.run_case(_case(lnc=2, reference="off_by_one_ref"), fake_checkout)
    harness.write_csv([rerun], path, merge_order=[first, second])
    rows = list(csv.DictReader(path.open()))
    assert [(r["lnc"], r["result"]) for r in rows] == [("1", "PASS"), ("2", "MISMATCH")]


GATHER = '''
import nki.collectives as ncc
import nki.isa as nisa
import nki.language as nl


def gather(x, n):
    out = nl.ndarray((x.shape[0] * n, x.shape[1]), dtype=x.dtype, buffer=nl.shared_hbm)
    ncc.all_gather(srcs=[x], dsts=[out], replica_group=ncc.ReplicaGroup([list(range(n))]), collective_dim=0)
    return out
'''


def gather_ref(ranks, **_):
    """Every rank holds all ranks' x, stacked per rank."""
    full = np.concatenate([np.asarray(r["x"]) for r in ranks])
    return {"result": np.stack([full] * len(ranks))}


def swapped_ref(ranks, **_):
    return gather_ref(ranks[::-1])


def test_a_multi_rank_case_compares_every_rank(fake_checkout):
    (fake_checkout / "src" / "nkilib_src" / "gather.py").write_text(textwrap.dedent(GATHER))
    x = np.arange(3 * 4 * 8, dtype=np.float32).reshape(3, 4, 8)
    case = Case(kernel="fake", name="gather", shapes="x[4,8] x3", entry="nkilib_src.gather:gather",
                reference=f"{__name__}:gather_ref", inputs=lambda: {"ranks": [{"x": x[r], "n": 3} for r in range(3)]},
                outputs=("result",), ranks=3, lnc=2, rtol=0.0, atol=0.0)
    row = harness.run_case(case, fake_checkout)
    assert row.result == harness.PASS and row.max_abs_err == 0.0, row.message
    wrong = harness.run_case(Case(**{**case.__dict__, "reference": f"{__name__}:swapped_ref"}), fake_checkout)
    assert wrong.result == harness.MISMATCH and wrong.max_abs_err == 64.0  # rank 2's rows vs rank 0's


BROKEN_DOCSTRING = '''def kernel(x):
    """Doubles x.

    Notes:
        Runs on one core.
        Any dtype.
    """

        Runs on one core.
        Any dtype.
    """
    return 2 * x


def other(x):
    """
    Unrelated docstring.
    """
    return x
'''


def test_a_repeated_docstring_tail_is_dropped_and_nothing_else():
    """nki-library's core/mlp/mlp.py at d2ad3a5 repeats its docstring's tail after the closing quotes."""
    import ast

    with pytest.raises(SyntaxError):
        ast.parse(BROKEN_DOCSTRING)
    fixed = harness.drop_repeated_docstring_tail(BROKEN_DOCSTRING)
    namespace: dict = {}
    exec(compile(fixed, "<fixed>", "exec"), namespace)  # noqa: S102  (runs the repaired source it just checked)
    assert namespace["kernel"](3) == 6 and namespace["other"](3) == 3
    assert fixed.count("Runs on one core.") == 1 and fixed.count("Unrelated docstring.") == 1
    unrelated = 'def f():\n    """\n    a\n    """\n    return 1\n'  # nothing repeated: unchanged
    assert harness.drop_repeated_docstring_tail(unrelated) == unrelated


def test_neuron_dtypes_imports_inside_the_run_and_every_use_names_it(fake_checkout):
    """nki-library's mx_torch_common imports AWS's neuron_dtypes (not installable) at the top; its
    unquantized references never use it. Inside the run the import works; a use raises."""
    import importlib.util

    if importlib.util.find_spec("neuron_dtypes") is not None:
        pytest.skip("the real neuron_dtypes is installed")
    with harness.nki_is_interpreter(fake_checkout):
        import neuron_dtypes

        with pytest.raises(NotImplementedError, match=r"neuron_dtypes.static_cast: AWS's neuron_dtypes package "
                                                      r"is not installable"):
            neuron_dtypes.static_cast(np.zeros(2), np.float32)
    assert "neuron_dtypes" not in sys.modules


TEST_FILE = '''
from test.utils.common_dataclasses import KernelArgs, ValidationArgs
from test.utils.pytest_parametrize import pytest_parametrize
from test.utils.pytest_test_metadata import pytest_test_metadata

import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def triple(x):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=3.0)
    nisa.dma_copy(dst=out, src=t)
    return out


@pytest_test_metadata(name="Stand-in", pytest_marks=["fast"])
class TestTriple:
    @pytest_parametrize("factor", [(3,)], abbrevs={"factor": "f"})
    def test_triple(self, test_manager):
        validate = KernelArgs(kernel_func=triple, validation_args=ValidationArgs()).validation_args
        test_manager.execute(validate)
'''


def test_kernels_defined_in_a_test_file_run_with_stand_ins_for_its_infrastructure(fake_checkout):
    """test_collectives.py defines its kernels itself and imports its orchestration from test.utils (not in
    nki-library's archive): the file is imported from the checkout with stand-ins; stdlib `test` is kept."""
    rel = "test/integration/nkilib/test_triple.py"
    (fake_checkout / rel).parent.mkdir(parents=True)
    (fake_checkout / rel).write_text(TEST_FILE)
    before = sys.modules.get("test")
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    case = Case(kernel="fake", name="triple", shapes="x[2,4]", entry=f"{rel}:triple",
                reference=f"{__name__}:triple_ref", inputs=lambda: {"x": x}, outputs=("out",), rtol=0.0, atol=0.0)
    row = harness.run_case(case, fake_checkout)
    assert row.result == harness.PASS and row.max_abs_err == 0.0, row.message
    assert sys.modules.get("test") is before
    assert not [k for k in sys.modules if k.startswith(harness.TEST_MODULE_PREFIX)]
    with harness.nki_is_interpreter(fake_checkout):
        mod = harness.load_test_module(fake_checkout, rel)
        assert mod.TestTriple.__name__ == "TestTriple"  # the decorator stand-ins return the class and the method
        assert mod.TestTriple.test_triple.__name__ == "test_triple"
        with pytest.raises(NotImplementedError, match=r"KernelArgs\(\.\.\.\)\.validation_args: "
                                                      r"nki-library's test infrastructure is not part"):
            mod.TestTriple().test_triple(test_manager=None)


def triple_ref(x):
    return {"out": x * 3}


def test_a_test_module_imports_its_sibling_test_modules_from_the_checkout(fake_checkout):
    """test_bwmm_bwd_common.py imports helpers from another nki-library test module
    (``test.integration.nkilib.utils...``): that module is loaded from the checkout too, and no ``test.*``
    name stays behind."""
    helper, common = "test/integration/nkilib/utils/helpers.py", "test/integration/nkilib/moe/common.py"
    common_text = TEST_FILE.split("@pytest_test_metadata")[0] + (
        "from test.integration.nkilib.utils.helpers import FACTOR\n\n\n"
        "def tripled(x):\n    return {'out': x * FACTOR}\n")
    for rel, text in ((helper, "FACTOR = 3.0\n"), (common, common_text)):
        (fake_checkout / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake_checkout / rel).write_text(text)
    before = {k for k in sys.modules if k == "test" or k.startswith("test.")}
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    case = Case(kernel="fake", name="tripled", shapes="x[2,4]", entry=f"{common}:triple",
                reference=f"{common}:tripled", inputs=lambda: {"x": x}, outputs=("out",), rtol=0.0, atol=0.0)
    row = harness.run_case(case, fake_checkout)
    assert row.result == harness.PASS and row.max_abs_err == 0.0, row.message
    assert {k for k in sys.modules if k == "test" or k.startswith("test.")} == before


def test_read_only_inputs_are_shared_views_and_a_write_to_one_fails(fake_checkout):
    row = harness.run_case(_case(read_only=("x",)), fake_checkout)
    assert row.result == harness.PASS and row.max_abs_err == 0.0, row.message
    written = harness.run_case(_case(read_only=("out",)), fake_checkout)  # the kernel writes out
    assert written.result == harness.ERROR and "read-only" in written.message, written.message
    kw = {"w": np.ones((4, 4), np.float32), "cache": np.zeros((4, 4), np.float32)}
    per_rank = harness._copies([kw, kw], read_only=("w",))
    assert all(np.shares_memory(r["w"], kw["w"]) and not r["w"].flags.writeable for r in per_rank)
    assert not any(np.shares_memory(r["cache"], kw["cache"]) for r in per_rank)


@pytest.mark.parametrize("lnc", [1, 2])
def test_large_arrays_on_disk_give_the_same_row(fake_checkout, monkeypatch, lnc):
    """Inputs, the reference's copies and outputs at or over LARGE_ARRAY_BYTES live in files: the row is
    the same as with everything in memory, and the inputs the case built are not written."""
    rows = [harness.run_case(_case(lnc=lnc), fake_checkout)]
    built = {}

    def keep(make):
        def wrapped():
            built.update(make())
            return built
        return wrapped
    monkeypatch.setattr(harness, "LARGE_ARRAY_BYTES", 1024)  # x, out: 8 KiB each
    case = _case(lnc=lnc)
    rows.append(harness.run_case(Case(**{**case.__dict__, "inputs": keep(case.inputs)}), fake_checkout))
    assert [(r.result, r.max_abs_err, r.allowed_err) for r in rows] == [(harness.PASS, 0.0, rows[0].allowed_err)] * 2
    assert not built["out"].any()  # the kernel wrote its own copy


def _in_a_file(address: int) -> bool:
    """Whether ``address`` lies in a mapping of a file (/proc/self/maps: a nonzero inode)."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, _, _, _, inode = line.split()[:5]
            lo, hi = (int(v, 16) for v in span.split("-"))
            if lo <= address < hi:
                return inode != "0"
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_disk_arrays_are_file_backed_copies(monkeypatch):
    import ml_dtypes

    monkeypatch.setattr(harness, "LARGE_ARRAY_BYTES", 1024)
    monkeypatch.setattr(harness, "COMPARE_CHUNK", 100)  # copies in several chunks
    x = np.random.default_rng(0).normal(size=(64, 9)).astype(ml_dtypes.bfloat16)
    t = harness._to_torch(x, keep_low_precision=False)  # the reference's float32 copy, on disk
    assert _in_a_file(t.data_ptr()) and np.array_equal(t.numpy(), x.astype(np.float32))
    assert not _in_a_file(harness._to_torch(x[:8], keep_low_precision=False).data_ptr())  # small
    moved = harness._to_disk(x)
    assert harness._file_backed(moved) and moved is not x and np.array_equal(moved.view(np.uint16),
                                                                             x.view(np.uint16))
    assert harness._to_disk(moved) is moved  # already on disk: no second copy


def test_chunked_uniform_draws_are_the_one_shot_draw(monkeypatch):
    import ml_dtypes

    np.random.seed(0)
    whole = np.random.uniform(-0.1, 0.1, size=[3, 40, 2, 5]).astype(ml_dtypes.bfloat16)
    for large in (1 << 40, 1024):  # in memory, then on disk
        monkeypatch.setattr(harness, "LARGE_ARRAY_BYTES", large)
        np.random.seed(0)
        drawn = harness.uniform_array(-0.1, 0.1, [3, 40, 2, 5], ml_dtypes.bfloat16)
        assert harness._file_backed(drawn) == (large == 1024)
        assert np.array_equal(drawn.view(np.uint16), whole.view(np.uint16))
        assert np.random.random_sample() == np.random.RandomState(0).random_sample(1201)[-1]  # same state after


def test_chunked_draws_are_the_one_shot_draw(monkeypatch):
    import ml_dtypes

    bf16, fp8 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3)
    whole = np.random.default_rng(3).normal(0.0, 0.5, (6, 7, 5)).astype(np.float32).astype(bf16)
    np.random.seed(42)
    whole_fp8 = np.clip(np.random.normal(0, 60.0, (4, 33)).astype(np.float32), -240, 240).astype(fp8)
    after = np.random.random_sample()
    monkeypatch.setattr(harness, "COMPARE_CHUNK", 16)  # 210 values in 14 chunks, the last one short
    for large in (1 << 40, 256):  # in memory, then on disk (420 bytes)
        monkeypatch.setattr(harness, "LARGE_ARRAY_BYTES", large)
        rng = np.random.default_rng(3)
        drawn = harness.drawn_array(lambda n, rng=rng: rng.normal(0.0, 0.5, n), (6, 7, 5), bf16)
        assert harness._file_backed(drawn) == (large == 256) and drawn.shape == (6, 7, 5)
        assert np.array_equal(drawn.view(np.uint16), whole.view(np.uint16))
        np.random.seed(42)
        clipped = harness.drawn_array(lambda n: np.clip(np.random.normal(0, 60.0, n).astype(np.float32), -240, 240),
                                      (4, 33), fp8, via=None)
        assert np.array_equal(clipped.view(np.uint8), whole_fp8.view(np.uint8))
        assert np.random.random_sample() == after  # the generator ends where the one-shot draw left it
    monkeypatch.setattr(harness, "LARGE_ARRAY_BYTES", 1 << 40)
    small = harness.drawn_array(lambda n: np.arange(n), (3, 4), np.float32, on_disk=True)
    copied = harness._copy(small)  # a copy of a file-backed input stays on disk, whatever its size
    assert harness._file_backed(small) and harness._file_backed(copied) and copied is not small
    assert np.array_equal(copied, np.arange(12).reshape(3, 4)) and not harness._file_backed(harness._copy(whole))


def test_outputs_that_widen_exactly_are_compared_as_they_are():
    import ml_dtypes

    e = np.linspace(-3, 3, 50, dtype=np.float32)
    a = (e + np.float32(0.013)).astype(ml_dtypes.bfloat16)
    assert harness._as_compared(a, e.dtype) is a
    assert harness.compare(a, e, 0.01, 1e-5) == harness.compare(a.astype(np.float32), e, 0.01, 1e-5)
    e16 = e.astype(ml_dtypes.bfloat16)  # a bf16 reference (keep_low_precision): a float32 output is cast
    assert harness._as_compared(e, e16.dtype).dtype == e16.dtype


def test_a_pass_rate_and_a_cosine_bound_are_the_tests_validator(fake_checkout):
    """nki-library's maxAllClose(min_pass_rate) lets a share of an output miss the tolerance; a cosine
    similarity bound can fail a row the tolerance passes."""
    (fake_checkout / "src" / "nkilib_src" / "refs.py").write_text(textwrap.dedent(REFS) + textwrap.dedent('''
        def one_off_ref(x, out, factor):
            y = x * factor
            y[0, 0] += 100.0
            return {"out": y}


        def flipped_ref(x, out, factor):
            return {"out": -x * factor}
        '''))
    strict = harness.run_case(_case(reference="one_off_ref"), fake_checkout)
    assert strict.result == harness.MISMATCH
    loose = harness.run_case(_case(reference="one_off_ref", min_pass_rate=(("out", 0.99),)), fake_checkout)
    assert loose.result == harness.PASS and "0.049% of its elements beyond" in loose.message, loose.message
    too_loose = harness.run_case(_case(reference="one_off_ref", min_pass_rate=(("out", 0.9999),)), fake_checkout)
    assert too_loose.result == harness.MISMATCH
    flipped = Case(**{**_case(reference="flipped_ref").__dict__, "rtol": 1.0, "atol": 100.0, "min_cosine": 0.99})
    row = harness.run_case(flipped, fake_checkout)
    assert row.result == harness.MISMATCH and "cosine similarity -1.0000 < 0.99" in row.message, row.message


def test_an_xfail_mismatch_is_xfail_only_with_its_checked_cause(fake_checkout):
    """XFAIL needs both the test's xfail mark and a cause the case's check confirms; otherwise MISMATCH."""
    seen = []

    def one_everywhere(inputs, actual, expected):  # the check sees the row's inputs, outputs and reference
        seen.append((inputs["factor"], actual["out"] - inputs["x"] * 3.0, expected["out"] - inputs["x"] * 3.0))
        return "every element off by 1" if np.allclose(expected["out"] - actual["out"], 1.0, atol=1e-5) else ""

    row = harness.run_case(_case(reference="off_by_one_ref", xfail="known", xfail_check=one_everywhere),
                           fake_checkout)
    assert (row.result, row.verdict) == (harness.XFAIL, harness.MISMATCH)
    assert row.message.startswith("xfail as nki-library marks it (known); checked: every element off by 1")
    assert "out: max|err| 1 >" in row.message and row.max_abs_err == pytest.approx(1.0)
    factor, kernel_off, ref_off = seen[0]
    assert factor == 3.0 and np.abs(kernel_off).max() < 1e-5 and np.allclose(ref_off, 1.0)
    # the same mismatch without the check's confirmation, or without the test's xfail, stays a mismatch
    never = lambda inputs, actual, expected: ""  # noqa: E731
    assert harness.run_case(_case(reference="off_by_one_ref", xfail="known", xfail_check=never),
                            fake_checkout).result == harness.MISMATCH
    assert harness.run_case(_case(reference="off_by_one_ref", xfail_check=one_everywhere),
                            fake_checkout).result == harness.MISMATCH
    # a row that passes is a pass, whatever the test's mark
    assert harness.run_case(_case(xfail="known", xfail_check=one_everywhere), fake_checkout).result == harness.PASS


def test_a_row_the_test_skips_runs_and_is_skipped_with_its_verdict(fake_checkout):
    skip = "test_fake: pytest.skip('too big')"
    passed = harness.run_case(_case(skipped_by=skip), fake_checkout)
    assert (passed.result, passed.verdict) == (harness.SKIPPED, harness.PASS)
    assert passed.message == f"run anyway: PASS; nki-library's test skips this row: {skip}"
    case = _case(entry="too_many_partitions", skipped_by=skip, rejected_by="exceeds pmax")
    rejected = harness.run_case(case, fake_checkout)
    assert (rejected.result, rejected.verdict) == (harness.SKIPPED, harness.REJECTED)
    assert rejected.message.startswith("run anyway: REJECTED: ") and "partition dim 256 exceeds pmax (128)" in \
        rejected.message and rejected.message.endswith(skip)
    assert harness.row_ok(case, rejected) and harness.row_ok(_case(skipped_by=skip), passed)
    # judged by the verdict: a skipped row that ran wrong is still wrong
    wrong = harness.run_case(_case(reference="off_by_one_ref", skipped_by=skip), fake_checkout)
    assert (wrong.result, wrong.verdict) == (harness.SKIPPED, harness.MISMATCH)
    assert not harness.row_ok(_case(reference="off_by_one_ref", skipped_by=skip), wrong)
    assert not harness.row_ok(_case(skipped_by=skip, rejected_by="exceeds pmax"), passed)


def test_row_ok_accepts_a_pass_a_checked_xfail_and_the_named_refusal_only():
    row = lambda result, message="": harness.Row("k", "c", "s", 1, result, message=message)  # noqa: E731
    plain, xfail = _case(), _case(xfail="known")
    assert harness.row_ok(plain, row(harness.PASS)) and harness.row_ok(xfail, row(harness.XFAIL))
    assert not harness.row_ok(plain, row(harness.XFAIL))  # XFAIL without the test's mark
    for result in (harness.MISMATCH, harness.REJECTED, harness.ERROR, harness.MISSING, harness.ACCEPTED):
        assert not harness.row_ok(plain, row(result, "rule x")) and not harness.row_ok(xfail, row(result))
    named = _case(rejected_by="rule x")
    assert harness.row_ok(named, row(harness.REJECTED, "nc_x: rule x broken"))
    assert harness.row_ok(named, row(harness.ERROR, "AssertionError: rule x"))
    assert not harness.row_ok(named, row(harness.REJECTED, "rule y")) and not harness.row_ok(named, row(harness.PASS))


def test_the_summary_counts_xfail_and_skipped_rows_apart():
    rows = [harness.Row("k", f"c{i}", "s", 1, r) for i, r in
            enumerate((harness.PASS, harness.XFAIL, harness.XFAIL, harness.SKIPPED, harness.MISMATCH))]
    assert harness.format_table(rows).splitlines()[-1] == "5 cases: 1 PASS, 2 XFAIL, 1 SKIPPED, 1 MISMATCH"


def test_the_refusal_a_case_names_carries_the_cases_note(fake_checkout):
    why = "the plan wants 256 partitions, its bound is 128"
    row = harness.run_case(_case(entry="too_many_partitions", rejected_by="exceeds pmax", note=why), fake_checkout)
    assert row.result == harness.REJECTED and row.message.endswith(f"exceeds pmax (128) ({why})")
    # another failure, or a case that names none, keeps the interpreter's message alone
    other = harness.run_case(_case(entry="too_many_partitions", rejected_by="heap", note=why), fake_checkout)
    assert why not in other.message


def test_the_references_repeated_notes_are_dropped_and_other_output_kept(fake_checkout, capsys):
    """nki-library's attention reference prints a block-length resize note and its DMA advice per call (per
    batch chunk of a golden); the harness drops exactly those lines, and a reference's other output (another
    warning), a partial last line and its exception still come out."""
    (fake_checkout / "src" / "nkilib_src" / "chatty.py").write_text(textwrap.dedent('''
        def noted_ref(x, out, factor):
            for _ in range(3):
                print("Token-gen bucket length of 1024:", "reducing block length by 2x,", "cache block length "
                      "reduced from 32 to 16.")
                print("WARNING: Smaller block length (<8) results in lower DMA bandwidth utilization. Consider "
                      "increasing curr_sprior to at least 4096.")
            print("WARNING: the reference saw something else")
            print("partial", end="")
            return {"out": x * factor}


        def failing_noted_ref(x, out, factor):
            print("Token-gen bucket length of 1024: reducing block length by 2x,")
            print("reference says why")
            raise ValueError("reference broke")
    '''))
    row = harness.run_case(dataclasses.replace(_case(), reference="nkilib_src.chatty:noted_ref"), fake_checkout)
    assert row.result == harness.PASS, row.message
    out = capsys.readouterr().out
    assert out == "WARNING: the reference saw something else\npartial"
    row = harness.run_case(dataclasses.replace(_case(), reference="nkilib_src.chatty:failing_noted_ref"),
                           fake_checkout)
    assert row.result == harness.ERROR and row.message == "reference failed: ValueError: reference broke"
    assert capsys.readouterr().out == "reference says why\n"


def _rounded(case):
    return Case(**{**case.__dict__, "rounded_reference": ("bf16 rounding of the product",
                                                          lambda kw: {**kw, "rounded": True})})


def test_a_mismatch_is_golden_gap_only_when_the_rounded_reference_misses_too_and_the_kernel_meets_it(fake_checkout):
    """The kernel writes x * 3 through a bf16 tile; the golden keeps float32 (off by up to half a bf16 step, beyond
    rtol = atol = 1e-6). nki-library's reference with the bf16 rounding misses the golden by as much, and the kernel
    meets the test against it (it equals it): GOLDEN_GAP, with both figures in the message."""
    np.random.seed(0)
    x = np.random.randn(256, 8).astype(np.float32)
    y = x * np.float32(3.0)
    gap = float(np.abs(y.astype(ml_dtypes.bfloat16).astype(np.float32) - y).max())  # the bf16 tile's rounding
    assert 1e-3 < gap < 0.05
    plain = _case(entry="scale_via_bf16", reference="float32_ref")
    assert harness.run_case(plain, fake_checkout).result == harness.MISMATCH  # no rounded reference: a mismatch
    row = harness.run_case(_rounded(plain), fake_checkout)
    assert (row.result, row.verdict) == (harness.GOLDEN_GAP, harness.MISMATCH), row.message
    assert row.max_abs_err == pytest.approx(gap, rel=1e-6) and harness.row_ok(_rounded(plain), row)
    assert row.message.startswith("nki-library's golden is out of reach of bf16 rounding of the product: out: the "
                                  f"rounded reference's max|err| {gap:.3g} against the golden fails the test too, "
                                  "the kernel meets the test against the rounded reference (max|err| 0, cosine "
                                  "1.0000)"), row.message
    assert not harness.row_ok(plain, row)  # GOLDEN_GAP is accepted only from a case that names its rounding
    # the kernel further from the rounded reference than the golden is (a kernel error on top of the rounding)
    shifted = Case(**{**plain.__dict__, "ref_inputs": lambda kw: {**kw, "shift": 0.25}, "rounded_reference": (
        "bf16 rounding of the product", lambda kw: {**kw, "rounded": True, "shift": 0.25})})
    row = harness.run_case(shifted, fake_checkout)
    assert row.result == harness.MISMATCH and row.message.startswith(f"out: max|err| {0.25 + gap:.3g} > ") and \
        row.message.endswith("; not GOLDEN_GAP: out: the kernel fails the test against the rounded reference "
                             "(max|err| 0.25)"), row.message
    # a rounding that meets the golden (here none: the "rounded" reference is the golden): the miss is the kernel's
    none = Case(**{**plain.__dict__, "rounded_reference": ("nothing", lambda kw: dict(kw))})
    row = harness.run_case(none, fake_checkout)
    assert row.result == harness.MISMATCH and row.message.endswith(
        "; not GOLDEN_GAP: out: the rounded reference's max|err| 0 against the golden meets the test"), row.message
    # a kernel that matches the golden passes, whatever the case says about rounding
    assert harness.run_case(_rounded(_case(reference="float32_ref")), fake_checkout).result == harness.PASS


def _gap_case(kernel_factor, **fields):
    """scale_via_bf16 at ``kernel_factor``; the golden x * 3 + 0.5 (a golden far off: 0.5 against atol 1e-3), the
    rounded reference bf16(x * 3) (the kernel's rounding alone)."""
    def make():
        np.random.seed(0)
        x = np.random.randn(256, 8).astype(np.float32)
        return {"x": x, "out": np.zeros_like(x), "factor": kernel_factor}

    return Case(kernel="fake", name="gap", shapes="x[256,8]", entry="nkilib_src.kernels:scale_via_bf16",
                reference="nkilib_src.refs:float32_ref", inputs=make, outputs=("out",), rtol=0.0, atol=1e-3,
                ref_inputs=lambda kw: {**kw, "factor": 3.0, "shift": 0.5},
                rounded_reference=("bf16 rounding of the product",
                                   lambda kw: {**kw, "factor": 3.0, "rounded": True}), **fields)


def test_a_3_percent_kernel_error_is_not_golden_gap_however_far_the_golden_is(fake_checkout):
    """The golden 0.5 off (atol 1e-3); a kernel 3 % off (x * 3.09, through its bf16 tile) is 0.47 from the rounded
    reference at most, within the golden's 0.5 from it (what rule (2) used to ask), but beyond the test's own
    tolerance against it: MISMATCH. The same kernel at x * 3 (the rounding alone): GOLDEN_GAP."""
    np.random.seed(0)
    x = np.random.randn(256, 8).astype(np.float32)
    rounded = (x * np.float32(3.0)).astype(ml_dtypes.bfloat16).astype(np.float64)
    kernel = (x * np.float32(3.09)).astype(ml_dtypes.bfloat16).astype(np.float64)
    near, gold = np.abs(kernel - rounded).max(), np.abs(x * np.float64(3.0) + 0.5 - rounded).max()
    assert 0.3 < near < gold - 0.01  # (the golden further from the rounded reference than the 3 % kernel)
    row = harness.run_case(_gap_case(3.09), fake_checkout)
    assert row.result == harness.MISMATCH and row.message.endswith(
        f"; not GOLDEN_GAP: out: the kernel fails the test against the rounded reference (max|err| {near:.3g})"), \
        row.message
    row = harness.run_case(_gap_case(3.0), fake_checkout)
    assert (row.result, row.verdict) == (harness.GOLDEN_GAP, harness.MISMATCH), row.message
    assert "the kernel meets the test against the rounded reference (max|err| 0, cosine 1.0000)" in row.message


TAP = "nkilib_src.kernels:_bf16_product"


def _tapped_case(gain=1.0, bump=0.0, shift=0.0, atol=1e-6, lnc=1):
    """scale_tapped with its bf16 product tapped: stage (a) checks the tile against x * factor in float64 (two
    roundings: the halves, their sum), (b) / (c) feed it to tapped_ref."""
    def make():
        np.random.seed(0)
        x = np.random.randn(256, 8).astype(np.float32)
        return {"x": x, "out": np.zeros_like(x), "factor": 3.0, "gain": gain, "bump": bump}

    def tiles(tapped):
        return np.concatenate([v for _, _, v in sorted(tapped[TAP], key=lambda c: c[1])])  # (core by core, in order)

    def projection(inputs, tapped, run):
        return [("product", tiles(tapped), inputs["x"].astype(np.float64) * 3.0, 2, False)]

    spec = harness.TappedReference("bf16 product", (TAP,), projection,
                                   lambda kw, tapped: {**kw, "tile": tiles(tapped)})
    return Case(kernel="fake", name="scale_tapped", shapes="x[256,8]", entry="nkilib_src.kernels:scale_tapped",
                reference="nkilib_src.refs:tapped_ref", inputs=make, outputs=("out",), lnc=lnc, rtol=0.0, atol=atol,
                ref_inputs=lambda kw: {**kw, "shift": shift}, tapped_reference=spec)


@pytest.mark.parametrize("lnc", [1, 2])
def test_a_mismatch_is_golden_gap_on_tapped_tiles_only_when_all_three_conditions_hold(fake_checkout, lnc):
    """The kernel's product goes through a bf16 tile (tapped); the golden keeps float32, 1e-6 of atol misses it.
    (a) the tile is x * 3 within two bf16 roundings, (b) the reference fed it reproduces the kernel, (c) the golden
    fails the test against that: GOLDEN_GAP. Each condition broken by a kernel or golden of its own: MISMATCH."""
    case = _tapped_case(lnc=lnc)
    row = harness.run_case(case, fake_checkout)
    assert (row.result, row.verdict) == (harness.GOLDEN_GAP, harness.MISMATCH), row.message
    assert harness.row_ok(case, row)
    np.random.seed(0)
    y = np.random.randn(256, 8).astype(np.float64) * 3.0
    one = np.sqrt(np.mean((y.astype(ml_dtypes.bfloat16).astype(np.float64) - y) ** 2))
    got = np.float32(y / 3.0).astype(np.float64)  # (x in float32, as the kernel reads it)
    tile = (got * 1.5).astype(ml_dtypes.bfloat16).astype(np.float64) * 2  # (the halves' sum is exact: 2 * half)
    ratio = np.sqrt(np.mean((tile - y) ** 2)) / one
    assert row.message.startswith("nki-library's golden is out of reach of the kernel's own bf16 product: product: "
                                  "1 tile(s) within their bound, the nearest to it product max|err| "), row.message
    assert f"rms {ratio:.2f} x one bf16 rounding's" in row.message, row.message
    assert "out: the kernel is at cosine 1.00000 (>= 0.9999) from the reference fed them, the golden fails the test " \
        "against it (max|err| " in row.message
    # (a) broken: the tile is 3 % off x * 3 before the tap (the reference fed it reproduces the kernel exactly)
    assert harness.run_case(_tapped_case(gain=1.03, lnc=lnc), fake_checkout).result == harness.MISMATCH
    # (b) broken: the kernel adds 0.25 after the tapped tile, which the reference fed it does not
    assert harness.run_case(_tapped_case(bump=0.25, lnc=lnc), fake_checkout).result == harness.MISMATCH
    # (c) broken: the kernel 0.07 above the fed reference, the golden 0.07 below it, atol 0.1: the kernel misses the
    # golden, but the golden meets the test against the fed reference (a miss between the two, not the golden's)
    wide = _tapped_case(bump=0.07, shift=-0.07, atol=0.1, lnc=lnc)
    row = harness.run_case(wide, fake_checkout)
    assert row.result == harness.MISMATCH and row.max_abs_err > 0.1, row.message
    # a rounded reference beside the tapped one no longer decides: one that takes in the 3 % (its own product at
    # x * 3.09, so the kernel meets the test against it) leaves the gain=1.03 kernel MISMATCH on the tapped check,
    # and the kernel with the rounding alone is GOLDEN_GAP by the tapped check, whatever the rounded reference says
    loose = ("a rounding that takes in a 3 % error", lambda kw: {**kw, "factor": 3.0 * 1.03, "shift": 0.0})
    off = dataclasses.replace(_tapped_case(gain=1.03, lnc=lnc), rounded_reference=loose)
    row = harness.run_case(off, fake_checkout)
    assert row.result == harness.MISMATCH and "; not GOLDEN_GAP: tapped product: " in row.message \
        and "beyond its bound" in row.message and "rounded reference" not in row.message, row.message
    both = dataclasses.replace(case, rounded_reference=loose)
    row = harness.run_case(both, fake_checkout)
    assert row.result == harness.GOLDEN_GAP and "of the kernel's own bf16 product" in row.message, row.message
    # without a tapped reference the same bf16 kernel is a plain MISMATCH, and GOLDEN_GAP is not accepted from it
    plain = dataclasses.replace(case, tapped_reference=None)
    assert harness.run_case(plain, fake_checkout).result == harness.MISMATCH
    assert not harness.row_ok(plain, dataclasses.replace(row, result=harness.GOLDEN_GAP))


def test_a_tap_that_records_nothing_is_refused_unless_optional(fake_checkout):
    """A tap of an instruction the kernel never calls records nothing: the row stays MISMATCH naming it, unless the
    reference lists it as optional (``TappedReference.optional``: the projection judges its absence); then the
    row is GOLDEN_GAP as without it."""
    never = "nkilib_src.kernels:nisa.nc_matmul(dst:where)"
    case = _tapped_case()
    spec = dataclasses.replace(case.tapped_reference, taps=case.tapped_reference.taps + (never,))
    row = harness.run_case(dataclasses.replace(case, tapped_reference=spec), fake_checkout)
    assert row.result == harness.MISMATCH and row.message.endswith(
        f"; not GOLDEN_GAP: tapped: no tile recorded for {never}"), row.message
    optional = dataclasses.replace(spec, optional=(never,))
    row = harness.run_case(dataclasses.replace(case, tapped_reference=optional), fake_checkout)
    assert row.result == harness.GOLDEN_GAP, row.message


def test_a_tap_records_each_call_and_changes_nothing(fake_checkout):
    """The tap records the tile each call returns (per program, a copy), and the run computes and traces the same
    instructions with and without it."""
    from trnkit import nkisim
    from trnkit.nkisim import trace

    case = _tapped_case(lnc=2)
    with harness.nki_is_interpreter(fake_checkout):
        kernel = harness._resolve(case.entry, fake_checkout)
        runs = []
        for specs in ((), (TAP,)):
            kw = case.inputs()
            with trace.record() as tr, harness.tap(specs, fake_checkout) as tapped:
                out = np.array(nkisim.simulate(kernel)[2](**kw))
            # (each program's instructions in its order; the programs' threads interleave as they run)
            runs.append((out, sorted([(i.program_id, n, i.op, i.engine, i.operands)
                                      for n, i in enumerate(i for i in tr if i.program_id == p)]
                                     for p in (0, 1)), tapped))
    (out0, tr0, none), (out1, tr1, tapped) = runs
    assert none == {} and np.array_equal(out0, out1) and tr0 == tr1
    assert sorted((r, p) for r, p, _ in tapped[TAP]) == [(0, 0), (0, 1)]  # (one 128-row tile per core)
    np.random.seed(0)
    x = np.random.randn(256, 8).astype(np.float32)
    values = np.concatenate([v for _, _, v in sorted(tapped[TAP], key=lambda c: c[1])])
    assert values.dtype == ml_dtypes.bfloat16 and np.array_equal(values.astype(np.float32), out1)
    assert np.array_equal(values, (x * np.float32(1.5)).astype(ml_dtypes.bfloat16) * 2)


def test_an_operand_tap_records_what_the_instruction_reads_and_changes_nothing(fake_checkout):
    """"module:nisa.tensor_copy(src)" records each tensor_copy's src as it reads it: the values x[:, 1::2] and, for
    each, its (partition, column) in the loaded [128, 16] tile (partition p, column 1 + 2 j); the run computes and
    traces the same instructions with and without it, and the module's nisa is its own again after the block."""
    from trnkit import nkisim
    from trnkit.nkisim import trace

    spec = "nkilib_src.kernels:nisa.tensor_copy(src)"
    np.random.seed(0)
    x = np.random.randn(128, 16).astype(np.float32)
    with harness.nki_is_interpreter(fake_checkout):
        kernel = harness._resolve("nkilib_src.kernels:every_other_column", fake_checkout)
        module = sys.modules["nkilib_src.kernels"]
        real = module.nisa
        runs = []
        for specs in ((), (spec,)):
            with trace.record() as tr, harness.tap(specs, fake_checkout) as tapped:
                out = np.array(nkisim.simulate(kernel)(x=x.copy(), out=np.zeros((128, 8), np.float32)))
            runs.append((out, [(i.op, i.engine, i.operands) for i in tr], tapped))
        assert module.nisa is real
    (out0, tr0, none), (out1, tr1, tapped) = runs
    assert none == {} and np.array_equal(out0, x[:, 1::2]) and np.array_equal(out1, out0) and tr0 == tr1
    [(rank, program, op)] = tapped[spec]
    assert (rank, program) == (0, 0) and isinstance(op, harness.Operand)
    assert np.array_equal(op.value, x[:, 1::2]) and (op.offset, op.strides, op.row) == (1, (16, 2), 16)
    where = op.columns()
    assert where.shape == (128, 8, 2)
    assert np.array_equal(where[..., 0], np.repeat(np.arange(128)[:, None], 8, axis=1))
    assert np.array_equal(where[..., 1], np.repeat(1 + 2 * np.arange(8)[None, :], 128, axis=0))


def test_an_operand_tap_binds_positional_arguments_as_their_keyword_form(fake_checkout):
    """An instruction called with positional arguments (``nisa.tensor_tensor(o, odd, p, nl.add)``) has its operands
    recorded through the instruction's signature: the same values, places and buffers as the keyword call's
    (data1 the odd columns' strided SBUF view, data2 the float32 PSUM tile of the even columns); a ``:where`` spec
    records the same place and buffer without a copy of the value; the outputs are the same with and without taps."""
    from trnkit import nkisim

    specs = tuple(f"nkilib_src.kernels:nisa.tensor_tensor({a})" for a in ("data1", "data2", "dst:where"))
    np.random.seed(0)
    x = np.random.randn(128, 16).astype(np.float32)
    with harness.nki_is_interpreter(fake_checkout):
        kernel = harness._resolve("nkilib_src.kernels:every_other_column_added", fake_checkout)
        runs = {}
        for positional in (False, True):
            for tapped_specs in ((), specs):
                with harness.tap(tapped_specs, fake_checkout) as tapped:
                    out = np.array(nkisim.simulate(kernel)(x=x.copy(), out=np.zeros((128, 8), np.float32),
                                                           positional=positional))
                runs[positional, bool(tapped_specs)] = (out, tapped)
    expected = x[:, 1::2] + x[:, 0::2]
    for (positional, _), (out, _) in runs.items():
        assert np.array_equal(out, expected), positional
    keyword, positional = runs[False, True][1], runs[True, True][1]
    for spec in specs:
        [(r, p, k_op)], [(r2, p2, p_op)] = keyword[spec], positional[spec]
        assert (r, p) == (r2, p2) == (0, 0)
        assert (k_op.offset, k_op.strides, k_op.row, k_op.buffer) == (p_op.offset, p_op.strides, p_op.row,
                                                                      p_op.buffer)
        assert k_op.value.dtype == p_op.value.dtype and np.array_equal(k_op.value, p_op.value)
    [(_, _, d1)], [(_, _, d2)], [(_, _, dst)] = (positional[s] for s in specs)
    assert np.array_equal(d1.value, x[:, 1::2]) and (d1.offset, d1.strides, d1.buffer) == (1, (16, 2), "sbuf")
    assert d2.value.dtype == np.float32 and np.array_equal(d2.value, x[:, 0::2]) and d2.buffer == "psum"
    assert dst.buffer == "sbuf" and dst.value.shape == (128, 8) and not dst.value.any() \
        and dst.value.strides == (0, 0)  # (where only: no copy)
    assert np.array_equal(dst.columns()[..., 1], np.broadcast_to(np.arange(8), (128, 8)))


@pytest.mark.parametrize("route, taken", [
    (("nisa.tensor_tensor(data1)", "nisa.nc_matmul(stationary)"), 1),  # (_bf16_product adds; nothing multiplies)
    (("nisa.tensor_tensor(data1)", "nisa.dma_copy(src)"), 2),
    (("nisa.nc_matmul(stationary)", "nisa.nc_transpose(data)"), 0),
])
def test_of_alternative_taps_exactly_one_must_record(fake_checkout, route, taken):
    """TappedReference.routes: a group of taps of which exactly one records on the kernel's path (as qkv_tkg's or
    qkv_cte's quantized input); scale_tapped with such a group beside its product tap is GOLDEN_GAP when one of
    the group records, MISMATCH naming the group when none or both do."""
    group = tuple(f"nkilib_src.kernels:{t}" for t in route)
    base = _tapped_case()
    case = dataclasses.replace(base, tapped_reference=dataclasses.replace(
        base.tapped_reference, taps=base.tapped_reference.taps + group, routes=(group,)))
    row = harness.run_case(case, fake_checkout)
    if taken == 1:
        assert (row.result, row.verdict) == (harness.GOLDEN_GAP, harness.MISMATCH), row.message
        return
    assert row.result == harness.MISMATCH and not harness.row_ok(case, row), row.message
    assert row.message.endswith(f"not GOLDEN_GAP: tapped: {taken} of the alternative taps {', '.join(group)} "
                                "recorded a tile (exactly one must)"), row.message


def test_within_roundings_is_the_stated_bound():
    """n bf16 roundings of the row's largest value per element and sqrt(n) times one rounding's rms; an fp8 tile:
    within n bf16 roundings and half an fp8 step."""
    np.random.seed(1)
    x = np.random.randn(64, 32) * 4.0
    once = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    assert harness.within_roundings(once, x, 1)[0]
    row_max = np.abs(x).max(axis=1, keepdims=True)
    off = x.copy()
    off[3, 5] += 2.5 * 2.0 ** -8 * row_max[3, 0]  # one element beyond 2 roundings of its row's largest value
    assert harness.within_roundings(off, x, 3)[0] and not harness.within_roundings(off, x, 2)[0]
    noisy = x + np.sign(np.random.randn(*x.shape)) * 0.9 * 2.0 ** -8 * row_max  # each near one rounding of max
    ok, _, figures = harness.within_roundings(noisy, x, 1)
    assert not ok and "rms" in figures  # within the elementwise bound, but the rms is far above one rounding's
    fp8 = np.clip(x * 30, -240, 240).astype(ml_dtypes.float8_e4m3).astype(np.float64)
    assert harness.within_roundings(fp8, x * 30, 1, fp8=True)[0]
    wrong = fp8.copy()
    wrong[0, 0] += 64.0  # beyond half a step (<= 16 up to 240) plus a bf16 rounding of its row's largest value
    assert not harness.within_roundings(wrong, x * 30, 1, fp8=True)[0]


def test_within_accumulation_is_the_float32_summation_bound():
    """1 + 2^-24 + 2^-24 added in float32 one term at a time: each add is a tie that rounds to even, 1.0, so the sum
    is 2^-23 short of 1 + 2^-23; each term goes through at most 2 roundings, and gamma_2 x (1 + 2^-23) is just above
    that error (a share of 1 - 2^-23 or so), gamma_1's half of it is not. The bound is per element."""
    u = 2.0 ** -24
    total = np.float32(1.0)
    for term in (np.float32(u), np.float32(u)):
        total = np.float32(total + term)
    assert total == 1.0
    exact, abs_sum = 1.0 + 2 * u, 1.0 + 2 * u
    ok, worst, figures = harness.within_accumulation(np.array([total]), np.array([exact]), np.array([abs_sum]), 2)
    assert ok and worst == pytest.approx((2 * u) / (2 * u / (1 - 2 * u) * abs_sum)), figures
    assert figures.startswith("max|err| 1 of the float32 accumulation bound (gamma_2 = 1.19e-07 x the sum of |terms|)")
    ok, worst, _ = harness.within_accumulation(np.array([total]), np.array([exact]), np.array([abs_sum]), 1)
    assert not ok and worst == pytest.approx(2.0, rel=1e-6)
    # an element whose terms are all zero must be exactly zero (no bound to share)
    assert harness.within_accumulation(np.array([0.0, 1.0]), np.array([0.0, 1.0]), np.array([0.0, 1.0]), 5)[0]
    assert not harness.within_accumulation(np.array([1e-30]), np.array([0.0]), np.array([0.0]), 5)[0]


def test_rounded_exactly_has_no_tolerance():
    """Equal values pass; one value one bf16 step off fails and is named; a NaN never equals."""
    x = np.arange(12, dtype=np.float64).reshape(3, 4) / 7
    want = harness.cast_bf16(x)
    assert harness.rounded_exactly(want, want, "bf16(x)") == (True, 0.0, "all 12 values exactly bf16(x)")
    off = want.copy()
    off[2, 1] = float(np.nextafter(np.array(want[2, 1], ml_dtypes.bfloat16), np.array(np.inf, ml_dtypes.bfloat16)))
    ok, worst, figures = harness.rounded_exactly(off, want, "bf16(x)")
    assert not ok and worst == np.inf and figures == f"1 of 12 values not bf16(x) (the first at (2, 1): " \
        f"{off[2, 1]!r} for {want[2, 1]!r})"
    nan = want.copy()
    nan[0, 0] = np.nan
    assert not harness.rounded_exactly(nan, nan, "bf16(x)")[0]


def test_a_projection_may_judge_its_tiles_exactly(fake_checkout):
    """A projection may return harness.TileCheck s instead of tiles to bound: here the tapped product checked
    exactly against the kernel's own rounding, 2 x bf16(float32(x) x 1.5) (its two bf16 halves added). The kernel as
    written: GOLDEN_GAP, the stage naming the exact check; the same kernel 0.1 % off before the tap (gain 1.001,
    within 2 bf16 roundings of x * 3 everywhere): MISMATCH on the exact check, with the count and the first value."""
    def exact(gain):
        base = _tapped_case(gain=gain)

        def projection(inputs, tapped, run):
            tile = np.concatenate([v for _, _, v in sorted(tapped[TAP], key=lambda c: c[1])])
            want = 2 * harness.cast_bf16((inputs["x"].astype(np.float32) * np.float32(1.5)).astype(np.float64))
            return [harness.TileCheck("product", *harness.rounded_exactly(tile, want, "2 bf16(x * 1.5)"))]
        return dataclasses.replace(base, tapped_reference=dataclasses.replace(base.tapped_reference,
                                                                              projection=projection))

    row = harness.run_case(exact(1.0), fake_checkout)
    assert (row.result, row.verdict) == (harness.GOLDEN_GAP, harness.MISMATCH), row.message
    assert row.message.startswith("nki-library's golden is out of reach of the kernel's own bf16 product: product: 1 "
                                  "tile(s) within their bound, the nearest to it product all 2048 values exactly 2 "
                                  "bf16(x * 1.5); "), row.message
    row = harness.run_case(exact(1.001), fake_checkout)
    assert row.result == harness.MISMATCH, row.message
    assert "; not GOLDEN_GAP: tapped product: " in row.message and " of 2048 values not 2 bf16(x * 1.5) (the first " \
        "at (" in row.message and row.message.endswith(", beyond its bound"), row.message
    np.random.seed(0)
    x = np.random.randn(256, 8).astype(np.float32).astype(np.float64)
    assert np.all(np.abs(x * 3.0 * 1.001 - x * 3.0) <= 2 * 2.0 ** -8 * np.abs(x * 3.0).max(axis=1, keepdims=True))


def test_an_fp8_tiles_roundings_taken_at_a_larger_magnitude():
    """``magnitude``: element (0, 0) is a RoPE-like difference of two products of 2,000 clipped to 240; 6 roundings
    at its row's largest value (240) allow 5.6 + half a step at 245.6 (8), at the products' 2,000 46.9 + half a step
    at 286.9 (16); an error of 32 is beyond the first and within the second. Elsewhere the bound is as without it
    (never smaller)."""
    x = np.full((2, 4), 100.0)
    x[0, 0] = 240.0
    mag = np.zeros_like(x)
    mag[0, 0] = 2000.0
    t = x.copy()
    t[0, 0] = 240.0 - 32.0  # (an fp8 value: step 16 in [128, 256))
    assert not harness.within_roundings(t, x, 6, fp8=True)[0]
    ok, worst, figures = harness.within_roundings(t, x, 6, fp8=True, magnitude=mag)
    assert ok and worst == pytest.approx(32 / (6 * 2.0 ** -8 * 2000 + 16)), figures
    assert "6 bf16 roundings at the products' magnitude and half an fp8 step" in figures
    # element (0, 1) 100 off by 12: beyond 6 roundings of its row's 240 (5.6) + half its step (4): not rescued by
    # (0, 0)'s products (the magnitude is per element)
    t = x.copy()
    t[0, 1] = 112.0  # (step 8 in [64, 128): 100 -> 104 nearest; 112 is 12 off)
    assert not harness.within_roundings(t, x, 6, fp8=True, magnitude=mag)[0]


def test_a_mismatch_from_reading_overwritten_placed_tiles_is_stale_read_when_it_passes_unplaced(fake_checkout):
    """scale_on_one_slot(wrong=True) zeroes B, placed on A's bytes, between A's load and its product: the product
    reads B's zeros (a device does the same) and the row mismatches; run with every placed tile on storage of its
    own it passes, so the row is STALE_READ, accepted, and says so. The same kernel used in turn passes; a
    mismatch that stays without placement (a wrong reference) stays MISMATCH."""
    right = _case(entry="scale_on_one_slot")
    assert harness.run_case(right, fake_checkout).result == harness.PASS
    wrong = dataclasses.replace(right, inputs=lambda: {**_case().inputs(), "wrong": True},
                                reference="nkilib_src.refs:scale_ref_any")
    row = harness.run_case(wrong, fake_checkout)
    assert (row.result, row.verdict) == (harness.STALE_READ, harness.MISMATCH), row.message
    assert harness.row_ok(wrong, row)
    assert row.max_abs_err == pytest.approx(float(np.abs(_case().inputs()["x"] * 3.0).max()), rel=1e-6)
    assert row.message.startswith("the kernel's placement: it reads placed tiles another placed tile overwrote "
                                  "(2 reads; first: tensor_scalar reads placed tile "), row.message
    assert "; with every placed tile on storage of its own it passes (max|err| 0 <= " in row.message, row.message
    # the same stale reads with a reference the kernel misses anyway: not its placement, a mismatch
    off = dataclasses.replace(wrong, reference="nkilib_src.refs:off_by_one_ref_any")
    row = harness.run_case(off, fake_checkout)
    assert row.result == harness.MISMATCH and not harness.row_ok(off, row)
    assert row.message.startswith("reads placed tiles another placed tile overwrote (2 reads; first: ") and \
        ", but with every placed tile on storage of its own the row is MISMATCH too" in row.message, row.message


UNSET_READ = '''
import nki.isa as nisa
import nki.language as nl


def scale_and_read_unset(x, out, factor):
    """x * factor, plus one Scalar-engine accumulate that reads registers nothing in the kernel had set."""
    t = nl.ndarray((128, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
    res = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
    for r0 in range(0, x.shape[0], 128):
        nisa.dma_copy(dst=t, src=x[r0:r0 + 128, :])
        nisa.activation(dst=t, op=nl.copy, data=t, scale=factor, reduce_op=nl.add, reduce_res=res,
                        reduce_cmd=nisa.reduce_cmd.reduce)
        nisa.dma_copy(dst=out[r0:r0 + 128, :], src=t)
    return out
'''


def test_a_read_of_unset_accumulation_registers_is_named_in_the_row(fake_checkout):
    """A kernel that reads reduce_cmd registers nothing in its instance had set (isa.vector.AccumulatorNotSetWarning)
    still passes on its outputs, and its row says so: the first program's first read (later reads of the same
    partitions find them set by that one)."""
    (fake_checkout / "src" / "nkilib_src" / "unset_read.py").write_text(textwrap.dedent(UNSET_READ))
    case = _case()
    case = harness.Case(**{**case.__dict__, "entry": "nkilib_src.unset_read:scale_and_read_unset"})
    row = harness.run_case(case, fake_checkout)
    assert row.result == harness.PASS, row.message
    assert "1 read(s) of accumulation registers nothing had set; first: " in row.message
    assert "activation" in row.message and "Scalar" in row.message
    plain = harness.run_case(_case(), fake_checkout)  # the same job with no register read: no such note
    assert plain.result == harness.PASS and "accumulation registers" not in plain.message


def _unseeded_case(name="unseeded", **kw):
    """A case whose inputs draw from numpy's global generator, torch's and Python's ``random`` without seeding
    them; every build is recorded in ``built`` (the case's ``inputs.built``)."""
    import random

    import torch

    built = []

    def make():
        x = (np.random.randn(256, 8) + torch.rand(256, 8, dtype=torch.float64).numpy() + random.random())
        built.append(x.astype(np.float32))
        return {"x": built[-1], "out": np.zeros((256, 8), np.float32), "factor": 3.0}
    make.built = built
    return Case(kernel="fake", name=name, shapes="x[256,8]", entry="nkilib_src.kernels:scale",
                reference="nkilib_src.refs:scale_ref", inputs=make, outputs=("out",), rtol=1e-6, atol=1e-6, **kw)


def test_a_cases_inputs_are_the_same_alone_and_after_other_cases(fake_checkout):
    """A row's inputs are a function of the case alone: run_case seeds numpy's global generator, torch's and
    Python's random with harness.case_seed (CRC-32 of the case id) before inputs(), so a draw the builder makes
    unseeded gives the same values whether the case runs first, after other cases, or in a child forked from a
    process in any state (fails on a harness that calls inputs() as it finds the generators)."""
    import hashlib
    import random
    import zlib

    import torch

    def digest(a):
        return hashlib.sha256(a.tobytes()).hexdigest()

    case = _unseeded_case()
    for seed in (1, 2):  # the state the process happens to be in
        np.random.seed(seed)
        torch.manual_seed(seed)
        random.seed(seed)
        assert harness.run_case(case, fake_checkout).result == harness.PASS
    other = _unseeded_case("another")
    harness.run_case(other, fake_checkout)
    np.random.randn(1000)  # (more draws, as a case that draws and does not seed)
    assert harness.run_case(case, fake_checkout).result == harness.PASS
    built = case.inputs.built
    assert len(built) == 3 and len({digest(a) for a in built}) == 1
    assert digest(other.inputs.built[0]) != digest(built[0])  # (each case its own seed)
    # the documented seed: the CRC-32 of kernel|case|lncN|shapes
    seed = zlib.crc32(b"fake|unseeded|lnc1|x[256,8]")
    assert harness.case_seed(case) == seed and harness.case_id(case) == "fake|unseeded|lnc1|x[256,8]"
    np.random.seed(seed)
    torch.manual_seed(seed)
    random.seed(seed)
    expected = (np.random.randn(256, 8) + torch.rand(256, 8, dtype=torch.float64).numpy() + random.random())
    np.testing.assert_array_equal(built[0], expected.astype(np.float32))


def test_a_refusal_the_case_names_is_decided_on_its_zero_inputs_without_inputs_or_reference(fake_checkout):
    """Case.zero_inputs: with rejected_by, the kernel runs on them first; when it refuses them with that refusal the
    row is decided (REJECTED, the kernel's message after harness.ZERO_INPUTS_NOTE, accepted by row_ok) and neither
    inputs() nor the reference is built."""
    def never():
        raise AssertionError("inputs() built")
    zero = {"x": np.zeros((256, 8), np.float32), "out": np.zeros((256, 8), np.float32), "factor": 3.0}
    case = _case(entry="too_many_partitions", reference="failing_ref", rejected_by="exceeds pmax (128)",
                 zero_inputs=lambda: dict(zero))
    case = dataclasses.replace(case, inputs=never)
    row = harness.run_case(case, fake_checkout)
    assert row.result == harness.REJECTED and harness.row_ok(case, row), row.message
    assert row.message.startswith(f"{harness.ZERO_INPUTS_NOTE}: ") and "partition dim 256 exceeds pmax (128)" in \
        row.message, row.message
    # the kernel gets read-only views of the zero arrays (no copies): nothing is written before the refusal
    assert not zero["out"].any()


def test_zero_inputs_the_kernel_does_not_refuse_leave_the_row_to_its_inputs(fake_checkout):
    """A kernel that runs on the zero inputs (or refuses them otherwise) does not decide the row: it runs on its
    inputs and reference as before, refused or not, and says nothing of zero inputs."""
    zero = lambda: {**_case().inputs(), "factor": 1.0}  # noqa: E731  (checks_factor accepts it)
    refused = _case(entry="checks_factor", factor=-1.0, rejected_by="factor must be positive", zero_inputs=zero)
    row = harness.run_case(refused, fake_checkout)
    assert row.result == harness.ERROR and harness.row_ok(refused, row), row.message
    assert "factor must be positive" in row.message and harness.ZERO_INPUTS_NOTE not in row.message
    # a refusal the case names that its inputs do not bring: the row passes, and row_ok says it is not the refusal
    ran = dataclasses.replace(refused, inputs=lambda: {**_case().inputs(), "factor": 2.0})
    row = harness.run_case(ran, fake_checkout)
    assert row.result == harness.PASS and not harness.row_ok(ran, row)
    # a kernel that writes an argument before it would refuse: the write to the read-only view fails, the row runs
    writes = dataclasses.replace(_case(entry="scale", rejected_by="partition dim", zero_inputs=zero))
    row = harness.run_case(writes, fake_checkout)
    assert row.result == harness.PASS and harness.ZERO_INPUTS_NOTE not in row.message


def _compare_all_float64(actual, expected, rtol, atol):
    """compare()'s rule written out plainly: every element widened to float64, no chunks (the reference)."""
    a, e = np.asarray(actual).reshape(-1).astype(np.float64), np.asarray(expected).reshape(-1).astype(np.float64)
    if np.asarray(actual).shape != np.asarray(expected).shape:
        return False, float("inf"), 0.0
    finite = np.abs(e)[np.isfinite(e)]
    allowed = atol + rtol * (float(finite.max()) if finite.size else 0.0)
    with np.errstate(invalid="ignore"):
        diff = np.abs(a - e)
    diff[np.isinf(a) & np.isinf(e) & (np.sign(a) == np.sign(e))] = 0.0
    ok = bool((np.isfinite(a) == np.isfinite(e)).all()) and bool(np.all(diff <= allowed))
    if np.isnan(diff).any():
        return ok, float("nan"), allowed
    return ok, float(diff.max()) if diff.size else 0.0, allowed


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3,
                                   ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, np.int32])
def test_compare_skips_equal_bit_patterns_with_the_same_result(monkeypatch, dtype):
    """compare() reads equal bit patterns of two same-dtype arrays as a difference of 0 and takes max|e| from the
    bit patterns: the same (ok, error, allowed), bit for bit, as widening every element to float64, for arrays
    mostly equal (a KV cache), all different, or with NaN / infinities / -0.0 / subnormals anywhere, in chunks."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(int(dtype.num))
    monkeypatch.setattr(harness, "COMPARE_CHUNK", 64)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -3e-8, 65504.0, 1e30] if dtype.kind != "i" else [0]
    for trial in range(60):
        n = int(rng.integers(0, 300))
        e = (rng.normal(size=n) * 10.0 ** rng.integers(-3, 4)).astype(dtype)
        a = e.copy()
        share = rng.choice([0.0, 0.02, 0.5, 1.0])
        for arr, k in ((a, int(share * n)), (e, int(rng.integers(0, 3)))):
            where = rng.integers(0, max(n, 1), size=k) if n else []
            arr[where] = (rng.normal(size=len(where)) * 2).astype(dtype)
        for arr in (a, e):
            if n and trial % 3 == 0:
                with np.errstate(all="ignore"):
                    arr[rng.integers(0, n, size=3)] = np.array(rng.choice(special, size=3)).astype(dtype)
        if n and trial % 5 == 0:  # a NaN or an infinity at the same position in both
            with np.errstate(all="ignore"):
                a[n // 2] = e[n // 2] = np.array(rng.choice(special)).astype(dtype)
        rtol, atol = float(rng.choice([0.0, 0.01, 0.5])), float(rng.choice([0.0, 1e-5, 1.0, -1.0]))
        got, want = harness.compare(a, e, rtol, atol), _compare_all_float64(a, e, rtol, atol)
        assert got[0] == want[0] and got[2] == want[2], (trial, got, want)
        assert got[1] == want[1] or (np.isnan(got[1]) and np.isnan(want[1])), (trial, got, want)
        assert type(got[1]) is float and type(got[2]) is float
    mixed = np.arange(5, dtype=np.float32)  # different dtypes: widened, as before
    assert harness.compare(mixed.astype(ml_dtypes.bfloat16), mixed, 0.0, 0.0) == (True, 0.0, 0.0)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3, ml_dtypes.float8_e4m3fn,
                                   ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz])
def test_bit_pattern_reads_of_small_floats_match_their_values(dtype):
    """_float_bits() of a 1- / 2-byte float, on every bit pattern: "finite magnitude" orders like |x| over the finite
    values (0 for zero and the non-finite ones) and "is NaN" is np.isnan of the float64 value, whether read from bit
    operations (sign + magnitude layouts: bf16, fp16, e4m3, e4m3fn, e5m2) or from tables (the fnuz formats, whose
    pattern 0x80 is NaN)."""
    dtype = np.dtype(dtype)
    u, magnitude, is_nan = harness._float_bits(dtype)
    bits = np.arange(1 << (8 * dtype.itemsize), dtype=np.uint64).astype(u)
    with np.errstate(invalid="ignore"):
        values = bits.view(dtype).astype(np.float64)
    mags = np.where(np.isfinite(values), np.abs(values), 0.0)
    rank = np.searchsorted(np.unique(mags), mags)
    assert np.array_equal(magnitude(bits), rank)
    assert np.array_equal(is_nan(bits), np.isnan(values))
    fnuz = "fnuz" in dtype.name
    assert (getattr(magnitude, "__name__", "") == "magnitude") != fnuz  # (which way it read them)


@pytest.mark.parametrize("dtype", [ml_dtypes.float8_e4m3, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
                                   ml_dtypes.float8_e4m3fnuz, ml_dtypes.bfloat16, np.float32, np.uint8])
def test_widened_is_astype_bit_for_bit(dtype):
    """widened() (an fp8 array through a table of its 256 values) gives astype's values bit for bit, NaN payloads
    included, into a new array or ``out``, and a strided view comes back in astype's layout."""
    dtype = np.dtype(dtype)
    bits = np.arange(256 if dtype.itemsize == 1 else 1 << 16, dtype=np.uint64).astype(f"u{dtype.itemsize}")
    a = bits[:(bits.size // 16) * 16].view(dtype).reshape(16, -1) if dtype.kind != "f" or dtype.itemsize < 4 \
        else np.random.default_rng(0).normal(size=(16, 16)).astype(dtype)
    for to in (np.float32, np.float64, np.float16, ml_dtypes.bfloat16):
        with np.errstate(all="ignore"):
            want = a.astype(to)
            out = np.empty(a.shape, to)
            assert harness.widened(a, to).tobytes() == want.tobytes()
            assert harness.widened(a, to, out=out) is out and out.tobytes() == want.tobytes()
            view = a[:, ::3]
            got, want_view = harness.widened(view, to), view.astype(to)
        assert got.tobytes() == want_view.tobytes() and got.strides == want_view.strides


def test_within_share_sums_on_one_blas_thread_whatever_the_process_uses():
    """within_share()'s cosine is the chunks' float64 dot products on one BLAS thread, also when the process's BLAS
    has two (a chunk over OpenBLAS' 10,000-element threshold, which it would split between its threads), and the
    process's thread count is restored after."""
    from trnkit.nkisim import blas

    before = blas.get_num_threads()
    if before is None:
        pytest.skip("numpy is not linked against its bundled OpenBLAS here")
    rng = np.random.default_rng(3)
    e = rng.normal(size=300_000).astype(np.float32)
    a = (e + rng.normal(size=e.size).astype(np.float32) * 1e-3).astype(np.float32)
    try:
        blas.set_num_threads(1)
        a64, e64 = a.astype(np.float64), e.astype(np.float64)
        want = float(a64 @ e64) / (np.sqrt(float(a64 @ a64) * float(e64 @ e64)) + 1e-12)
        blas.set_num_threads(2)
        share, cosine = harness.within_share(a, e, 1e-3)
        assert cosine == want
        assert share == np.count_nonzero(np.abs(a64 - e64) <= 1e-3) / e.size
        assert blas.get_num_threads() == 2
    finally:
        blas.set_num_threads(before)


def test_within_share_is_the_chunked_float64_sums(monkeypatch):
    """within_share() widens each chunk into reused float64 buffers and counts equal bit patterns as inside: the same
    share and cosine, bit for bit, as the chunks widened into new arrays (its dot products are summed per chunk, so
    the chunks are the reference's too), for arrays all different or equal but a few, NaN in one or both."""
    def fresh_arrays(actual, expected, allowed):
        a, e = np.asarray(actual).reshape(-1), np.asarray(expected).reshape(-1)
        inside, dot, aa, ee = 0, 0.0, 0.0, 0.0
        for i in range(0, e.size, harness.COMPARE_CHUNK):
            ac = a[i:i + harness.COMPARE_CHUNK].astype(np.float64)
            ec = e[i:i + harness.COMPARE_CHUNK].astype(np.float64)
            with np.errstate(invalid="ignore"):
                inside += int(np.count_nonzero(np.abs(ac - ec) <= allowed))
            dot, aa, ee = dot + float(ac @ ec), aa + float(ac @ ac), ee + float(ec @ ec)
        return inside / max(e.size, 1), dot / (np.sqrt(aa * ee) + 1e-12)

    rng = np.random.default_rng(7)
    monkeypatch.setattr(harness, "COMPARE_CHUNK", 50)
    for dtype in (np.float32, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3):
        for n in (0, 1, 49, 50, 51, 333):
            e = rng.normal(size=n).astype(dtype)
            near = (e.astype(np.float32) + rng.normal(size=n).astype(np.float32) * 0.01).astype(dtype)
            few = e.copy()  # equal bit patterns but a few (an updated cache), one of them a NaN in both
            few[::17] = near[::17]
            if n > 3:
                near[3] = np.nan
                few[2] = e[2] = np.nan
            for a in (near, few):
                for allowed in (0.005, 0.0, -1.0):
                    got, want = harness.within_share(a, e, allowed), fresh_arrays(a, e, allowed)
                    assert got[0] == want[0], (dtype, n, allowed)
                    assert got[1] == want[1] or np.isnan(got[1]) and np.isnan(want[1]), (dtype, n, allowed)

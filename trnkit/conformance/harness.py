"""Run AWS nki-library kernels on trnkit's interpreter and compare with nki-library's torch references.

A :class:`Case` names an nki-library kernel entry point and torch reference (dotted paths inside the
checkout's ``src/``), a generator of the inputs nki-library's own test feeds it, the logical core
count (LNC, run as a grid launch ``kernel[lnc]``) and nki-library's tolerances. :func:`run_case`
resolves ``nki`` to the interpreter, runs the reference on copies of the inputs, then the kernel on
copies of its own, and compares every output the way nki-library's validator does (``maxAllClose`` in its
default "max" mode): ``|actual - expected| <= atol + rtol * max|expected|`` element-wise, and
infinite/NaN positions must match. Arrays of :data:`LARGE_ARRAY_BYTES` or more (a MoE case's weights,
their float32 copies for the reference, its reference outputs) are kept in files in the temp dir
(:func:`disk_array`): the page cache holds them, and the system can write them back and drop them when
memory runs short; the kernel takes such inputs as they are unless a postprocess reads the inputs after
it. Each case gives one :class:`Row`: PASS, MISMATCH, MISSING API
(the interpreter lacks a name the kernel uses), REJECTED (the interpreter refused the kernel:
``NkiValidationError``) or ERROR (anything else, with its type); two more carry nki-library's own expectation
for the row: XFAIL (the test marks it ``xfail`` and the mismatch is the cause the case checks,
``Case.xfail_check``) and SKIPPED (the test skips the row, ``Case.skipped_by``: it still runs here, and the
message starts with the interpreter's own verdict, :attr:`Row.verdict`). GOLDEN_GAP: a mismatch whose cause is
nki-library's golden, checked per row (:func:`golden_gap`): the same reference, with its values rounded where the
kernel's tiles hold a narrower dtype than it computes in (``Case.rounded_reference``), fails the test's own
validator against the golden, and the kernel meets that validator against the rounded reference; a case with the
kernel's own tiles tapped (``Case.tapped_reference``) is GOLDEN_GAP only by that check (:func:`tapped_golden_gap`).
STALE_READ: a mismatch whose cause is the kernel's own placement, checked per row: it read manually placed tiles
after another tile placed on their bytes overwrote them (``memory.PlacedTileOverwrittenWarning``: a device reads
the same overwritten bytes), and run again with every placed tile on storage of its own
(a launch with ``placement=False``) it passes.

The checkout is found through ``NKILIB_SRC`` (its root, or its ``src/``), else the archive
``nki-library-<commit>.tar.gz`` (``NKILIB_TARBALL``, or ``shared/thirdparty/`` next to or inside the
source tree) is extracted to the temp dir once; nothing of nki-library is copied into trnkit.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import importlib
import inspect
import io
import mmap
import os
import re
import subprocess
import sys
import tempfile
import time
import types
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Case", "Row", "first_output", "load_test_module", "nkilib_root", "nkilib_commit", "nkilib_tarball",
           "extract_tarball", "compare", "disk_array", "uniform_array", "drawn_array", "run_case", "run_cases",
           "format_table", "write_csv", "row_ok", "PASS", "MISMATCH", "MISSING", "REJECTED", "ERROR", "ACCEPTED",
           "XFAIL", "SKIPPED", "GOLDEN_GAP", "STALE_READ", "golden_gap", "MODEL_CONFIG", "TappedReference", "tap",
           "tapped_golden_gap", "within_roundings", "Operand", "case_id", "case_seed", "case_inputs"]

PASS, MISMATCH, MISSING, REJECTED, ERROR = "PASS", "MISMATCH", "MISSING API", "REJECTED", "ERROR"
ACCEPTED = "ACCEPTED"  # a negative case (nki-library expects a rejection) that ran
# a case nki-library's test marks xfail whose mismatch is the cause its Case.xfail_check confirms
XFAIL = "XFAIL"
# a mismatch whose cause is nki-library's golden: its reference rounded as the kernel's tiles are
# (Case.rounded_reference) fails the test's validator too, and the kernel meets the validator against it
# (golden_gap); for a case with a Case.tapped_reference, only its tapped check (tapped_golden_gap)
GOLDEN_GAP = "GOLDEN_GAP"
# a mismatch that comes from the kernel reading placed tiles another placed tile overwrote: with each placed tile on
# storage of its own (launched with placement=False) the row passes (_stale_read)
STALE_READ = "STALE_READ"
SKIPPED = "SKIPPED"  # a row nki-library's own test skips (Case.skipped_by); run anyway, Row.verdict says how it went
CSV_FIELDS = ("kernel", "case", "shapes", "lnc", "result", "max_abs_err", "allowed_err", "rtol",
              "atol", "seconds", "message", "nkilib_commit")


@dataclass(frozen=True)
class Case:
    """One nki-library test case run on the interpreter.

    ``inputs()`` returns the kernel's keyword arguments as nki-library's test builds them (output
    buffers the kernel writes in place included); ``outputs`` names the reference's outputs in the
    order the kernel returns them. ``ref_inputs`` maps those keyword arguments to the reference's (by
    default the same dict). ``keep_low_precision``: the reference computes bf16 inputs in bf16 and its
    outputs are cast back to the first low-precision input dtype (nki-library's
    ``torch_ref_wrapper(preserve_lower_precision=True)``).
    """

    kernel: str  # nki-library kernel, e.g. "core/embeddings/rope_hf"
    name: str  # the variant, e.g. "fwd cos/sin bf16"
    shapes: str
    entry: str  # "module:function" inside nki-library's src/ (or a callable's qualified path)
    reference: str  # "module:function" of nki-library's torch reference
    inputs: Callable[[], dict[str, Any]]
    outputs: tuple[str, ...]
    lnc: int = 1
    rtol: float = 1e-5
    atol: float = 1e-8
    keep_low_precision: bool = False
    test_file: str = ""  # nki-library test the shapes and tolerances come from
    note: str = ""  # e.g. "the test's shape reduced: ..."
    negative: bool = False  # nki-library expects the kernel to reject these inputs
    wrap_kernel: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
    ref_inputs: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # (inputs, actual, expected) -> (actual, expected) to compare, for tests with their own validator
    postprocess: Callable[[dict, dict, dict], tuple[dict, dict]] | None = None
    cleanup: str = ""  # "module:function" nki-library's test calls after the kernel
    # > 0: a collective kernel on that many devices (nki.collectives.run_ranks); inputs() returns
    # {"ranks": [kwargs of rank 0, ...]} and each output is compared stacked over the ranks
    ranks: int = 0
    # inputs the kernel only reads: every rank gets a read-only view of the one array instead of a copy
    # of its own (a write to one raises); for collective cases whose ranks share large weights
    read_only: tuple[str, ...] = ()
    tier: str = ""  # "" for the tests' unit tables; MODEL_CONFIG for a row of a test's model-config table
    xfail: str = ""  # nki-library's own xfail(strict=False) on the test that runs this row: its reason
    # with ``xfail``: (inputs, actual, expected) of a MISMATCH -> the checked cause ("" when the mismatch is not that
    # cause); the row is XFAIL only when it names one, any other mismatch stays MISMATCH
    xfail_check: Callable[[dict, dict, dict], str] | None = None
    # nki-library's own test skips this row (its pytest.skip reason): the row is SKIPPED, run anyway
    skipped_by: str = ""
    # a documented hardware rule the kernel breaks on these inputs, or nki-library's own kernel check that refuses
    # them: the row does not pass, and its message contains this text
    rejected_by: str = ""
    # a test whose validator lets a share of an output miss the tolerance (nki-library's maxAllClose
    # min_pass_rate): (output, least fraction of its elements within the tolerance); min_cosine: the least
    # cosine similarity of every output with the reference, where the test asks for one
    min_pass_rate: tuple[tuple[str, float], ...] = ()
    min_cosine: float = 0.0
    # (what it rounds, ref_inputs): nki-library's reference with its values rounded where the kernel's tiles hold a
    # narrower dtype than the reference computes in (e.g. fp8 tiles where it keeps float32 clipped to fp8's range);
    # a MISMATCH is GOLDEN_GAP when golden_gap finds the golden out of reach of that rounding, else it stays MISMATCH
    # (not used for a case with a tapped_reference: the tapped check alone decides it)
    rounded_reference: tuple[str, Callable[[dict[str, Any]], dict[str, Any]]] | None = None
    # the kernel's own intermediate tiles recorded during the run (:class:`TappedReference`): a MISMATCH is
    # GOLDEN_GAP only when tapped_golden_gap's three conditions hold, else it stays MISMATCH
    tapped_reference: TappedReference | None = None
    # with ``rejected_by``, a refusal that follows from the row's sizes alone: the kernel's keyword arguments with
    # the shapes, dtypes and other values ``inputs()`` gives, every drawn array zero (allocated, never filled), built
    # in a fraction of the time and memory. :func:`run_case` runs the kernel on them first, without the reference:
    # when it refuses with ``rejected_by`` that is the row; anything else, and the row runs on ``inputs()`` as usual
    zero_inputs: Callable[[], dict[str, Any]] | None = None


@dataclass(frozen=True)
class TappedReference:
    """How :func:`tapped_golden_gap` checks a row on the kernel's own intermediate tiles.

    ``taps``: ``"module:function"`` (resolved in the checkout) of kernel-side functions whose returned tile is
    recorded on every call during the kernel's run (:func:`tap`: read-only, a copy of the value; the kernel gets
    the same object back). ``projection(inputs, taps, run)`` -> ``[(label, tapped, exact, roundings, fp8), ...]``:
    tapped tiles and a computation of the same values (float64, or nki-library's float32 reference, which
    ``run(fn)`` runs with its inputs mapped by ``fn``) from the kernel's own tapped inputs to them, with the number
    of bf16 roundings each element can go through and whether the tile is fp8 (:func:`within_roundings`), and
    optionally (a sixth item) the magnitude those roundings act on (``within_roundings``' ``magnitude``); or a
    :class:`TileCheck`, a tile the projection judged itself (an exact check, or a bound it derives).
    ``ref_inputs(kw, taps)``: the reference's inputs (the case's ``ref_inputs`` already applied) with the tapped
    tiles fed in; ``what`` says which. ``min_cosine``: how near (cosine similarity, every output the kernel fails)
    the kernel must be to that reference. ``routes``: groups of taps of which exactly one records a tile in a run
    (the same tile on the kernel's alternative code paths, e.g. a projection's quantized input in ``qkv_tkg`` or
    ``qkv_cte``); ``optional``: taps that may record nothing (an instruction the kernel calls only on some paths,
    whose absence the projection judges); every other tap must record one."""

    what: str
    taps: tuple[str, ...]
    projection: Callable[..., list[tuple[str, np.ndarray, np.ndarray, float, bool] | TileCheck]]
    ref_inputs: Callable[[dict[str, Any], dict[str, list]], dict[str, Any]]
    min_cosine: float = 0.9999
    routes: tuple[tuple[str, ...], ...] = ()
    optional: tuple[str, ...] = ()
    # (root, taps) -> a context manager inside which the reference fed the taps runs (e.g. routed as the kernel
    # routes: :func:`trnkit.conformance.cases_moe_block.routed_as_kernel`); None: the reference as it is
    during: Callable[[Path, dict[str, list]], contextlib.AbstractContextManager] | None = None


MODEL_CONFIG = "model_config"  # Case.tier of the rows of nki-library's test_*_model_config.py tables
REDUCED = "reduced"  # Case.tier of a model-config row run with token counts reduced for CPU time (reduce.py)


def case_id(case: Case) -> str:
    """``kernel|case|lncN|shapes``: unique per case (the pytest id)."""
    return f"{case.kernel}|{case.name}|lnc{case.lnc}|{case.shapes}"


def case_seed(case: Case) -> int:
    """The seed a case's inputs start from: the CRC-32 of :func:`case_id` (a 32-bit value numpy, torch and
    Python's ``random`` all take)."""
    return zlib.crc32(case_id(case).encode())


def case_inputs(case: Case, build: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """``case.inputs()`` (or ``build()``, e.g. its ``zero_inputs``) after seeding numpy's global generator,
    torch's and Python's ``random`` with :func:`case_seed`, so that the inputs are a function of the case alone:
    a draw the builder makes before seeding (nki-library's tests seed where they seed; the cases keep those seeds)
    does not depend on the cases run before it in the process, or on the state a forked child inherits."""
    import random

    import torch

    seed = case_seed(case)
    np.random.seed(seed)
    torch.manual_seed(seed)
    random.seed(seed)
    return (build or case.inputs)()


@dataclass
class Row:
    """The result of one :class:`Case`."""

    kernel: str
    case: str
    shapes: str
    lnc: int
    result: str
    max_abs_err: float | None = None
    allowed_err: float | None = None
    rtol: float = 0.0
    atol: float = 0.0
    seconds: float | None = None
    message: str = ""
    nkilib_commit: str = ""
    outputs: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (err, allowed)
    verdict: str = ""  # the run's own result where ``result`` is nki-library's expectation (XFAIL, SKIPPED)

    def csv_row(self) -> dict[str, Any]:
        fmt = lambda v: "" if v is None else f"{v:.3g}"  # noqa: E731
        return {"kernel": self.kernel, "case": self.case, "shapes": self.shapes, "lnc": self.lnc,
                "result": self.result, "max_abs_err": fmt(self.max_abs_err),
                "allowed_err": fmt(self.allowed_err), "rtol": self.rtol, "atol": self.atol,
                "seconds": "" if self.seconds is None else f"{self.seconds:.2f}",
                "message": self.message, "nkilib_commit": self.nkilib_commit}


# -- the checkout ---------------------------------------------------------------------------------
REPO_ROOT = Path(__file__).resolve().parents[2]
# where a source tree keeps the nki-library archive (``git archive`` of a commit) next to it
TARBALL_DIRS = (REPO_ROOT.parent / "shared" / "thirdparty", REPO_ROOT / "shared" / "thirdparty")
COMMIT_FILE = ".nkilib-commit"  # written next to an extracted archive: its commit


def _checkout(p: Path) -> Path | None:
    if (p / "nkilib_src").is_dir():
        p = p.parent
    return p if (p / "src" / "nkilib_src").is_dir() else None


def nkilib_tarball() -> Path | None:
    """The nki-library archive: ``$NKILIB_TARBALL``, else the newest ``nki-library-*.tar.gz`` in
    :data:`TARBALL_DIRS`."""
    raw = os.environ.get("NKILIB_TARBALL")
    if raw:
        p = Path(raw).expanduser()
        return p if p.is_file() else None
    for d in TARBALL_DIRS:
        found = sorted(d.glob("nki-library-*.tar.gz")) if d.is_dir() else []
        if found:
            return found[-1]
    return None


def extract_tarball(tarball: Path, cache: Path | None = None) -> Path:
    """Extract ``tarball`` once into ``cache`` (default: a per-archive folder in the temp dir) and
    return the checkout; concurrent callers (pytest workers) each extract aside and one rename wins."""
    import tarfile
    import tempfile

    stat = tarball.stat()
    dest = cache or Path(tempfile.gettempdir()) / f"trnkit-{tarball.name.removesuffix('.tar.gz')}-{stat.st_size}"
    if (dest / COMMIT_FILE).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    with tarfile.open(tarball) as tf:
        commit = str(tf.pax_headers.get("comment", "unknown"))[:7]  # git archive records the commit
        tf.extractall(tmp, filter="data")
    (tmp / COMMIT_FILE).write_text(commit + "\n")
    try:
        tmp.rename(dest)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def nkilib_root(path: str | os.PathLike | None = None, use_tarball: bool = True) -> Path | None:
    """The nki-library checkout: ``path`` or ``$NKILIB_SRC`` (its root or its ``src/``), else the
    archive of :func:`nkilib_tarball` extracted (``use_tarball``); None when there is none."""
    raw = path if path is not None else os.environ.get("NKILIB_SRC")
    if raw:
        return _checkout(Path(raw).expanduser().resolve())
    tarball = nkilib_tarball() if use_tarball else None
    return _checkout(extract_tarball(tarball)) if tarball is not None else None


def nkilib_commit(root: Path) -> str:
    """Short commit hash of the checkout (an extracted archive's recorded commit; "unknown" when it
    is neither)."""
    if (root / COMMIT_FILE).is_file():
        return (root / COMMIT_FILE).read_text().strip()
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


class _MissingNeuronDtypes(types.ModuleType):
    """Stands in for AWS's ``neuron_dtypes`` (not installable): importing works, every use raises."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotImplementedError(f"neuron_dtypes.{name}: AWS's neuron_dtypes package is not installable; "
                                  "this path of nki-library's code needs it")


def _neuron_dtypes_shim() -> types.ModuleType | None:
    """Some nki-library reference modules import ``neuron_dtypes`` at the top but only use it on their
    fp8 / MX paths; without the package, install :class:`_MissingNeuronDtypes` (returned) so the
    other paths run and any use names the package."""
    import importlib.util

    if "neuron_dtypes" in sys.modules or importlib.util.find_spec("neuron_dtypes") is not None:
        return None
    shim = _MissingNeuronDtypes("neuron_dtypes")
    sys.modules["neuron_dtypes"] = shim
    return shim


@contextlib.contextmanager
def nki_is_interpreter(root: Path) -> Iterator[None]:
    """``import nki`` resolves to the interpreter (:func:`trnkit.nkisim.install_as_nki`) and
    ``nkilib_src`` to the checkout inside the block; the previous modules come back afterwards."""
    from trnkit import nkisim

    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] == "nkilib_src"}
    src = str(root / "src")
    sys.path.insert(0, src)
    uninstall = nkisim.install_as_nki()
    shim = _neuron_dtypes_shim()
    try:
        yield
    finally:
        if shim is not None and sys.modules.get("neuron_dtypes") is shim:
            del sys.modules["neuron_dtypes"]
        uninstall()
        sys.path.remove(src)
        for k in [k for k in sys.modules if k.split(".")[0] == "nkilib_src"]:
            del sys.modules[k]
        sys.modules.update(saved)


# nki-library modules that do not parse at the measured commit: core/mlp/mlp.py at d2ad3a5 repeats the
# last 11 lines of mlp()'s docstring after its closing quotes (lines 203-213, indented: IndentationError).
# The run drops such a verbatim repeat and nothing else; the cases that use it say so.
REPAIRED_MODULES = ("nkilib_src.nkilib.core.mlp.mlp",)


def drop_repeated_docstring_tail(source: str) -> str:
    """``source`` without the lines that follow a closing ``\"\"\"`` line and repeat, verbatim up to
    a second closing ``\"\"\"``, the lines just before the first one; unchanged when there are none."""
    lines = source.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.strip() != '"""':
            continue
        j = next((k for k in range(i + 1, len(lines)) if lines[k].strip() == '"""'), None)
        if j is None:
            break
        block = [ln for ln in lines[i + 1:j] if ln.strip()]
        before = [ln for ln in lines[:i] if ln.strip()][-len(block):] if block else []
        if block and block == before:
            return "".join(lines[:i + 1] + lines[j + 1:])
    return source


def _load_repaired(module: str) -> None:
    """Import ``module`` from its source with :func:`drop_repeated_docstring_tail` applied when the
    file does not parse as it is (a file that parses is imported normally)."""
    import ast
    import importlib.util

    if module in sys.modules:
        return
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:  # a checkout without that package
        return
    if spec is None or spec.origin is None:
        return
    source = Path(spec.origin).read_text()
    try:
        ast.parse(source)
        return
    except SyntaxError:
        source = drop_repeated_docstring_tail(source)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod
    try:
        exec(compile(source, spec.origin, "exec"), mod.__dict__)  # noqa: S102
    except BaseException:
        del sys.modules[module]
        raise


class _TestInfraStandIn:
    """Stands in for a name of nki-library's test infrastructure (``test.utils``: not in the archive).

    Used as a decorator, with or without its parameters (``@pytest_test_metadata(...)``,
    ``@pytest_parametrize(names, rows)``), it returns what it decorates; a call returns a stand-in for its result,
    and any use of that (an attribute: the test methods' orchestration, which the conformance run replaces)
    raises, naming it."""

    def __init__(self, name: str, member: bool = False) -> None:
        self._name = name
        self._member = member  # an enum member the test data names: a token, not callable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._member:
            raise NotImplementedError(f"{self._name}: nki-library's test infrastructure is not part of the archive")
        if len(args) == 1 and not kwargs and isinstance(args[0], type | types.FunctionType):
            return args[0]
        return _TestInfraStandIn(f"{self._name}(...)")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name.isupper():  # an enum member the test data names (ModelTestType.OPTIMAL): a named token
            token = self.__dict__.setdefault("_members", {}).setdefault(
                name, _TestInfraStandIn(f"{self._name}.{name}", member=True))
            return token
        raise NotImplementedError(f"{self._name}.{name}: nki-library's test infrastructure is not part of "
                                  "the archive")

    def __repr__(self) -> str:
        return self._name


# the package nki-library's tests import their orchestration from (absent from the archive)
TEST_INFRA = "test.utils"
TEST_MODULE_PREFIX = "nkilib_src._nkilib_tests"  # removed with nkilib_src after each case


def load_test_module(root: Path, rel_path: str) -> types.ModuleType:
    """nki-library's test file ``rel_path`` (``test/integration/...py``, under ``root``), imported for
    the kernels and goldens it defines, with stand-ins for the ``test.utils`` modules it imports; the
    other nki-library test modules it imports (``test.integration...``) are loaded from the checkout the
    same way (stdlib ``test`` entries are restored afterwards). Its kernels and test data run as they
    are; nothing is copied."""
    import ast
    import importlib.util

    name = f"{TEST_MODULE_PREFIX}.{rel_path.removesuffix('.py').replace('/', '_')}"
    if name in sys.modules:
        return sys.modules[name]
    path = root / rel_path
    tree = ast.parse(path.read_text())
    imported = {n.module: [a.name for a in n.names] for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("test.")}
    infra = {m: names for m, names in imported.items() if m.startswith(TEST_INFRA + ".")}
    siblings = {m: load_test_module(root, m.replace(".", "/") + ".py")
                for m in imported if m not in infra and (root / (m.replace(".", "/") + ".py")).is_file()}
    shadowed = {k: sys.modules.get(k) for k in ["test", TEST_INFRA, *infra, *siblings]}
    for mod_name, names in infra.items():
        stand = types.ModuleType(mod_name)
        for n in names:
            setattr(stand, n, _TestInfraStandIn(n))
        sys.modules[mod_name] = stand
    sys.modules.update(siblings)  # found by their full name, so no parent package is needed
    sys.modules["test"], sys.modules[TEST_INFRA] = types.ModuleType("test"), types.ModuleType(TEST_INFRA)
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        try:
            with warnings.catch_warnings():  # the marks nki-library's pytest config registers (fast, ...)
                warnings.filterwarnings("ignore", message=r"Unknown pytest\.mark")
                spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[name]
            raise
    finally:
        restore_modules(shadowed)
    return mod


def restore_modules(saved: dict[str, types.ModuleType | None]) -> None:
    """Put ``sys.modules`` entries back as ``saved`` holds them (``None``: the name was absent)."""
    for name, module in saved.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module


def _resolve(path: str, root: Path | None = None) -> Any:
    """``module:attr.attr``; a module ending in ``.py`` is an nki-library test file under ``root``."""
    module, _, attr = path.partition(":")
    obj = load_test_module(root, module) if module.endswith(".py") else importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


# -- comparison ----------------------------------------------------------------------------------
COMPARE_CHUNK = 1 << 22  # elements compared at once: float64 temporaries of ~32 MB each, whatever the size


def _float_bits(dtype: np.dtype) -> tuple[np.dtype, Callable[[np.ndarray], np.ndarray],
                                          Callable[[np.ndarray], np.ndarray]] | None:
    """For a floating dtype whose values :func:`compare` can read from their bit patterns: ``(unsigned integer
    dtype of its size, finite magnitude, is NaN)``. ``finite magnitude`` maps bit patterns to an integer that
    orders like ``|x|`` over finite ``x`` (0 for a non-finite ``x``, as for zero), ``is NaN`` to booleans.
    float32 / float64 by their IEEE 754 fields; a 1- or 2-byte float (bf16, fp16, the fp8s) by a table of all
    its bit patterns built with the dtype's own conversion to float64. None for anything else."""
    if dtype in _FLOAT_BITS:
        return _FLOAT_BITS[dtype]
    info = None
    if dtype in (np.dtype(np.float32), np.dtype(np.float64)):
        u = np.dtype(f"u{dtype.itemsize}")
        bits = 8 * dtype.itemsize
        exp = u.type({32: 0x7F800000, 64: 0x7FF0000000000000}[bits])
        absmask = u.type((1 << (bits - 1)) - 1)

        def magnitude(b: np.ndarray) -> np.ndarray:
            m = b & absmask
            m[m >= exp] = 0  # inf / NaN
            return m

        def is_nan(b: np.ndarray) -> np.ndarray:
            return (b & absmask) > exp

        info = (u, magnitude, is_nan)
    elif dtype.itemsize in (1, 2) and (dtype.kind == "f" or "float" in dtype.name) and _zero_first(dtype):
        u = np.dtype(f"u{dtype.itemsize}")
        with np.errstate(invalid="ignore"):
            values = np.arange(1 << (8 * dtype.itemsize), dtype=np.uint64).astype(u).view(dtype).astype(np.float64)
        mags = np.where(np.isfinite(values), np.abs(values), 0.0)
        order = np.unique(mags)  # (sorted)
        rank = np.searchsorted(order, mags).astype(u)  # |x| order, 0 for zero and non-finite
        nan = np.isnan(values)
        info = (u, *(_sign_magnitude_reads(u, rank, nan) or (rank.__getitem__, nan.__getitem__)))
        _FLOAT_VALUES[dtype] = order
    _FLOAT_BITS[dtype] = info
    return info


def _sign_magnitude_reads(u: np.dtype, rank: np.ndarray, nan: np.ndarray
                          ) -> tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]] | None:
    """``(finite magnitude, is NaN)`` of a 1- or 2-byte float computed from its bits, returning what the lookup
    tables ``rank`` and ``nan`` (indexed by bit pattern) return, for a format laid out as sign bit + magnitude
    bits: the magnitude bits below a first non-finite pattern ``T`` rank as themselves, from ``T`` up they are
    non-finite (rank 0), and the NaNs are the magnitude bits from some ``N`` up (bf16: T = 0x7F80, N = 0x7F81;
    float8_e4m3fn: T = N = 0x7F). Checked on every bit pattern; None for a format that differs anywhere (e.g.
    float8_e4m3fnuz, whose 0x80 is NaN): the tables are then read. Bit operations read 4 M bf16 elements in ~5 ms
    where the table lookups (an index conversion and a gather) take ~30 ms."""
    absmask = u.type((1 << (8 * u.itemsize - 1)) - 1)
    m = np.arange(rank.size, dtype=u) & absmask
    nonfinite = np.flatnonzero((rank == 0) & (m > 0))
    t = u.type(nonfinite[0] if nonfinite.size else int(absmask) + 1)
    nans = np.flatnonzero(nan)
    n = u.type(nans[0] & absmask if nans.size else int(absmask) + 1)
    if not (np.array_equal(rank, np.where(m < t, m, 0)) and np.array_equal(nan, m >= n)):
        return None

    def magnitude(b: np.ndarray) -> np.ndarray:
        mag = b & absmask
        mag[mag >= t] = 0  # inf / NaN
        return mag

    def is_nan(b: np.ndarray) -> np.ndarray:
        return (b & absmask) >= n

    return magnitude, is_nan


def _zero_first(dtype: np.dtype) -> bool:
    """Whether bit pattern 0 of a 1- or 2-byte float is +0.0 (every float format with a zero)."""
    return float(np.zeros(1, f"u{dtype.itemsize}").view(dtype).astype(np.float64)[0]) == 0.0


_FLOAT_BITS: dict[np.dtype, Any] = {}
_FLOAT_VALUES: dict[np.dtype, np.ndarray] = {}  # a 1- / 2-byte float's magnitudes in rank order


def _max_finite_abs(e: np.ndarray, chunks: list[slice]) -> float:
    """``max |e|`` over the finite values of a flat ``e`` (0.0 when none), in float64."""
    fb = _float_bits(e.dtype)
    if fb is None:
        e_max = 0.0
        for c in chunks:
            finite_e = np.abs(e[c].astype(np.float64))
            finite_e = finite_e[np.isfinite(finite_e)]
            if finite_e.size:
                e_max = max(e_max, float(finite_e.max()))
        return e_max
    u, magnitude, _ = fb
    bits, top = e.view(u), 0
    for c in chunks:
        if bits[c].size:
            top = max(top, int(magnitude(bits[c]).max()))
    if e.dtype in _FLOAT_VALUES:
        return float(_FLOAT_VALUES[e.dtype][top])
    return float(np.array(top, u).view(e.dtype))


def _differing(a: np.ndarray, e: np.ndarray) -> np.ndarray | None:
    """The positions of two flat same-dtype chunks where ``|a - e|`` can be other than 0 with equal finiteness:
    different bit patterns, or NaN in ``a`` (equal bit patterns otherwise are equal values, finite or the same
    infinity: a difference of 0). None where :func:`_float_bits` cannot read the dtype."""
    fb = _float_bits(a.dtype)
    if fb is None:
        return None
    u, _, is_nan = fb
    ab = a.view(u)
    return (ab != e.view(u)) | is_nan(ab)


def _compare_chunk(ac: np.ndarray, ec: np.ndarray, allowed: float) -> tuple[bool, float, bool]:
    """``(ok, largest |a - e| over the non-NaN differences (0.0 when none), any NaN)`` of two float64 chunks."""
    with np.errstate(invalid="ignore"):
        diff = np.abs(ac - ec)
    diff[np.isinf(ac) & np.isinf(ec) & (np.sign(ac) == np.sign(ec))] = 0.0
    ok = bool((np.isfinite(ac) == np.isfinite(ec)).all()) and bool(np.all(diff <= allowed))  # (NaN fails)
    nan = np.isnan(diff)
    worst = float(np.nanmax(diff)) if not nan.all() else 0.0
    return ok, worst, bool(nan.any())


def compare(actual: np.ndarray, expected: np.ndarray, rtol: float, atol: float
            ) -> tuple[bool, float, float]:
    """nki-library's acceptance rule ("max" mode): ``(ok, largest |a - e|, atol + rtol * max|e|)``.

    ``max|e|`` is over the finite reference values; equal infinities count as no difference; a
    position finite in one array and not in the other fails; shapes must match. The differences are
    taken in float64, :data:`COMPARE_CHUNK` elements at a time (a whole MoE weight gradient upcast at
    once would need several times its own size in temporaries). Where both arrays have the same float
    dtype (:func:`_float_bits`), elements with equal bit patterns (an updated KV cache's untouched
    positions) are equal values and skip the float64 arithmetic: the result is the same.
    """
    a, e = np.asarray(actual), np.asarray(expected)
    if a.shape != e.shape:
        return False, float("inf"), 0.0
    a, e = a.reshape(-1), e.reshape(-1)
    chunks = [slice(i, i + COMPARE_CHUNK) for i in range(0, e.size, COMPARE_CHUNK)]
    allowed = atol + rtol * _max_finite_abs(e, chunks)
    same = a.dtype == e.dtype
    ok, worst, any_nan = True, 0.0, False
    for c in chunks:
        ac, ec = a[c], e[c]
        sel = _differing(ac, ec) if same else None
        if sel is not None and sel.size and not sel.all():
            ok &= 0.0 <= allowed  # (the equal elements' difference: 0)
            ac, ec = ac[sel], ec[sel]
        ok_c, worst_c, nan_c = _compare_chunk(widened(ac, np.float64), widened(ec, np.float64), allowed)
        ok &= ok_c
        any_nan |= nan_c
        worst = max(worst, worst_c)
    return ok, float("nan") if any_nan else worst, allowed


# -- large arrays ----------------------------------------------------------------------------------
# Arrays of this size or more (a MoE case's weights, their float32 copies for the reference, its weight
# gradients) live in files in the temp dir instead of anonymous memory: the kernel, the reference and the
# comparison read them through the page cache, which the system can write back and drop under pressure.
LARGE_ARRAY_BYTES = 1 << 28


def disk_array(shape: Sequence[int] | int, dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array backed by an unlinked file in the temp dir (``TMPDIR``):
    its disk space goes when the array and every view of it do."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    with tempfile.TemporaryFile(prefix="trnkit-conformance-") as f:  # the mapping outlives the file
        f.truncate(nbytes)
        return np.asarray(np.memmap(f, dtype=dtype, mode="r+", shape=shape))


def uniform_array(low: float, high: float, shape: Sequence[int], dtype: Any) -> np.ndarray:
    """``np.random.uniform(low, high, size=shape).astype(dtype)`` from numpy's global generator, drawn
    one index of the first axis at a time (the same numbers: the legacy generator draws them in order)
    without the whole float64 draw; a large result is a :func:`disk_array`."""
    dtype, shape = np.dtype(dtype), tuple(shape)
    size = int(np.prod(shape, dtype=np.int64))
    out = disk_array(shape, dtype) if size * dtype.itemsize >= LARGE_ARRAY_BYTES else np.empty(shape, dtype)
    for i in range(shape[0]):
        out[i] = np.random.uniform(low, high, size=shape[1:]).astype(dtype)
    return out


def drawn_array(draw: Callable[[int], np.ndarray], shape: Sequence[int], dtype: Any,
                via: Any = np.float32, on_disk: bool | None = None) -> np.ndarray:
    """``draw(size).astype(via).astype(dtype).reshape(shape)`` drawn :data:`COMPARE_CHUNK` values at a time
    (``draw(n)``: the next ``n`` values of a generator that draws element by element in order, e.g.
    ``lambda n: rng.uniform(-1, 1, n)`` of a ``default_rng`` or the legacy global generator: the same
    numbers and the same generator state after as the one-shot draw) without the whole float64 draw; a
    large result (or any, ``on_disk=True``) is a :func:`disk_array`. ``via=None``: cast straight to ``dtype``."""
    dtype, shape = np.dtype(dtype), tuple(shape)
    size = int(np.prod(shape, dtype=np.int64))
    if on_disk is None:
        on_disk = size * dtype.itemsize >= LARGE_ARRAY_BYTES
    out = disk_array(shape, dtype) if on_disk else np.empty(shape, dtype)
    flat = out.reshape(-1)
    for i in range(0, size, COMPARE_CHUNK):
        chunk = np.asarray(draw(min(COMPARE_CHUNK, size - i)))
        flat[i:i + chunk.size] = chunk.astype(via).astype(dtype) if via is not None else chunk.astype(dtype)
    return out


def _file_backed(a: np.ndarray) -> bool:
    """Whether ``a`` is a view of a memory-mapped file (a :func:`disk_array`, a ``np.memmap``)."""
    base = a
    while isinstance(base, np.ndarray) and not isinstance(base, np.memmap):
        base = base.base
    return isinstance(base, (np.memmap, mmap.mmap))


def _copy(a: np.ndarray, dtype: Any = None) -> np.ndarray:
    """``a.astype(dtype)`` (default: its own), always a copy; a large one, or a copy of a file-backed one (a
    case that keeps an input on disk keeps its copies there), on disk (:func:`disk_array`), converted
    :data:`COMPARE_CHUNK` elements at a time."""
    dtype = a.dtype if dtype is None else np.dtype(dtype)
    if a.size * max(a.dtype.itemsize, dtype.itemsize) < LARGE_ARRAY_BYTES and not _file_backed(a):
        return widened(a, dtype)  # (a copy)
    out = disk_array(a.shape, dtype)
    src, dst = a.reshape(-1), out.reshape(-1)
    for i in range(0, a.size, COMPARE_CHUNK):
        widened(src[i:i + COMPARE_CHUNK], dtype, out=dst[i:i + COMPARE_CHUNK])
    return out


def _widening_table(src: np.dtype, dst: np.dtype) -> np.ndarray | None:
    """The value of each of the 256 bit patterns of a 1-byte float ``src`` in float ``dst`` (``dst``'s own cast of
    each, as ``astype`` gives it), or None when ``src`` is not a 1-byte float or ``dst`` not a float."""
    key = (src, dst)
    if key not in _WIDENING:
        one_byte_float = src.itemsize == 1 and (src.kind == "f" or "float" in src.name)
        with np.errstate(invalid="ignore"):
            _WIDENING[key] = np.arange(256, dtype=np.uint8).view(src).astype(dst) \
                if one_byte_float and dst.kind == "f" else None
    return _WIDENING[key]


_WIDENING: dict[tuple[np.dtype, np.dtype], np.ndarray | None] = {}


def widened(a: np.ndarray, dtype: Any, out: np.ndarray | None = None) -> np.ndarray:
    """``a.astype(dtype)`` (into ``out`` when given, as ``np.copyto(out, a, casting="unsafe")``), the same values
    bit for bit; a 1-byte float (fp8) goes through a table of its 256 values, a gather ~3x faster than ml_dtypes'
    element-wise cast to float32 and ~6x to float64 (an fp8 KV cache's hundreds of millions of elements)."""
    dtype = np.dtype(dtype)
    table = _widening_table(a.dtype, dtype)
    if table is None or a.ndim == 0 or (out is None and not a.flags.c_contiguous):  # (astype keeps a's layout)
        if out is None:
            return a.astype(dtype)
        np.copyto(out, a, casting="unsafe")
        return out
    if out is None:
        return table[a.view(np.uint8)]
    out[...] = table[a.view(np.uint8)]
    return out


def _to_disk(value: Any) -> Any:
    """A large array not yet file-backed, moved to a :func:`disk_array` (other values as they are)."""
    if not isinstance(value, np.ndarray) or value.nbytes < LARGE_ARRAY_BYTES or _file_backed(value):
        return value
    return _copy(value)


def within_share(actual: np.ndarray, expected: np.ndarray, allowed: float) -> tuple[float, float]:
    """``(fraction of elements with |a - e| <= allowed, cosine similarity)`` of two same-shape arrays
    (chunked as :func:`compare`; each chunk widened into the same float64 buffers, not new arrays: the same
    numbers, without mapping fresh memory per chunk; the share counts elements with equal bit patterns as
    :func:`compare` reads them, a difference of 0); positions finite in one array only count as outside. Its
    float64 dot products run on one BLAS thread: the cosine does not depend on the machine's core count (OpenBLAS
    splits a long dot product between its threads and adds the parts), and on the shared 2-core machine two
    threads took 1.5-2x the CPU of one (64 M bf16 elements: 0.64-0.72 s -> 0.35-0.47 s)."""
    from trnkit.nkisim import blas

    with blas.threads(1):
        return _within_share(np.asarray(actual).reshape(-1), np.asarray(expected).reshape(-1), allowed)


def _within_share(a: np.ndarray, e: np.ndarray, allowed: float) -> tuple[float, float]:
    inside, dot, aa, ee = 0, 0.0, 0.0, 0.0
    n = min(COMPARE_CHUNK, e.size)
    buf_a, buf_e = np.empty(n), np.empty(n)
    same = a.dtype == e.dtype
    for i in range(0, e.size, COMPARE_CHUNK):
        k = min(COMPARE_CHUNK, e.size - i)
        ac, ec = buf_a[:k], buf_e[:k]
        widened(a[i:i + k], np.float64, out=ac)
        widened(e[i:i + k], np.float64, out=ec)
        sel = _differing(a[i:i + k], e[i:i + k]) if same else None
        with np.errstate(invalid="ignore"):
            if sel is not None and not sel.all():
                inside += (k - int(np.count_nonzero(sel))) * bool(0.0 <= allowed)
                inside += int(np.count_nonzero(np.abs(ac[sel] - ec[sel]) <= allowed))
            else:
                inside += int(np.count_nonzero(np.abs(ac - ec) <= allowed))
        dot, aa, ee = dot + float(ac @ ec), aa + float(ac @ ac), ee + float(ec @ ec)
    return inside / max(e.size, 1), dot / (np.sqrt(aa * ee) + 1e-12)


# -- running -------------------------------------------------------------------------------------
def _to_torch(value: Any, keep_low_precision: bool) -> Any:
    """nki-library's reference-input convention: bf16/fp8 -> fp32 torch (bf16 kept as bf16 when
    ``keep_low_precision``), fp16 -> fp32, uint32 -> int32; an array always comes back as a copy (the
    reference may write its inputs), a large one on disk."""
    import torch

    if not isinstance(value, np.ndarray):
        return value
    name = str(value.dtype)
    if value.dtype == np.uint32:
        return torch.from_numpy(_copy(value, np.int32))
    if "bfloat16" in name or "float8" in name:
        t = torch.from_numpy(_copy(value, np.float32))
        return t.to(torch.bfloat16) if keep_low_precision and "bfloat16" in name else t
    t = torch.from_numpy(_copy(value))
    return t.float() if t.dtype == torch.float16 else t


def _low_precision_dtype(inputs: dict[str, Any]) -> np.dtype | None:
    for v in inputs.values():
        if isinstance(v, np.ndarray) and any(s in str(v.dtype) for s in ("bfloat16", "float8", "float16")):
            return v.dtype
    return None


# Lines nki-library's reference code prints on every call that say nothing about the row (the start of each
# line): a golden computed in batch chunks (cases_transformer._golden_in_batch_chunks) printed them per chunk.
REFERENCE_NOTES = (
    # core/attention/attention_tkg_utils.py, resize_cache_block_len_for_attention_tkg_kernel, which the
    # attention_block_tkg reference calls to lay out a block KV cache as the kernel will: the resize itself
    # and its advice on the device's DMA bandwidth at blocks under 8 tokens (the row's layout is the test's)
    "Token-gen bucket length of ",
    "WARNING: Smaller block length (<8) results in lower DMA bandwidth utilization.",
    "WARNING: This also requires increasing full_sprior to at least ",
)


class _Without(io.TextIOBase):
    """A text stream passing whole lines on to ``out`` except those starting with one of ``prefixes``; any
    other output (a warning, an error message) still reaches ``out``, as each line is completed (a last
    partial line at close)."""

    def __init__(self, out: Any, prefixes: tuple[str, ...]) -> None:
        self.out, self.prefixes, self.pending = out, prefixes, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        self.out.write("".join(f"{line}\n" for line in lines if not line.startswith(self.prefixes)))
        return len(text)

    def flush(self) -> None:
        self.out.flush()

    def close(self) -> None:
        if self.pending and not self.pending.startswith(self.prefixes):
            self.out.write(self.pending)
        self.pending = ""
        super().close()


def reference_outputs(case: Case, inputs: dict[str, Any], root: Path | None = None) -> dict[str, np.ndarray]:
    """The torch reference's outputs (numpy), on copies of ``inputs`` (``root``: the checkout, for a
    reference defined in an nki-library test file)."""
    import torch

    ref_in = case.ref_inputs(inputs) if case.ref_inputs else inputs
    kwargs = {k: _to_torch(v, case.keep_low_precision) for k, v in ref_in.items()}  # (each a copy)
    with contextlib.closing(_Without(sys.stdout, REFERENCE_NOTES)) as out, contextlib.redirect_stdout(out):
        result = _resolve(case.reference, root)(**kwargs)
    if isinstance(result, torch.Tensor):
        result = {"out": result}
    elif isinstance(result, (list, tuple)):
        result = dict(zip(case.outputs, result))
    cast_to = _low_precision_dtype(ref_in) if case.keep_low_precision else None
    out = {}
    for k, v in result.items():
        if isinstance(v, torch.Tensor):
            v = v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
            if cast_to is not None:
                v = v.astype(cast_to)
        out[k] = _to_disk(np.asarray(v))  # (held while the kernel runs)
    return out


def _classify(exc: BaseException) -> tuple[str, str]:
    from trnkit.nkisim.errors import NkiValidationError

    msg = f"{exc}".splitlines()[0] if f"{exc}" else type(exc).__name__
    if isinstance(exc, NkiValidationError):
        return REJECTED, msg
    if isinstance(exc, NotImplementedError):
        return MISSING, msg
    if isinstance(exc, (AttributeError, ImportError)) and any(
            s in f"{exc} {getattr(exc, 'name', '')}" for s in ("nki", "neuronxcc")):
        return MISSING, f"{type(exc).__name__}: {msg}"
    return ERROR, f"{type(exc).__name__}: {msg}"


def run_case(case: Case, root: Path, commit: str = "") -> Row:
    """Run ``case`` on the interpreter and compare it with nki-library's reference; a row nki-library's test
    skips (``case.skipped_by``) runs too, and is SKIPPED with its verdict first in the message."""
    row = _run_case(case, root, commit)
    if case.rejected_by and case.rejected_by in row.message and case.note:  # the refusal the case names: why
        row.message = f"{row.message} ({case.note})"
    if case.skipped_by:
        row.verdict, row.result = row.result, SKIPPED
        row.message = f"run anyway: {row.verdict}" + f": {row.message}" * bool(row.message) + \
            f"; nki-library's test skips this row: {case.skipped_by}"
    return row


def row_ok(case: Case, row: Row) -> bool:
    """Whether ``row`` is what the conformance run accepts for ``case``: PASS (for a negative case: rejected as
    nki-library expects), XFAIL (a checked cause), GOLDEN_GAP (checked per row by :func:`golden_gap`), STALE_READ
    (checked per row by :func:`_stale_read`), or the refusal the case names (``Case.rejected_by``); a SKIPPED row
    is judged by its verdict."""
    result = row.verdict if row.result == SKIPPED else row.result
    if case.rejected_by:
        return result in (REJECTED, ERROR) and case.rejected_by in row.message
    return result in (PASS, STALE_READ) or (result == XFAIL and bool(case.xfail)) or \
        (result == GOLDEN_GAP and (case.rounded_reference is not None or case.tapped_reference is not None))


def _run_case(case: Case, root: Path, commit: str) -> Row:
    with nki_is_interpreter(root):  # (to the end: a mismatch's golden_gap runs the reference again, same modules)
        return _run_case_as_nki(case, root, commit)


# a row decided by _refused_on_zeros: its message starts with this
ZERO_INPUTS_NOTE = "refused on zero inputs of the row's shapes (Case.zero_inputs; its inputs and reference not built)"


def _refused_on_zeros(case: Case, root: Path, commit: str) -> Row | None:
    """The row of a case whose kernel, run on its ``zero_inputs``, refuses them with ``case.rejected_by`` (as
    :func:`row_ok` accepts: REJECTED or ERROR with that text): the kernel's own message and :data:`ZERO_INPUTS_NOTE`;
    the reference is not built. None when the kernel does anything else on them: the row then runs on its inputs.
    Every array goes to the kernel as a read-only view (no copy): a kernel that writes one before it refuses fails
    on that write instead, and the row runs in full."""
    row = Row(case.kernel, case.name, case.shapes, case.lnc, ERROR, rtol=case.rtol, atol=case.atol,
              nkilib_commit=commit)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            for module in REPAIRED_MODULES:
                _load_repaired(module)
            inputs = case_inputs(case, case.zero_inputs)
        kernel = _resolve(case.entry, root)
        if case.wrap_kernel is not None:
            kernel = case.wrap_kernel(kernel)
        views = [_copies([kw], [k for k, v in kw.items() if isinstance(v, np.ndarray)])[0]
                 for kw in (inputs["ranks"] if case.ranks else [inputs])]
        del inputs
        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings(record=True):
                _launch(case, kernel, views if case.ranks else views[0])
        finally:
            row.seconds = time.perf_counter() - t0
            if case.cleanup:
                _resolve(case.cleanup)()
    except Exception as exc:  # noqa: BLE001  (the refusal, or anything else: then the full row decides)
        result, message = _classify(exc)
        message = message.replace(f"{root / 'src'}{os.sep}", "")
        if result in (REJECTED, ERROR) and case.rejected_by in message:
            row.result, row.message = result, f"{ZERO_INPUTS_NOTE}: {message}"
            return row
    return None


def _run_case_as_nki(case: Case, root: Path, commit: str, placement: bool = True) -> Row:
    from trnkit.nkisim import memory
    from trnkit.nkisim.isa.vector import AccumulatorNotSetWarning

    if case.rejected_by and case.zero_inputs is not None and not case.negative:
        early = _refused_on_zeros(case, root, commit)
        if early is not None:
            return early
    row = Row(case.kernel, case.name, case.shapes, case.lnc, ERROR, rtol=case.rtol, atol=case.atol,
              nkilib_commit=commit)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # nki-library's config helpers print too
            for module in REPAIRED_MODULES:
                _load_repaired(module)
            inputs = {k: _to_disk(v) for k, v in case_inputs(case).items()}
        # the reference runs first: its float32 copies of the inputs are freed before the kernel's
        # copies exist (the large MoE cases hold several GB of weights); a kernel failure still
        # decides the row before a reference failure does
        expected, ref_error = None, None
        if not case.negative:
            try:
                expected = reference_outputs(case, inputs, root)
            except Exception as exc:  # noqa: BLE001
                ref_error = exc
        kernel = _resolve(case.entry, root)
        if case.wrap_kernel is not None:
            kernel = case.wrap_kernel(kernel)
        # (ranks may share an array: each its copy; an xfail check reads the inputs after the kernel)
        keep = case.postprocess is not None or case.ranks > 0 or case.xfail_check is not None \
            or case.rounded_reference is not None or case.tapped_reference is not None
        kernel_in = _copies(inputs["ranks"], case.read_only, keep) if case.ranks \
            else _copies([inputs], case.read_only, keep)[0]
        t0 = time.perf_counter()
        try:
            # nki-library's own [INFO] prints; SBUF beyond capacity in program order compiles with the
            # default allocator (spilled to the HBM scratchpad: _launch's capacity="sbuf_spills");
            # PSUM beyond it in program order may fit in the compiler's order (PsumReorderWarning)
            noted = (memory.SbufSpillWarning, memory.PsumReorderWarning, memory.PlacedTileOverwrittenWarning,
                     AccumulatorNotSetWarning)  # each shown every time, collected below for the row's message
            with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings(record=True) as caught:
                for category in noted:
                    warnings.simplefilter("always", category)
                with tap(case.tapped_reference.taps if case.tapped_reference else (), root) as tapped:
                    result = _launch(case, kernel, kernel_in, placement)
            del kernel_in  # (what the kernel returned stays referenced by result)
            spills, reorders, overwritten, unset = ([w.message for w in caught if issubclass(w.category, c)]
                                                    for c in noted)
        finally:
            row.seconds = time.perf_counter() - t0
            if case.cleanup:
                _resolve(case.cleanup)()
    except Exception as exc:  # noqa: BLE001  (every failure becomes a row)
        row.result, row.message = _classify(exc)
        row.message = row.message.replace(f"{root / 'src'}{os.sep}", "")  # checkout-relative paths
        if case.negative and isinstance(exc, AssertionError):  # kernel_assert / a hardware rule
            row.result, row.message = PASS, f"rejected as nki-library expects: {row.message}"
        return row
    if case.negative:
        row.result, row.message = ACCEPTED, "ran, but nki-library's test expects a rejection"
        return row
    if ref_error is not None:
        row.message = f"reference failed: {type(ref_error).__name__}: {ref_error}"
        return row
    results = list(result) if isinstance(result, (list, tuple)) else [result]
    if len(results) != len(case.outputs):
        row.message = f"kernel returned {len(results)} outputs, the reference {len(case.outputs)}"
        return row
    if case.postprocess is not None:
        actual = {n: np.asarray(r, dtype=expected[n].dtype) for n, r in zip(case.outputs, results)}
        actual, expected = case.postprocess(inputs, actual, expected)
    else:  # compare() widens to float64 itself: no whole-array copy of an output that widens exactly
        actual = {n: _as_compared(np.asarray(r), expected[n].dtype) for n, r in zip(case.outputs, results)}
    reshaped = _in_golden_shape(actual, expected)
    del results
    if case.xfail_check is None and case.rounded_reference is None and case.tapped_reference is None:
        del inputs
    ok_all, worst_ratio, shares, failing = True, -1.0, [], {}
    for name in case.outputs:
        judged = judge(case, name, actual[name], expected[name])
        ok, err, allowed = judged.ok, judged.err, judged.allowed
        row.outputs[name] = (err, allowed)
        shares += judged.notes
        if not ok:
            failing[name] = judged
        ok_all &= ok
        ratio = err / allowed if allowed > 0 else (0.0 if err == 0 else float("inf"))
        if not ratio <= worst_ratio:  # (NaN: worst)
            worst_ratio, row.max_abs_err, row.allowed_err = ratio, err, allowed
    row.result = PASS if ok_all else MISMATCH
    row.message = "; ".join(m for m in (case.note, *shares, reshaped, _reorder_note(reorders), _spill_note(spills),
                                          _unset_note(unset)) if m)
    if not ok_all:
        row.message = "; ".join([f"{n}: max|err| {e:.3g} > {a:.3g}" for n, (e, a) in row.outputs.items()
                                 if not e <= a] + shares + ([case.note] if case.note else []))
        cause = case.xfail_check(inputs, actual, expected) if case.xfail and case.xfail_check else ""
        if cause:  # the failure nki-library's xfail is about, checked: not a mismatch of the interpreter's
            row.verdict, row.result = MISMATCH, XFAIL
            row.message = f"xfail as nki-library marks it ({case.xfail}); checked: {cause}; {row.message}"
        elif overwritten:
            shown, why = _stale_read(case, root, commit, overwritten)
            if shown:
                row.verdict, row.result = MISMATCH, STALE_READ
            row.message = f"{why}; {row.message}"
        elif case.rounded_reference is not None or case.tapped_reference is not None:
            # a case with a tapped reference is GOLDEN_GAP only where the tapped check confirms it: the rounded
            # reference alone cannot tell a 3 % kernel error from the golden's gap where that gap is wide
            if case.tapped_reference is not None:
                try:
                    shown, why = tapped_golden_gap(case, root, inputs, actual, expected, failing, tapped)
                except Exception as exc:  # noqa: BLE001  (the row stays MISMATCH and says why it was not checked)
                    shown, why = False, f"the tapped check failed: {type(exc).__name__}: {exc}"
            else:
                shown, why = golden_gap(case, root, inputs, actual, expected, failing)
            if shown:  # the test's golden, not the kernel's arithmetic on the interpreter: checked per output
                row.verdict, row.result = MISMATCH, GOLDEN_GAP
                row.message = f"{why}; {row.message}"
            else:  # (the rounding the case names does not account for it: said, the row stays a mismatch)
                row.message = f"{row.message}; not GOLDEN_GAP: {why}"
    return row


def _stale_read(case: Case, root: Path, commit: str, overwritten: list[Warning]) -> tuple[bool, str]:
    """Whether a mismatch of a kernel that read overwritten placed tiles comes from those reads: the case run again
    with every placed tile on storage of its own (launched with ``placement=False``) passes; and what was found."""
    unplaced = _run_case_as_nki(case, root, commit, placement=False)
    reads = f"reads placed tiles another placed tile overwrote ({len(overwritten)} reads; first: {overwritten[0]})"
    if unplaced.result != PASS:
        return False, f"{reads}, but with every placed tile on storage of its own the row is {unplaced.result} too"
    return True, (f"the kernel's placement: it {reads}; with every placed tile on storage of its own it passes "
                  f"(max|err| {unplaced.max_abs_err:.3g} <= {unplaced.allowed_err:.3g}), and a device reads the "
                  "overwritten bytes as the interpreter does")


def _in_golden_shape(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> str:
    """Each output whose element count is its reference's but whose shape is not, viewed in the reference's shape
    (in place in ``actual``), as nki-library's validator reads every output back: ``np.fromfile(...)
    .reshape(golden_value.shape)`` ("Shape always comes from golden_value", test/utils/output_validator.py);
    a note naming them ("" when none). A different element count stays a mismatch."""
    notes = []
    for name, a in actual.items():
        e = expected.get(name)
        if e is not None and a.shape != e.shape and a.size == e.size:
            notes.append(f"{name} {tuple(a.shape)} compared in its reference's shape {tuple(e.shape)}")
            actual[name] = a.reshape(e.shape)
    return "; ".join(notes) + " (nki-library's validator reads outputs in the golden's shape)" * bool(notes)


@dataclass
class Judged:
    """One output against its reference under the test's validator (:func:`judge`)."""

    ok: bool
    err: float  # largest |actual - expected|
    allowed: float  # atol + rtol * max|expected|
    notes: list[str]  # the pass-rate and cosine lines of the row's message
    failed: tuple[str, ...]  # the criteria it fails: "tolerance" (or its pass rate), "cosine"


def judge(case: Case, name: str, actual: np.ndarray, expected: np.ndarray) -> Judged:
    """``actual`` against ``expected`` as the test's validator takes output ``name``: nki-library's tolerance
    (:func:`compare`), met by a share of the elements where the test has a pass rate (``Case.min_pass_rate``), and
    a least cosine similarity (``Case.min_cosine``)."""
    ok, err, allowed = compare(actual, expected, case.rtol, case.atol)
    pass_rates, notes, failed = dict(case.min_pass_rate), [], []
    if (not ok and name in pass_rates and np.isfinite(err)) or case.min_cosine:  # (not with non-finite misses)
        share, cosine = within_share(actual, expected, allowed)
        if not ok and name in pass_rates and np.isfinite(err) and share >= pass_rates[name]:
            ok = True
            notes.append(f"{name}: {1 - share:.3%} of its elements beyond the tolerance (the test allows "
                         f"{1 - pass_rates[name]:.0%})")
        if not ok:
            failed.append("tolerance")
        if cosine < case.min_cosine:
            ok = False
            failed.append("cosine")
            notes.append(f"{name}: cosine similarity {cosine:.4f} < {case.min_cosine}")
    elif not ok:
        failed.append("tolerance")
    return Judged(ok, err, allowed, notes, tuple(failed))


def _distance(case: Case, name: str, a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """How far ``a`` is from ``b`` in each of the validator's criteria: "tolerance" (the share of elements beyond it
    where the test has a pass rate for ``name``, else the largest difference) and "cosine" (1 - cosine similarity)."""
    _, err, allowed = compare(a, b, case.rtol, case.atol)
    share, cosine = within_share(a, b, allowed)
    return {"tolerance": 1 - share if name in dict(case.min_pass_rate) else err, "cosine": 1 - cosine}


def _measure(criterion: str, name: str, case: Case, value: float) -> str:
    if criterion == "cosine":
        return f"cosine {1 - value:.4f}"
    return f"{value:.3%} beyond the tolerance" if name in dict(case.min_pass_rate) else f"max|err| {value:.3g}"


def golden_gap(case: Case, root: Path, inputs: dict[str, Any], actual: dict[str, np.ndarray],
               expected: dict[str, np.ndarray], failing: dict[str, Judged]) -> tuple[bool, str]:
    """Whether a mismatch is shown to be nki-library's golden's, and why (or why not: the first output that does not
    show it). ``case.rounded_reference``'s reference (nki-library's, with its values rounded where the kernel's
    tiles hold a narrower dtype) is computed from the row's ``inputs``, and for every output in ``failing`` (the
    kernel's outputs the test's validator fails against the golden ``expected``) (1) that rounded reference fails
    the test's validator against the golden as well: no computation that rounds where the kernel's declared tiles
    must can be expected to meet the test, on a device either; and (2) the kernel meets the test's validator (its
    tolerance, pass rate and cosine) against the rounded reference: its own error is no larger than the test
    allows an implementation of that reference. (2) does not compare with the golden's distance from the rounded
    reference: where that gap is wide it would take a kernel error as large as the gap (a QKV tile 3 % off passed
    it on attention_block_tkg's qkv_cte row). Only for a case without a ``tapped_reference``: a case with one is
    GOLDEN_GAP only by :func:`tapped_golden_gap`."""
    what, rounded_inputs = case.rounded_reference
    # (inside the row's nki_is_interpreter: the inputs' enums are the same modules' as the reference's)
    rounded = reference_outputs(dataclasses.replace(case, ref_inputs=rounded_inputs), inputs, root)
    if case.postprocess is not None:  # (as the golden went through it)
        rounded = case.postprocess(inputs, actual, rounded)[1]
    parts = []
    for name, kernel in failing.items():
        ref_miss = _distance(case, name, rounded[name], expected[name])
        if judge(case, name, rounded[name], expected[name]).ok:  # the rounding alone meets the test
            return False, (f"{name}: the rounded reference's " + ", ".join(
                _measure(c, name, case, ref_miss[c]) for c in kernel.failed) + " against the golden meets the test")
        near, to_rounded = judge(case, name, actual[name], rounded[name]), _distance(case, name, actual[name],
                                                                                      rounded[name])
        if not near.ok:  # the kernel's own error is beyond what the test allows an implementation of the rounding
            return False, f"{name}: the kernel fails the test against the rounded reference (" + ", ".join(
                _measure(c, name, case, to_rounded[c]) for c in near.failed) + ")"
        parts.append(f"{name}: " + ", ".join(
            f"the rounded reference's {_measure(c, name, case, ref_miss[c])} against the golden fails the test too"
            for c in kernel.failed) + ", the kernel meets the test against the rounded reference (" + ", ".join(
            _measure(c, name, case, to_rounded[c]) for c in ("tolerance", "cosine")) + ")")
    return bool(parts), f"nki-library's golden is out of reach of {what}: " + "; ".join(parts)


@dataclass(frozen=True)
class Operand:
    """One instruction operand recorded by :func:`tap` (an ``"module:global.instruction(operand)"`` spec): its value
    (a copy, as the instruction read it) and where it lies in its allocation: ``storage`` (a key unique in the
    process per allocation), ``offset`` / ``strides`` (elements of its dtype; element ``i`` at ``offset + sum(strides
    * i)``) and ``row`` (the allocation's elements per partition), so ``divmod(flat, row)`` is (partition, column);
    ``buffer``: the allocation's memory (``"sbuf"``, ``"psum"``, ``"hbm"``, ...). A ``"(operand:where)"`` spec records
    where it lies only: ``value`` is then zeros of its shape and dtype (a read-only view of one element)."""

    value: np.ndarray
    storage: int
    offset: int
    strides: tuple[int, ...]
    row: int
    buffer: str = ""

    def columns(self) -> np.ndarray:
        """Each element's (partition, column) in its allocation: an int array ``value.shape + (2,)``."""
        flat = self.offset + sum(np.arange(n).reshape((-1,) + (1,) * (len(self.strides) - 1 - k)) * s
                                 for k, (n, s) in enumerate(zip(self.value.shape, self.strides)))
        return np.stack(np.divmod(np.broadcast_to(flat, self.value.shape), self.row), axis=-1)


_OPERAND_SPEC = re.compile(r"^(?P<glob>\w+)\.(?P<fn>\w+)\((?P<operand>\w+)(?P<where>:where)?\)$")


@contextlib.contextmanager
def tap(specs: Sequence[str], root: Path | None = None) -> Iterator[dict[str, list[tuple[int, int, Any]]]]:
    """Inside the block every call of each ``"module:function"`` in ``specs`` (a kernel-side function, resolved
    in the checkout) has the tile it returns recorded: ``{spec: [(rank, program, value), ...]}`` in call order,
    ``value`` a copy read with ``NkiTensor.peek``, a tuple of them for a function returning a tuple of tiles (no
    access recorded: results, checks and costs are those of a run without taps); a ``TensorView``-like result
    (``get_view()``) is read through its view. The function returns what it returned.

    ``"module:global.instruction(operand)"`` (e.g. ``"pkg.kernel:nisa.nc_matmul(stationary)"``) records an
    instruction's operand instead, for a tile the kernel never returns: the module's global (the ``nisa`` it
    imported) is, inside the block and for that module only, a stand-in whose ``instruction`` records the argument
    ``operand`` of each call as an :class:`Operand` (read before the instruction runs, as it reads it), then runs
    it; every other name is the global's own. The argument is found by binding the call to the instruction's
    signature, so a positional one (``nisa.tensor_tensor(out, out, psum, op=nl.add)``'s ``data2``) is recorded as
    its keyword form is (a call that does not bind is run as it is: the instruction raises its own error).
    ``"module:global.instruction(operand:where)"`` records where the operand lies only (no copy of its value: e.g.
    each matmul's PSUM destination). No specs (the default): nothing is wrapped."""
    from trnkit.nkisim import memory

    def where() -> tuple[int, int]:
        ctx = memory.current()
        return (ctx.launch.rank.rank if ctx.launch is not None and ctx.launch.rank is not None else 0,
                ctx.flat_program_id)

    recorded: dict[str, list[tuple[int, int, Any]]] = {spec: [] for spec in specs}
    saved = []
    for spec in specs:
        module_name, _, attr = spec.partition(":")
        module = importlib.import_module(module_name)
        operand = _OPERAND_SPEC.match(attr)
        if operand is not None:
            glob, fn_name, arg = operand.group("glob", "fn", "operand")
            real = getattr(module, glob)
            fn = getattr(real, fn_name)
            try:
                signature: inspect.Signature | None = inspect.signature(fn)
            except (TypeError, ValueError):  # (no signature to bind: the keyword form only)
                signature = None

            def instruction(*a: Any, _fn: Callable[..., Any] = fn, _spec: str = spec, _arg: str = arg,
                            _sig: inspect.Signature | None = signature, _where: bool = bool(operand.group("where")),
                            **k: Any) -> Any:
                t = k.get(_arg)
                if t is None and _sig is not None:
                    try:
                        t = _sig.bind(*a, **k).arguments.get(_arg)
                    except TypeError:  # (the instruction raises its own error for a call that does not bind)
                        t = None
                if t is not None and hasattr(t, "storage"):
                    value = np.broadcast_to(np.zeros((), t.dtype), t.shape) if _where else t.peek()
                    recorded[_spec].append((*where(), Operand(value, t.storage.key, t.offset, tuple(t.strides),
                                                              t.partition_stride, t.buffer.name)))
                return _fn(*a, **k)

            instruction.__wrapped__ = fn  # (its signature: a second tap of the same instruction binds through it)
            stand_in = types.SimpleNamespace(**{n: getattr(real, n) for n in dir(real) if not n.startswith("__")})
            setattr(stand_in, fn_name, instruction)
            saved.append((module, glob, real))
            setattr(module, glob, stand_in)
            continue
        fn = getattr(module, attr)

        def wrapped(*a: Any, _fn: Callable[..., Any] = fn, _spec: str = spec, **k: Any) -> Any:
            out = _fn(*a, **k)
            value = tuple(_peek(t) for t in out) if isinstance(out, (tuple, list)) else _peek(out)
            recorded[_spec].append((*where(), value))
            return out

        saved.append((module, attr, fn))
        setattr(module, attr, wrapped)
    try:
        yield recorded
    finally:
        for module, attr, fn in reversed(saved):
            setattr(module, attr, fn)


def _peek(tile: Any) -> np.ndarray | None:
    """A tapped tile's value (a ``TensorView``-like one through its ``get_view()``; None stays None)."""
    if tile is None:
        return None
    return (tile.get_view() if hasattr(tile, "get_view") else tile).peek()


BF16_UNIT = 2.0 ** -8  # bf16's unit roundoff: 8 significant bits, a round to nearest is off by at most 2^-8 relative


def within_roundings(tapped: np.ndarray, exact: np.ndarray, roundings: float, fp8: bool = False,
                     magnitude: np.ndarray | None = None) -> tuple[bool, float, str]:
    """Whether ``tapped`` (a bf16 tile, last axis its features, rows its tokens) is ``exact`` (float64) after at
    most ``roundings`` bf16 roundings per element, and the measured figures.

    The bound: a value built by adding ``n`` partial sums into a bf16 tile one by one (fp32 add, round to nearest
    even) is ``s_k = (s_{k-1} + p_k)(1 + d_k)`` with ``|d_k| <= u = 2^-8``, so its error is at most
    ``u * sum_k |s_k|`` to first order. The running sums are not recorded; taking each ``|s_k|`` at most the largest
    ``|exact|`` of its row, the element is within ``roundings * u * max_row|exact|`` (1). A running sum larger than
    that only makes the check fail: the bound never puts a row on the golden that a wider one would not. And, as
    the roundings of independent partial sums add as a random walk, the root mean square of the error is within
    ``sqrt(roundings)`` times that of one bf16 rounding of ``exact`` (2). Both must hold.

    ``fp8``: ``tapped`` is an fp8 (e4m3) tile quantized (clipped to +-240, rounded to nearest) from such a value
    ``y``, ``|y - exact| <= e = roundings * u * max_row|exact|`` as in (1): clipping moves no two values further
    apart and a round to nearest moves ``y`` by at most half an fp8 step at ``|y|``, so each element is within
    ``e + step(|exact| + e) / 2`` of ``exact`` (``step(v)``: e4m3's spacing at ``v``, 3 mantissa bits, subnormal
    below 2^-6); the share that is not ``exact``'s nearest fp8 value is reported.

    ``roundings`` may have a fraction: float32 roundings on the way, each ``2^-24`` relative, count ``2^-16`` of a
    bf16 one.

    ``magnitude`` (``exact``'s shape, >= 0): per element, a bound of the values its roundings act on where they can
    be larger than ``exact``'s row (e.g. a RoPE output ``x_r cos - x_i sin``: its products round at ``|x_r cos|``
    and ``|x_i sin|``, before a scale and the clip to +-240): the element's ``e`` is then ``roundings * u *
    max(max_row|exact|, magnitude)``, never less than without it. On a bf16 tile a ``magnitude`` says the caller
    derived that every rounding acts on a value within it (zeros: within the row's largest value), so (1) is a
    derived bound and is the whole check: the rms expectation (2), a statistical test, is not applied.

    Returns ``(ok, worst, figures)``: ``worst`` the largest error as a share of its element's bound."""
    t, x = np.asarray(tapped, np.float64), np.asarray(exact, np.float64)
    if t.shape != x.shape or not np.all(np.isfinite(t)):
        return False, float("inf"), f"shape {t.shape} vs {x.shape}" if t.shape != x.shape else "non-finite values"
    err = np.abs(t - x)
    if fp8:
        import ml_dtypes

        x = np.clip(x, -240, 240)  # (fp8's range, as the kernel clips: the bound holds for the clipped value)
        err = np.abs(t - x)
        nearest = x.astype(np.float32).astype(ml_dtypes.float8_e4m3).astype(np.float64)
        row_max = np.abs(x).reshape(-1, x.shape[-1]).max(axis=1).reshape(x.shape[:-1] + (1,))
        if magnitude is not None:
            row_max = np.maximum(row_max, np.asarray(magnitude, np.float64))
        e = roundings * BF16_UNIT * row_max
        step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(x) + e, 2.0 ** -6))) - 3)  # e4m3: 3 mantissa bits
        bound = e + step / 2
        worst = float(np.max(err / bound)) if err.size else 0.0
        at_what = "" if magnitude is None else " at the products' magnitude"
        return worst <= 1.0, worst, (f"fp8: {np.mean(t != nearest):.2%} not the nearest fp8 value, max|err| "
                                     f"{worst:.2f} of the bound ({roundings:g} bf16 roundings{at_what} and half an "
                                     "fp8 step)")
    row_max = np.abs(x).reshape(-1, x.shape[-1]).max(axis=1).reshape(x.shape[:-1] + (1,))
    if magnitude is not None:  # (a derived bound: (1) alone)
        bound = roundings * BF16_UNIT * np.maximum(row_max, np.asarray(magnitude, np.float64))
        share = np.divide(err, bound, out=np.where(err > 0, np.inf, 0.0), where=bound > 0)
        worst = float(share.max()) if share.size else 0.0
        at_what = " at the products' magnitude" if np.any(np.asarray(magnitude) > 0) else ""
        return worst <= 1.0, worst, (f"max|err| {worst:.2f} of the {roundings:g}-rounding bound{at_what} (derived: "
                                     "no rms test)")
    bound = roundings * BF16_UNIT * row_max
    worst = float(np.max(err / np.where(bound > 0, bound, np.inf))) if err.size else 0.0
    one = np.sqrt(np.mean((cast_bf16(x) - x) ** 2))
    rms = float(np.sqrt(np.mean(err ** 2)))
    ratio = rms / one if one > 0 else (0.0 if rms == 0 else float("inf"))
    ok = bool(np.all(err <= bound)) and ratio <= np.sqrt(roundings)
    return ok, worst, (f"max|err| {worst:.2f} of the {roundings:g}-rounding bound, rms {ratio:.2f} x one bf16 "
                       f"rounding's (<= sqrt({roundings:g}) = {np.sqrt(roundings):.2f})")


FP32_UNIT = 2.0 ** -24  # float32's unit roundoff (24 significant bits, round to nearest)


@dataclass(frozen=True)
class TileCheck:
    """A tapped tile its projection judged itself (:func:`rounded_exactly`, :func:`within_accumulation`), for
    :func:`tapped_golden_gap`: whether it holds, ``worst`` (its largest error as a share of its bound; 0 for an exact
    match) and the figures."""

    label: str
    ok: bool
    worst: float
    figures: str


def rounded_exactly(tapped: np.ndarray, expected: np.ndarray, what: str) -> tuple[bool, float, str]:
    """Whether ``tapped`` is ``expected`` (the same values rounded where and as the kernel rounds them, ``what``
    says how) element for element, exactly; an exact check, with no tolerance: ``(ok, worst, figures)``, ``worst``
    0 when every value is equal, else infinite."""
    t, x = np.asarray(tapped, np.float64), np.asarray(expected, np.float64)
    if t.shape != x.shape:
        return False, float("inf"), f"shape {t.shape} vs {x.shape}"
    differ = ~(t == x)  # (a NaN on either side differs)
    n = int(differ.sum())
    if n == 0:
        return True, 0.0, f"all {t.size} values exactly {what}"
    first = tuple(int(k) for k in np.unravel_index(int(np.argmax(differ)), t.shape))
    return False, float("inf"), (f"{n} of {t.size} values not {what} (the first at {first}: {t[first]!r} for "
                                 f"{x[first]!r})")


def within_accumulation(tapped: np.ndarray, exact: np.ndarray, abs_sum: np.ndarray, depth: int
                        ) -> tuple[bool, float, str]:
    """Whether ``tapped`` (float32 sums of exact terms, e.g. a matmul's fp8 products accumulated in PSUM) is within
    the float32 accumulation bound of ``exact`` (their exact value, float64), each term going through at most
    ``depth`` float32 additions: a sum in which term ``i`` goes through ``t_i`` roundings (round to nearest, unit
    ``u = 2^-24``) is ``sum_i x_i (1 + theta_i)`` with ``|theta_i| <= gamma_{t_i} = t_i u / (1 - t_i u)``, in any
    order of the additions (Higham, Accuracy and Stability of Numerical Algorithms, Lemma 3.1 and section 4.1), so
    ``|tapped - exact| <= gamma_depth * sum_i |x_i|`` (``abs_sum``, per element): a bound, not an expectation.
    ``(ok, worst, figures)``: ``worst`` the largest error as a share of its element's bound."""
    t, x, a = (np.asarray(v, np.float64) for v in (tapped, exact, abs_sum))
    if t.shape != x.shape or not np.all(np.isfinite(t)):
        return False, float("inf"), f"shape {t.shape} vs {x.shape}" if t.shape != x.shape else "non-finite values"
    gamma = depth * FP32_UNIT / (1 - depth * FP32_UNIT)
    err, bound = np.abs(t - x), gamma * a
    share = np.divide(err, bound, out=np.where(err > 0, np.inf, 0.0), where=bound > 0)
    worst = float(share.max()) if share.size else 0.0
    return worst <= 1.0, worst, (f"max|err| {worst:.2g} of the float32 accumulation bound (gamma_{depth} = "
                                 f"{gamma:.3g} x the sum of |terms|)")


def cast_bf16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to bf16 (to nearest even, as the interpreter casts), back in float64."""
    import ml_dtypes

    from trnkit.nkisim.dtypes import cast

    return cast(np.asarray(x, np.float64), np.dtype(ml_dtypes.bfloat16)).astype(np.float64)


def tapped_golden_gap(case: Case, root: Path, inputs: dict[str, Any], actual: dict[str, np.ndarray],
                      expected: dict[str, np.ndarray], failing: dict[str, Judged],
                      tapped: dict[str, list[tuple[int, int, Any]]]) -> tuple[bool, str]:
    """Whether a mismatch is shown to be nki-library's golden's on the kernel's own tiles, and why (or why not: the
    first condition that fails) (``case.tapped_reference``, the tiles recorded during the row's run by
    :func:`tap`). All three must hold: (a) every tapped tile is its computation from the kernel's own tapped
    inputs (float64, or the float32 reference) within its stated
    number of bf16 roundings (:func:`within_roundings`): the kernel's arithmetic up to that tile is right;
    (b) nki-library's reference fed those tiles (with the case's other roundings) reproduces every output the
    kernel fails: the test's validator passes the kernel against it and their cosine similarity is at least
    ``min_cosine``: the rest of the kernel is right given those tiles; (c) on each such output the golden fails
    the test's validator against that reference too: the golden is out of reach of the kernel's legitimate
    roundings up to the tapped tiles, not the kernel out of reach of the golden."""
    spec = case.tapped_reference
    routed = {t for group in spec.routes for t in group} | set(spec.optional)
    if not tapped or any(not calls for t, calls in tapped.items() if t not in routed):
        return False, "tapped: no tile recorded for " + ", ".join(k for k, v in tapped.items()
                                                                    if not v and k not in routed)
    for group in spec.routes:
        taken = [t for t in group if tapped.get(t)]
        if len(taken) != 1:
            return False, (f"tapped: {len(taken)} of the alternative taps " + ", ".join(group)
                           + " recorded a tile (exactly one must)")
    def run(fn: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, np.ndarray]:
        return reference_outputs(dataclasses.replace(
            case, ref_inputs=lambda kw: fn(case.ref_inputs(kw) if case.ref_inputs else kw)), inputs, root)

    stages: dict[str, list[tuple[float, str, str]]] = {}  # per stage (a label's last word): its tiles' figures
    for item in spec.projection(inputs, tapped, run):
        if isinstance(item, TileCheck):  # (judged by the projection itself: an exact check or a derived bound)
            label, ok, worst, figures = item.label, item.ok, item.worst, item.figures
        else:
            label, got, exact, roundings, fp8, *magnitude = item
            ok, worst, figures = within_roundings(got, exact, roundings, fp8, *magnitude)
        if not ok:  # (a): the kernel's tile is not its computation from its own inputs
            return False, f"tapped {label}: {figures}, beyond its bound"
        stages.setdefault(label.split()[-1], []).append((worst, label, figures))
    parts = [f"{stage}: {len(tiles)} tile(s) within their bound, the nearest to it {max(tiles)[1]} {max(tiles)[2]}"
             for stage, tiles in stages.items()]
    with spec.during(root, tapped) if spec.during is not None else contextlib.nullcontext():
        fed = run(lambda kw: spec.ref_inputs(kw, tapped))
    if case.postprocess is not None:
        fed = case.postprocess(inputs, actual, fed)[1]
    for name in failing:
        kernel = judge(case, name, actual[name], fed[name])
        cosine = within_share(actual[name], fed[name], 0.0)[1]
        if not kernel.ok or not cosine >= spec.min_cosine:  # (b): the rest of the kernel is not the reference's
            return False, (f"{name}: the kernel is at cosine {cosine:.5f} from the reference fed the tapped tiles"
                           + (f" (< {spec.min_cosine})" if kernel.ok else f", max|err| {kernel.err:.3g} > "
                              f"{kernel.allowed:.3g}"))
        gold = judge(case, name, expected[name], fed[name])
        if gold.ok:  # (c): the golden meets the test against it: the kernel's miss is its own
            return False, f"{name}: the golden meets the test against the reference fed the tapped tiles"
        miss = _distance(case, name, expected[name], fed[name])
        parts.append(f"{name}: the kernel is at cosine {cosine:.5f} (>= {spec.min_cosine}) from the reference fed "
                     f"them, the golden fails the test against it ("
                     + ", ".join(_measure(c, name, case, miss[c]) for c in gold.failed) + ")")
    return True, f"nki-library's golden is out of reach of the kernel's own {spec.what}: " + "; ".join(parts)


def first_output(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``kernel`` returning only its first output, for tests that check that one alone (a
    ``Case.wrap_kernel``). A ``@nki.jit`` kernel's body is called, so it runs in the launch's own
    programs (calling the jit kernel would start a launch of its own, without the grid)."""
    from trnkit.nkisim.jit import Kernel

    body = kernel.fn if isinstance(kernel, Kernel) else kernel

    def wrapper(**kw: Any) -> Any:
        result = body(**kw)
        return result[0] if isinstance(result, (list, tuple)) else result
    return wrapper


def _copies(kwargs_list: list[dict[str, Any]], read_only: Sequence[str] = (), keep_inputs: bool = True
            ) -> list[dict[str, Any]]:
    """Each array argument copied (the kernel may write it in place), but those named in ``read_only``:
    read-only views of the arrays themselves, so a kernel that writes one fails. A file-backed one (this
    row's, made by its inputs() or moved to disk by the run) is handed over as it is unless ``keep_inputs``
    (a postprocess reads the inputs after the kernel): the reference has had its own copies already."""
    def arg(k: str, v: Any) -> Any:
        if not isinstance(v, np.ndarray):
            return v
        if k in read_only:
            view = v.view()
            view.flags.writeable = False
            return view
        return v if not keep_inputs and _file_backed(v) else _copy(v)
    return [{k: arg(k, v) for k, v in kw.items()} for kw in kwargs_list]


def _as_compared(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``a`` as :func:`compare` should see it against a reference of ``dtype``: unchanged when ``a``'s
    dtype converts to ``dtype`` exactly (compare's float64 differences are then the same), else cast."""
    return a if np.can_cast(a.dtype, dtype, "safe") else np.asarray(a, dtype=dtype)


def _launch(case: Case, kernel: Callable[..., Any], kernel_in: Any, placement: bool = True) -> Any:
    """Run the kernel as the case says: one device (a ``kernel[lnc]`` grid launch) or ``case.ranks``
    devices, whose results come back stacked per output (rank-major). SBUF beyond capacity in program order
    is spilled, as neuronx-cc's default allocator compiles AWS's kernels (``capacity="sbuf_spills"``);
    ``placement=False``: every placed tile on storage of its own (:func:`_stale_read`)."""
    from trnkit import nkisim
    from trnkit.nkisim import collectives

    kernel = nkisim.simulate(kernel, capacity="sbuf_spills", placement=placement)
    if not case.ranks:
        return kernel[case.lnc](**kernel_in)
    per_rank = collectives.run_ranks(kernel, case.ranks, lambda r: kernel_in[r], grid=case.lnc)
    per_rank = [list(r) if isinstance(r, (list, tuple)) else [r] for r in per_rank]
    return [np.stack([np.asarray(r[i]) for r in per_rank]) for i in range(len(per_rank[0]))]


def _spill_note(spills: list) -> str:
    """One line for the SBUF spills of a case's programs (the largest); "" without any."""
    if not spills:
        return ""
    worst = max(spills, key=lambda w: w.excess)
    return f"{len(spills)} program(s) exceed SBUF in program order: {worst}"


def _unset_note(unset: list[Warning]) -> str:
    """One line for the reads of accumulation registers nothing in the kernel instance had set (a device's
    registers hold what the core left there: ``AccumulatorNotSetWarning``); "" without any."""
    return f"{len(unset)} read(s) of accumulation registers nothing had set; first: {unset[0]}" if unset else ""


def _reorder_note(reorders: list) -> str:
    """One line for the programs whose PSUM fits only reordered (the most banks); "" without any."""
    if not reorders:
        return ""
    worst = max(reorders, key=lambda w: w.program_order)
    return (f"{len(reorders)} program(s) exceed PSUM in program order ({worst.program_order} banks) and fit in "
            f"{worst.reordered} with each PSUM read moved up to its dependences")


def run_cases(cases: Sequence[Case], root: Path, echo: Callable[[Row], None] | None = None) -> list[Row]:
    """Run every case (in order), calling ``echo(row)`` as each finishes."""
    commit = nkilib_commit(root)
    rows = []
    for case in cases:
        row = run_case(case, root, commit)
        rows.append(row)
        if echo is not None:
            echo(row)
    return rows


# -- reporting -----------------------------------------------------------------------------------
def format_row(row: Row) -> str:
    err = "" if row.max_abs_err is None else f"{row.max_abs_err:.2g} <= {row.allowed_err:.2g}"
    if MISMATCH in (row.result, row.verdict) and row.max_abs_err is not None:
        err = f"{row.max_abs_err:.2g} > {row.allowed_err:.2g}"
    secs = "" if row.seconds is None else f"{row.seconds:6.1f}s"
    line = f"{row.result:<11} {row.kernel:<28} {row.case:<34} lnc{row.lnc} {row.shapes:<34} {err:<20} {secs}"
    return line + (f"  {row.message}" if row.message and row.result != MISMATCH else "")


def format_table(rows: Sequence[Row]) -> str:
    counts = {r: sum(1 for x in rows if x.result == r)
              for r in (PASS, XFAIL, GOLDEN_GAP, STALE_READ, SKIPPED, MISMATCH, MISSING, REJECTED, ERROR, ACCEPTED)}
    summary = ", ".join(f"{n} {r}" for r, n in counts.items() if n)
    return "\n".join([format_row(r) for r in rows] + [f"{len(rows)} cases: {summary}"])


def _row_key(r: dict[str, Any]) -> tuple[str, str, str, str]:
    return (r["kernel"], r["case"], str(r["lnc"]), r["shapes"])


def write_csv(rows: Sequence[Row], path: str | os.PathLike, merge_order: Sequence[Case] | None = None) -> None:
    """Write ``rows`` as CSV. ``merge_order``: keep the file's rows of the other cases listed there
    (a filtered run updates its own rows only) and write every row in that order."""
    import fcntl

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    out = {_row_key(d): d for d in (r.csv_row() for r in rows)}
    # a merge reads and rewrites the file: one process at a time (runs that save row by row may overlap)
    with open(p.with_name(p.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if merge_order is not None:
            old = {}
            if p.is_file():
                with p.open(newline="") as f:
                    old = {_row_key(d): d for d in csv.DictReader(f)}
            keys = [(c.kernel, c.name, str(c.lnc), c.shapes) for c in merge_order]
            out = {k: out.get(k, old.get(k)) for k in keys if k in out or k in old}
        tmp = p.with_name(p.name + ".tmp")
        with tmp.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_FIELDS, lineterminator="\n")
            w.writeheader()
            for d in out.values():
                w.writerow(d)
        tmp.replace(p)

"""What a cost-model figure was computed with, and whether the tree would still compute it.

Every row a figure job writes (``python -m trnkit.bench figures``: ``benchmarks/data/*`` and the calibration
CSVs) carries three fields, from :func:`stamp`:

* ``cost_model``: a 10-hex hash of the cost model's behaviour-defining sources, :data:`COST_MODEL_FILES`:
  the model itself (``trnkit/nkisim/cost.py``, ``cost_params.py`` with every parameter value,
  ``hardware.py``) and the trace it reads (``trnkit/nkisim/trace.py``, the record format, and every
  ``trnkit/nkisim/isa/*.py``, where each instruction decides what it records: operands, boxes, FLOPs);
* ``sources``: ``name@hash`` entries, ``;``-separated, for what else the figure ran: a trnkit kernel family
  (``trnkit/kernels/<family>``: the folder's modules and every ``trnkit.kernels`` module they import,
  transitively, :func:`source_hash`), any other module by its path (``trnkit/demo.py``,
  ``benchmarks/calibration/matmul_kernels.py``), and ``nki-library@<commit>`` for nki-library's kernels;
* ``computed``: when (UTC) and in which tree (``YYYY-MM-DD HH:MM <commit>``, ``+`` when its Python files differed
  from that commit; the commit of the checkout that ran, which may be a branch's).

Hashes are over each module's tokens without comments and without string statements (docstrings), so an
edit to a comment or docstring, a doc page or a test moves nothing; any code or value change moves the hash,
including one that happens not to change a figure (an interpreter check in ``isa/``): a stale verdict means
"computed with other code", and re-running such a job gives the same numbers. Not in the hash: the rest of
the interpreter (values, errors, control flow) and each job's own script (its cases and bounds): a change to
those re-runs the job by hand.

:func:`row_verdict` compares a row's fields with the tree; :func:`job_status` does so for every row of a
figure job (``python -m trnkit.bench figures --stale``).
"""

from __future__ import annotations

import ast
import hashlib
import io
import subprocess
import time
import tokenize
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("cost_model", "sources", "computed")
NKILIB = "nki-library"
# the cost model's behaviour-defining sources, relative to the repository root (isa/*.py added by glob)
COST_MODEL_FILES = ("trnkit/nkisim/cost.py", "trnkit/nkisim/cost_params.py", "trnkit/nkisim/hardware.py",
                    "trnkit/nkisim/trace.py")
COST_MODEL_GLOBS = ("trnkit/nkisim/isa/*.py",)
FOLLOW = "trnkit.kernels"  # imports followed from a source into other modules (transitively)
HASH_LEN = 10


def normalized(text: str) -> str:
    """``text`` (Python source) as its tokens, one space apart, without comments, blank lines or string
    statements (docstrings); f-strings kept whole as written (the same on every Python version)."""
    lines = text.splitlines(keepends=True)
    starts = [0]
    for ln in lines:
        starts.append(starts[-1] + len(ln))

    def offset(pos: tuple[int, int]) -> int:
        return starts[pos[0] - 1] + pos[1]

    toks: list[tuple[str, str]] = []  # (kind, text)
    fstart = None
    depth = 0
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        name = tokenize.tok_name[tok.type]
        if name == "FSTRING_START":  # Python >= 3.12: an f-string is several tokens; keep its source text
            if depth == 0:
                fstart = tok.start
            depth += 1
            continue
        if depth:
            if name == "FSTRING_END":
                depth -= 1
                if depth == 0:
                    toks.append(("STRING", text[offset(fstart):offset(tok.end)]))
            continue
        if name in ("COMMENT", "NL", "ENCODING", "ENDMARKER"):
            continue
        toks.append((name, tok.string))
    out: list[str] = []
    i = 0
    while i < len(toks):
        kind, s = toks[i]
        stmt_start = not out or toks[i - 1][0] in ("NEWLINE", "INDENT", "DEDENT")
        if kind == "STRING" and stmt_start:  # a statement of string literals alone: a docstring
            j = i
            while j < len(toks) and toks[j][0] == "STRING":
                j += 1
            if j == len(toks) or toks[j][0] == "NEWLINE":
                i = j + 1
                continue
        out.append({"NEWLINE": "\n", "INDENT": "<indent>", "DEDENT": "<dedent>"}.get(kind, s))
        i += 1
    return " ".join(out)


def _digest(files: Iterable[Path], root: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(set(files)):
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        h.update(normalized(f.read_text()).encode() + b"\0")
    return h.hexdigest()[:HASH_LEN]


def cost_model_files(root: Path = ROOT) -> list[Path]:
    files = [root / f for f in COST_MODEL_FILES]
    for g in COST_MODEL_GLOBS:
        files += sorted(root.glob(g))
    return files


@cache
def cost_model_hash(root: Path = ROOT) -> str:
    """The hash of :data:`COST_MODEL_FILES` (and the ``isa`` modules) in the tree at ``root``."""
    return _digest(cost_model_files(root), root)


def _module_file(module: str, root: Path) -> Path | None:
    base = root.joinpath(*module.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


def _imports(f: Path, root: Path) -> set[str]:
    """The modules ``f`` imports (``from pkg import name`` also names ``pkg.name``, a submodule if one exists)."""
    rel = f.relative_to(root).with_suffix("")
    package = rel.parts[:-1]  # a module's package, or an __init__'s own
    mods: set[str] = set()
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = package[:len(package) - node.level + 1]
                mod = ".".join([*up, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            mods.add(mod)
            mods.update(f"{mod}.{a.name}" for a in node.names)
    return mods


def closure(files: Iterable[Path], root: Path = ROOT, follow: str = FOLLOW) -> list[Path]:
    """``files`` and every module under ``follow`` they import, transitively, with the packages' ``__init__``
    files that importing them runs."""
    seen: set[Path] = set()
    todo = list(files)
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for mod in _imports(f, root):
            if mod != follow and not mod.startswith(follow + "."):
                continue
            parts = mod.split(".")
            for k in range(len(follow.split(".")), len(parts) + 1):  # the module and its packages under follow
                m = _module_file(".".join(parts[:k]), root)
                if m is not None and m not in seen:
                    todo.append(m)
    return sorted(seen)


def _source_files(name: str, root: Path) -> list[Path]:
    p = root / name
    if p.is_dir():
        start = sorted(p.glob("*.py"))
    elif p.is_file():
        start = [p]
    else:
        raise FileNotFoundError(f"fingerprint: source {name!r} is neither a folder nor a file under {root}")
    return closure(start, root)


@cache
def source_hash(name: str, root: Path = ROOT) -> str:
    """The hash of the source ``name`` (a folder such as ``trnkit/kernels/moe`` or a module path) in the tree
    at ``root``: its modules and every ``trnkit.kernels`` module they import, transitively."""
    return _digest(_source_files(name, root), root)


def family(kernel_module: str) -> str:
    """The source name of a Python module: ``trnkit.kernels.moe.moe_fused`` -> ``trnkit/kernels/moe`` (a kernel
    family is its folder), any other module its file (``trnkit.demo`` -> ``trnkit/demo.py``)."""
    parts = kernel_module.split(".")
    if parts[:2] == ["trnkit", "kernels"] and len(parts) >= 3:
        return "/".join(parts[:3])
    f = _module_file(kernel_module, ROOT)
    if f is None:
        raise ValueError(f"fingerprint: module {kernel_module!r} has no source file under {ROOT}")
    return f.relative_to(ROOT).as_posix()


def _commit(root: Path) -> str:
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                              text=True, timeout=20, check=True).stdout.strip()
        # changed Python sources only (a figure job itself rewrites data files and docs)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--",
                                "*.py"], capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+" if dirty else "")


@cache
def _commit_cached(root: Path) -> str:
    return _commit(root)


def stamp(sources: Sequence[str] = (), nkilib: str | None = None, root: Path = ROOT) -> dict[str, str]:
    """The fingerprint fields of a row computed now from ``sources`` (source names, :func:`source_hash`) and,
    when nki-library's kernels ran, ``nkilib`` (its commit)."""
    entries = [f"{s}@{source_hash(s, root)}" for s in sorted(set(sources))]
    if nkilib is not None:
        entries.append(f"{NKILIB}@{nkilib}")
    return {"cost_model": cost_model_hash(root), "sources": ";".join(entries),
            "computed": f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} {_commit_cached(root)}"}


def parse_sources(text: str) -> dict[str, str]:
    return dict(e.rsplit("@", 1) for e in text.split(";") if e) if text else {}


def row_verdict(row: Mapping[str, str], root: Path = ROOT, nkilib: str | None = None) -> str:
    """``"current"`` when ``row``'s fingerprint fields equal the tree's, else why not: ``"none"`` (the row has no
    fingerprint), ``"cost model <old>"``, ``"<source> <old>"`` (a kernel's source or nki-library's commit
    differs; ``nkilib`` None: nki-library's commit is not compared)."""
    cm = row.get("cost_model") or ""
    if not cm:
        return "none"
    if cm != cost_model_hash(root):
        return f"cost model {cm}"
    for name, h in parse_sources(row.get("sources") or "").items():
        if name == NKILIB:
            if nkilib is not None and h != nkilib:
                return f"{NKILIB} {h}"
            continue
        try:
            now = source_hash(name, root)
        except FileNotFoundError:
            return f"{name} (gone)"
        if h != now:
            return f"{name} {h}"
    return "current"


def job_status(rows: Sequence[Mapping[str, str]], root: Path = ROOT, nkilib: str | None = None) -> dict:
    """A figure job's rows against the tree: ``current`` (every row current), the rows, the distinct reasons
    of those that are not, and the latest ``computed`` among its rows."""
    verdicts = [row_verdict(r, root, nkilib) for r in rows]
    stale = sorted({v for v in verdicts if v != "current"})
    computed = sorted({r.get("computed") or "" for r in rows} - {""})
    return {"rows": len(rows), "current": bool(rows) and not stale, "reasons": stale,
            "stale_rows": sum(v != "current" for v in verdicts), "computed": computed[-1] if computed else ""}

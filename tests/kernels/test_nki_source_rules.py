"""Source rules for kernel code: only the Python and the NKI API that neuronx-cc is known to accept.

Checked on each ``@nki.jit`` kernel and every module-level function it calls, transitively (also
helpers imported from another trnkit.kernels module). The rules (docs/kernels.md "Source rules"):

1. **Python syntax: an allowlist** of what AWS's nki-library kernels use (its ``src/``
   at d2ad3a5, surveyed with ``ast``: no lambda, no comprehension, no ``del``, no ``try``/``with``,
   no nested ``def`` in kernel code) plus ``assert`` (the NKI tutorials use it): plain functions,
   assignments, ``if``, ``for`` / ``while`` over trace-time values, arithmetic / comparisons /
   ``x if c else y`` on trace-time values, tuples / lists / str-keyed dicts, f-strings, ``return``.
   A nested ``def`` is allowed only as the body of ``nl.fori_loop`` / ``nl.while_loop`` (the
   documented pattern, ``[NL] fori_loop`` example), with no default arguments.
2. **Builtins**: only those nki-library kernels call (``range, min, max, len, tuple, list, int,
   float, str, print, isinstance, divmod``); no ``enumerate`` / ``zip`` / ``sum`` / ``sorted``.
3. **``for`` loops** iterate over ``range(...)``, a trace-time list / tuple (a name or a kernel
   helper's return value); not over the deprecated ``nl.affine_range`` / ``sequential_range`` /
   ``static_range`` / ``dynamic_range`` (0.6: use ``range`` and ``nl.fori_loop``).
4. **NKI API**: every ``nki.`` / ``nl.`` / ``nisa.`` name is in the documented 0.6 API (the stub
   files of aws-neuron/aws-neuron-sdk@81ce03ae ``nki/api/nki/{__init__,language/__init__,
   isa/__init__}.py``, names and parameter names extracted by scripts/extract_nki_api.py into
   nki_api_0_6.json), not deprecated, called with keyword arguments it declares and no more
   positional arguments than it has; enum members (``nisa.engine.gpsimd``) and ``nl.tile_size``
   fields exist; method calls on tensors are documented ``NkiTensor`` methods with their keywords
   (or the list / dict methods of the language guide).
5. The 0.3.0 compiler's restrictions ``[MIG]``: no ``is`` / ``is not``; no keyword-only ``*`` in a
   kernel signature.
6. Nothing interpreter-only: no numpy / torch, no ``.np()``, no private attributes.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import textwrap
from pathlib import Path

import pytest

MODULES = [importlib.import_module(f"trnkit.kernels.{m}")
           for m in ("rope.rope_kernel", "router.router_fwd", "router.router_bwd", "moe.moe_grouped_mm",
                     "moe.moe_fused", "rmsnorm.rmsnorm_kernels", "cross_entropy.cross_entropy",
                     "attention.flash_fwd", "attention.flash_bwd", "mlp.mlp_kernels")]

API = json.loads((Path(__file__).with_name("nki_api_0_6.json")).read_text())["modules"]

ALLOWED_NODES = (
    ast.FunctionDef, ast.arguments, ast.arg, ast.Return, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For,
    ast.While, ast.If, ast.Expr, ast.Pass, ast.Break, ast.Continue, ast.Assert,
    ast.Name, ast.Constant, ast.Attribute, ast.Subscript, ast.Slice, ast.Tuple, ast.List, ast.Dict,
    ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Call, ast.keyword, ast.JoinedStr,
    ast.FormattedValue, ast.expr_context, ast.operator, ast.unaryop, ast.boolop, ast.cmpop,
)
BUILTINS = {"range", "min", "max", "len", "tuple", "list", "int", "float", "str", "print", "isinstance", "divmod"}
# list / dict methods shown in the NKI language guide ("NKI Values")
CONTAINER_METHODS = {"append", "extend", "index", "remove", "reverse", "keys", "items", "values", "pop",
                     "setdefault"}
LOOP_FUNCTIONS = {"fori_loop": 2, "while_loop": 1}  # nl function -> position of its body argument
MODULE_ALIASES = {"nki": "nki", "nl": "nl", "nisa": "nisa"}
CLASS_OF_CONSTANT = {("nl", "tile_size"): "_TileSize"}


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any((isinstance(d, ast.Attribute) and d.attr == "jit") or
               (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "jit")
               for d in fn.decorator_list)


def _kernel_helper(namespace: dict, name: str, home: str):
    """The function ``namespace[name]`` if it is defined in a trnkit.kernels module or in ``home``."""
    fn = namespace.get(name)
    fn = getattr(fn, "__wrapped__", fn)  # the jit wrapper of a kernel
    if inspect.isfunction(fn) and fn.__module__.startswith(("trnkit.kernels", home)):
        return fn
    return None


def kernel_functions(module) -> dict[str, ast.FunctionDef]:
    """The module's jit kernels and every function they call (transitively, each name resolved in the
    module that defines the caller), by name."""
    tree = ast.parse(inspect.getsource(module))
    todo = [(n.name, vars(module)) for n in tree.body if isinstance(n, ast.FunctionDef) and _is_jit(n)]
    found: dict[str, ast.FunctionDef] = {}
    while todo:
        name, namespace = todo.pop()
        fn = _kernel_helper(namespace, name, module.__name__)
        if name in found or fn is None:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        ast.increment_lineno(tree, fn.__code__.co_firstlineno - 1)  # report lines of the file
        found[name] = tree.body[0]
        for node in ast.walk(found[name]):
            if isinstance(node, ast.Name) and node.id not in found and _kernel_helper(fn.__globals__, node.id,
                                                                                        module.__name__):
                todo.append((node.id, fn.__globals__))
    return found


def _code_nodes(fn: ast.FunctionDef):
    """Nodes of a function's body, signature defaults and nested defs (not its decorators or type
    annotations, which the compiler does not specialize)."""
    todo = list(fn.body) + list(fn.args.defaults) + [d for d in fn.args.kw_defaults if d is not None]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.FunctionDef):
            todo += list(node.body) + list(node.args.defaults) + [d for d in node.args.kw_defaults if d]
            yield node.args
        elif isinstance(node, ast.AnnAssign):
            todo += [node.target] + ([node.value] if node.value else [])
        else:
            todo += list(ast.iter_child_nodes(node))


def _api_name(node: ast.AST) -> tuple[str, ...] | None:
    """``('nisa', 'engine', 'gpsimd')`` for an attribute chain rooted at an NKI module alias."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in MODULE_ALIASES and parts:
        return (MODULE_ALIASES[node.id], *reversed(parts))
    return None


def _check_call_args(what: str, spec: dict, call: ast.Call) -> list[str]:
    out = []
    if not spec["varargs"] and len(call.args) > len(spec["params"]):
        out.append(f"{what}: {len(call.args)} positional arguments, the API has {len(spec['params'])}")
    if not spec["varkw"]:
        for kw in call.keywords:
            if kw.arg is None or kw.arg not in spec["params"]:
                out.append(f"{what}: keyword {kw.arg!r} not in the documented parameters {spec['params']}")
    return out


def _api_violations(chain: tuple[str, ...], call: ast.Call | None) -> list[str]:
    """A name ``nl.x[.y]`` / ``nisa.x[.y]`` / ``nki.x`` checked against the documented 0.6 API."""
    mod = API[chain[0]]
    name = chain[1]
    dotted = ".".join(chain)
    if name in mod["functions"]:
        spec = mod["functions"][name]
        if spec["deprecated"]:
            return [f"{dotted}: deprecated in the 0.6 API"]
        if len(chain) > 2:
            return [f"{dotted}: attribute of a function"]
        return _check_call_args(dotted, spec, call) if call is not None else []
    cls = mod["classes"].get(name) or mod["classes"].get(CLASS_OF_CONSTANT.get(chain[:2], ""))
    if cls is not None or name in mod["constants"]:
        if len(chain) == 2 or cls is None:
            return [] if len(chain) == 2 else [f"{dotted}: no documented member {chain[2]!r}"]
        member = chain[2]
        if member in cls["attributes"]:
            return []
        if member in cls["methods"] and call is not None:
            return _check_call_args(dotted, cls["methods"][member], call)
        return [f"{dotted}: {member!r} is not a documented member of {name}"]
    return [f"{dotted}: not in the documented NKI 0.6 API"]


def _loop_bodies(fn: ast.FunctionDef) -> set[str]:
    """Names passed as the body of nl.fori_loop / nl.while_loop anywhere in ``fn``."""
    bodies = set()
    for node in _code_nodes(fn):
        if isinstance(node, ast.Call):
            chain = _api_name(node.func)
            if chain and chain[0] == "nl" and len(chain) == 2 and chain[1] in LOOP_FUNCTIONS:
                pos = LOOP_FUNCTIONS[chain[1]]
                arg = node.args[pos] if len(node.args) > pos else next(
                    (k.value for k in node.keywords if k.arg == "body_fun"), None)
                if isinstance(arg, ast.Name):
                    bodies.add(arg.id)
    return bodies


def _call_violations(call: ast.Call, kernel_names: set[str], local_fns: set[str]) -> list[str]:
    f = call.func
    chain = _api_name(f)
    if chain is not None:
        return _api_violations(chain, call)
    if isinstance(f, ast.Name):
        if f.id in BUILTINS or f.id in kernel_names or f.id in local_fns:
            return []
        return [f"call of {f.id}(): not a kernel helper nor an allowed builtin"]
    if isinstance(f, ast.Attribute):
        tensor_methods = API["nl"]["classes"]["NkiTensor"]["methods"]
        if f.attr in tensor_methods:
            return _check_call_args(f"NkiTensor.{f.attr}", tensor_methods[f.attr], call)
        if f.attr in CONTAINER_METHODS:
            return []
        return [f"method .{f.attr}(): not an NkiTensor method nor a list / dict method"]
    return [f"call of a {type(f).__name__} expression"]


def _for_violations(node: ast.For) -> list[str]:
    it = node.iter
    chain = _api_name(it.func) if isinstance(it, ast.Call) else None
    if chain is not None:
        return [f"for over {'.'.join(chain)}(): loop over range() or use nl.fori_loop (0.6)"]
    if isinstance(it, (ast.Call, ast.Name, ast.Attribute, ast.Subscript, ast.Tuple, ast.List)):
        return []
    return [f"for over a {type(it).__name__} expression"]


def violations(module) -> list[str]:
    out = []
    found = kernel_functions(module)
    for name, fn in found.items():
        if _is_jit(fn) and fn.args.kwonlyargs:
            out.append(f"{name}: keyword-only parameters {[a.arg for a in fn.args.kwonlyargs]}")
        bodies = _loop_bodies(fn)
        for node in _code_nodes(fn):
            where = f"{name} line {getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.comprehension):
                continue  # reported with its ListComp / GeneratorExp / ...
            if not isinstance(node, ALLOWED_NODES):
                out.append(f"{where}: {type(node).__name__} is outside the allowed Python subset")
            elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                out.append(f"{where}: `is` / `is not` comparison")
            elif isinstance(node, ast.Name) and node.id in ("np", "numpy", "torch"):
                out.append(f"{where}: uses {node.id} inside kernel code")
            elif isinstance(node, ast.FunctionDef):
                if node.args.defaults or any(d is not None for d in node.args.kw_defaults):
                    out.append(f"{where}: nested function {node.name} with default arguments")
                if node.name not in bodies:
                    out.append(f"{where}: nested function {node.name} that is not an nl.fori_loop / "
                               "nl.while_loop body")
            elif isinstance(node, ast.For):
                out += [f"{where}: {v}" for v in _for_violations(node)]
            elif isinstance(node, ast.Call):
                out += [f"{where}: {v}" for v in _call_violations(node, set(found), bodies)]
            elif isinstance(node, ast.Attribute):
                chain = _api_name(node)
                if node.attr == "np" or (node.attr.startswith("_") and not node.attr.startswith("__")):
                    out.append(f"{where}: interpreter-only attribute .{node.attr}")
                elif chain is not None and not _is_call_target(node, fn):
                    out += [f"{where}: {v}" for v in _api_violations(chain, None)]
    return sorted(set(out))


def _is_call_target(node: ast.Attribute, fn: ast.FunctionDef) -> bool:
    """Whether ``node`` (or an attribute chain containing it) is the function of a call in ``fn``
    (those are checked with their arguments by _call_violations)."""
    for call in _code_nodes(fn):
        if isinstance(call, ast.Call):
            f = call.func
            while isinstance(f, ast.Attribute):
                if f is node:
                    return True
                f = f.value
    return False


def _returned_names(fn: ast.FunctionDef) -> set[str]:
    out = set()
    for node in _code_nodes(fn):
        if isinstance(node, ast.Return) and node.value is not None:
            vals = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            out |= {v.id for v in vals if isinstance(v, ast.Name)}
    return out


def aliasing_violations(module) -> list[str]:
    """Outputs passed in (kernel parameters the kernel returns) are declared ``nt.mutable_tensor``, the
    way nki-library declares them (``router_topk(..., router_logits: nt.mutable_tensor, ...)``, [SDK]
    nki/library/api/router-topk.rst), and every parameter so declared is returned."""
    out = []
    for name, fn in kernel_functions(module).items():
        if not _is_jit(fn):
            continue
        params = {a.arg: a.annotation for a in fn.args.args}
        mutable = {p for p, ann in params.items() if ann is not None and ast.unparse(ann) == "nt.mutable_tensor"}
        returned = _returned_names(fn) & set(params)
        out += [f"{name}: returns parameter {p} without declaring it nt.mutable_tensor" for p in returned - mutable]
        out += [f"{name}: parameter {p} declared nt.mutable_tensor but not returned" for p in mutable - returned]
    return sorted(out)


@pytest.mark.parametrize("module", MODULES, ids=[m.__name__.rsplit(".", 1)[-1] for m in MODULES])
def test_outputs_passed_in_are_declared_aliased_and_returned(module) -> None:
    assert aliasing_violations(module) == []


@pytest.mark.parametrize("module", MODULES, ids=[m.__name__.rsplit(".", 1)[-1] for m in MODULES])
def test_kernel_code_follows_nki_compiler_rules(module) -> None:
    names = kernel_functions(module)
    assert any(_is_jit(f) for f in names.values()) and len(names) > 1  # the walk found the kernels' helpers
    assert violations(module) == []


def psum_matmuls_without_accumulate(module) -> list[str]:
    """Every ``nisa.nc_matmul`` call in kernel code without an explicit ``accumulate=`` (the default,
    None, accumulates per element into whatever an earlier write left, which is undefined after a
    non-matmul write on NeuronCore v2/v3; each accumulation group states where it opens)."""
    out = []
    for name, fn in kernel_functions(module).items():
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and _api_name(node.func) == ("nisa", "nc_matmul") \
                    and "accumulate" not in {k.arg for k in node.keywords}:
                out.append(f"{name}: line {node.lineno}")
    return out


ACCUMULATE_MODULES = MODULES + [importlib.import_module("trnkit.kernels.moe.moe_bwd")]


@pytest.mark.parametrize("module", ACCUMULATE_MODULES, ids=[m.__name__.rsplit(".", 1)[-1] for m in ACCUMULATE_MODULES])
def test_every_matmul_states_whether_it_accumulates(module) -> None:
    assert psum_matmuls_without_accumulate(module) == []


def test_api_list_is_the_documented_one() -> None:
    """Spot checks of nki_api_0_6.json against the 0.6 reference (nisa.dma_transpose(dst, src, axes=None,
    ...), nl.fori_loop(lower, upper, body_fun, step=1), deprecated affine_range)."""
    assert API["nisa"]["functions"]["dma_transpose"]["params"][:3] == ["dst", "src", "axes"]
    assert API["nl"]["functions"]["fori_loop"]["params"] == ["lower", "upper", "body_fun", "step"]
    assert API["nl"]["functions"]["affine_range"]["deprecated"]
    assert "gpsimd" in API["nisa"]["classes"]["engine"]["attributes"]
    assert "ap" in API["nl"]["classes"]["NkiTensor"]["methods"]


BAD_SOURCE = '''
import numpy as np
from trnkit.nki_api import nki, nl, nisa, nt

def _helper(t, extra):
    if extra is not None:
        return t.np()
    scale = lambda v: v
    def body(i, t=t):
        return scale(t)
    del scale
    tiles = [nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf) for _ in range(2)]
    for j, tl in enumerate(tiles):
        nisa.memset(dst=tl, value=0.0, colour=1)
    for i in nl.affine_range(2):
        nisa.no_such_instruction(dst=t)
    for e in nisa.engine.gpsimd, nisa.engine.warp:
        pass
    try:
        nl.fori_loop(0, 2, body)
    except ValueError:
        pass
    def stray(i):
        pass
    t.ap([[1, 1]], colour=2)
    t.frobnicate()
    return t._storage, sum(tiles)

@nki.jit
def bad_kernel(x, *, flag=False):
    return _helper(x, np.zeros(1)), nl.tile_size.pmax, nl.tile_size.nope


@nki.jit
def bad_outputs(x, out, res: nt.mutable_tensor):
    return out
'''


def test_rules_catch_what_they_claim(tmp_path, monkeypatch) -> None:
    (tmp_path / "bad_kernel_mod.py").write_text(BAD_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import bad_kernel_mod

    found = violations(bad_kernel_mod)
    assert set(kernel_functions(bad_kernel_mod)) == {"bad_kernel", "_helper", "bad_outputs"}
    assert aliasing_violations(bad_kernel_mod) == [
        "bad_outputs: parameter res declared nt.mutable_tensor but not returned",
        "bad_outputs: returns parameter out without declaring it nt.mutable_tensor"]
    for needle in ("keyword-only", "`is` / `is not`", "uses np", ".np", "._storage", "Lambda is outside",
                   "Delete is outside", "ListComp is outside", "Try is outside",
                   "nested function body with default arguments",
                   "nested function stray that is not an nl.fori_loop", "call of enumerate()",
                   "call of sum()", "keyword 'colour' not in the documented parameters ['dst', 'value'",
                   "NkiTensor.ap: keyword 'colour'", "method .frobnicate()",
                   "for over nl.affine_range()", "nl.affine_range: deprecated",
                   "nisa.no_such_instruction: not in the documented", "nisa.engine.warp: 'warp' is not",
                   "nl.tile_size.nope"):
        assert any(needle in v for v in found), (needle, found)
    assert not any("nl.tile_size.pmax" in v or "nisa.engine.gpsimd" in v for v in found), found

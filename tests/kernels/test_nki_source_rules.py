"""Source rules of the real NKI compiler that trnkit's interpreter does not enforce, checked on the kernel
code (each ``@nki.jit`` kernel and every module-level function it calls, transitively):

- no ``is`` / ``is not`` (the 0.3+ compiler rejects them; write ``== None`` / ``!= None``);
- no keyword-only ``*`` separator in a kernel's signature;
- only the Python that nki-library's kernels use: no ``lambda``, no ``del``, no nested function with
  default arguments (the default-argument capture idiom); nested functions that close over their
  enclosing scope (``nl.fori_loop`` bodies) are fine;
- nothing interpreter-only: no ``numpy`` / ``torch`` inside kernel code, no ``.np()`` on tiles, no
  private attributes (``._storage`` ...) of NKI tensors.

See ../shared/notes/nki-facts.md §1.2 ("Language restrictions enforced by the 0.3.0 compiler").
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap

import pytest

# by module path: trnkit.kernels re-exports functions of the same names as the modules
MODULES = [importlib.import_module(f"trnkit.kernels.{m}") for m in ("rope_hf", "router_topk", "moe_grouped_mm", "moe_fused")]


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any((isinstance(d, ast.Attribute) and d.attr == "jit") or
               (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "jit")
               for d in fn.decorator_list)


def _imported_kernel_helper(module, name: str) -> ast.FunctionDef | None:
    """The AST of ``module.<name>`` if it is a function imported from another trnkit.kernels module."""
    fn = getattr(module, name, None)
    if not inspect.isfunction(fn) or not fn.__module__.startswith("trnkit.kernels"):
        return None
    return ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]


def kernel_functions(module) -> dict[str, ast.FunctionDef]:
    """The module's jit kernels and every function they call (transitively; defined in the module or
    imported from another trnkit.kernels module), by the name the module uses."""
    tree = ast.parse(inspect.getsource(module))
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    todo = [name for name, fn in defs.items() if _is_jit(fn)]
    found: dict[str, ast.FunctionDef] = {}
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found[name] = defs[name]
        for node in ast.walk(defs[name]):
            if isinstance(node, ast.Name) and node.id not in found and node.id not in defs:
                helper = _imported_kernel_helper(module, node.id)
                if helper is not None:
                    defs[node.id] = helper
            if isinstance(node, ast.Name) and node.id in defs and node.id not in found:
                todo.append(node.id)
    return found


def violations(module) -> list[str]:
    out = []
    for name, fn in kernel_functions(module).items():
        if _is_jit(fn) and fn.args.kwonlyargs:
            out.append(f"{name}: keyword-only parameters {[a.arg for a in fn.args.kwonlyargs]}")
        for node in ast.walk(fn):
            where = f"{name} line {getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                out.append(f"{where}: `is` / `is not` comparison")
            elif isinstance(node, ast.Name) and node.id in ("np", "numpy", "torch"):
                out.append(f"{where}: uses {node.id} inside kernel code")
            elif isinstance(node, ast.Lambda):
                out.append(f"{where}: lambda")
            elif isinstance(node, ast.Delete):
                out.append(f"{where}: del statement")
            elif (isinstance(node, ast.FunctionDef) and node is not fn
                  and (node.args.defaults or any(d is not None for d in node.args.kw_defaults))):
                out.append(f"{where}: nested function {node.name} with default arguments")
            elif isinstance(node, ast.Attribute) and (node.attr == "np" or (
                    node.attr.startswith("_") and not node.attr.startswith("__"))):
                out.append(f"{where}: interpreter-only attribute .{node.attr}")
    return out


@pytest.mark.parametrize("module", MODULES, ids=[m.__name__.rsplit(".", 1)[-1] for m in MODULES])
def test_kernel_code_follows_nki_compiler_rules(module) -> None:
    names = kernel_functions(module)
    assert any(_is_jit(f) for f in names.values()) and len(names) > 1  # the walk found the kernels' helpers
    assert violations(module) == []


def test_rules_catch_what_they_claim(tmp_path, monkeypatch) -> None:
    src = '''
import numpy as np
from trnkit.nki_api import nki, nl, nisa

def _helper(t, extra):
    if extra is not None:
        return t.np()
    scale = lambda v: v
    def body(i, t=t):
        return scale(t)
    del scale
    return t._storage

@nki.jit
def bad_kernel(x, *, flag=False):
    return _helper(x, np.zeros(1))
'''
    (tmp_path / "bad_kernel_mod.py").write_text(src)
    monkeypatch.syspath_prepend(str(tmp_path))
    import bad_kernel_mod

    found = violations(bad_kernel_mod)
    assert set(kernel_functions(bad_kernel_mod)) == {"bad_kernel", "_helper"}
    for needle in ("keyword-only", "`is` / `is not`", "uses np", ".np", "._storage", "lambda", "del statement",
                   "nested function body with default arguments"):
        assert any(needle in v for v in found), (needle, found)

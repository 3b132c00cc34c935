"""Extract the documented NKI API names (with parameter names) into tests/kernels/nki_api_0_6.json.

Source: the API stub files that generate the NKI 0.6 reference pages, ``nki/api/nki/__init__.py``,
``nki/api/nki/language/__init__.py`` and ``nki/api/nki/isa/__init__.py`` of aws-neuron/aws-neuron-sdk
at commit 81ce03ae (Neuron SDK 2.32 / NKI 0.6.0). Only names and parameter names are kept: the kernel
source-rule test (tests/kernels/test_nki_source_rules.py) checks every ``nl.`` / ``nisa.`` / ``nki.``
name and keyword argument a kernel uses against this list.

usage: python scripts/extract_nki_api.py /path/to/aws-neuron-sdk [commit]
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

COMMIT = "81ce03ae"
STUBS = {"nki": "nki/api/nki/__init__.py", "nl": "nki/api/nki/language/__init__.py",
         "nisa": "nki/api/nki/isa/__init__.py"}
OUT = Path(__file__).resolve().parents[1] / "tests" / "kernels" / "nki_api_0_6.json"


def _params(fn: ast.FunctionDef) -> dict:
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg != "self"]
    doc = ast.get_docstring(fn) or ""
    return {"params": names, "varargs": a.vararg is not None, "varkw": a.kwarg is not None,
            "deprecated": "deprecated" in doc.lower()}


def _class_members(cls: ast.ClassDef) -> dict:
    attrs, methods = [], {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            methods[node.name] = _params(node)
        elif isinstance(node, ast.Assign):
            attrs += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            attrs.append(node.target.id)
    return {"attributes": sorted(attrs), "methods": methods}


def extract(source: str) -> dict:
    """Module-level functions, classes (members, methods) and constants of one stub file."""
    out: dict = {"functions": {}, "classes": {}, "constants": []}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            out["functions"][node.name] = _params(node)
        elif isinstance(node, ast.ClassDef):
            out["classes"][node.name] = _class_members(node)
        elif isinstance(node, ast.Assign):
            out["constants"] += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out["constants"].append(node.target.id)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nki"):
            out["constants"] += [a.asname or a.name for a in node.names]  # re-exports (nisa.equal, ...)
    out["constants"].sort()
    return out


def main(sdk: str, commit: str = COMMIT) -> None:
    api = {"source": f"aws-neuron/aws-neuron-sdk@{commit}", "modules": {}}
    for short, path in STUBS.items():
        text = subprocess.run(["git", "-C", sdk, "show", f"{commit}:{path}"], check=True,
                              capture_output=True, text=True).stdout
        api["modules"][short] = extract(text)
    OUT.write_text(json.dumps(api, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main(*sys.argv[1:])

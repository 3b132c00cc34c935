"""Figure fingerprints (trnkit.bench.fingerprint): the cost-model hash moves when a parameter's value or the model's
code changes and not for a comment, a docstring, a doc page or a test; a kernel family's hash moves with its own
code and the kernels it imports; ``figures --stale`` names the jobs whose rows were computed with other code."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from trnkit.bench import figures, fingerprint
from trnkit.bench.schema import Row, write_rows

REPO = fingerprint.ROOT


def _tree(tmp: Path, name: str) -> Path:
    """A copy of what the hashes read: the cost model, the interpreter's trace code, the kernels, a doc, a test."""
    root = tmp / name
    for sub in ("trnkit/nkisim", "trnkit/kernels"):
        shutil.copytree(REPO / sub, root / sub, ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("docs/cost-model.md", "tests/test_bench_fingerprint.py", "benchmarks/headline.py"):
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / f, root / f)
    return root


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, (path, old)
    path.write_text(text.replace(old, new))


def test_normalized_drops_comments_docstrings_and_layout_only():
    base = 'def f(x):\n    """Doc."""\n    return x + 1  # one\n'
    same = '# a comment\ndef f(x):\n    """Another doc,\n    two lines."""\n\n    return x  +  1\n'
    assert fingerprint.normalized(base) == fingerprint.normalized(same)
    assert fingerprint.normalized(base) != fingerprint.normalized(base.replace("x + 1", "x + 2"))
    # a string that is a value, not a statement, counts (an error message, a key)
    assert fingerprint.normalized('y = "a"\n') != fingerprint.normalized('y = "b"\n')
    assert fingerprint.normalized('y = f"{x}a"\n') != fingerprint.normalized('y = f"{x}b"\n')


def test_copy_hashes_like_the_repository(tmp_path):
    """Only the files' contents and their paths in the tree count, not where the tree is."""
    root = _tree(tmp_path, "a")
    assert fingerprint.cost_model_hash(root) == fingerprint.cost_model_hash(REPO)
    assert fingerprint.source_hash("trnkit/kernels/moe", root) == fingerprint.source_hash("trnkit/kernels/moe", REPO)


def test_cost_model_hash_moves_with_a_parameter_value_not_with_docs_or_tests(tmp_path):
    base = _tree(tmp_path, "base")
    param = _tree(tmp_path, "param")
    # a parameter's mid value (cost_params.ModelParams field default)
    text = (param / "trnkit/nkisim/cost_params.py").read_text()
    field = next(ln for ln in text.splitlines() if ln.startswith("    dma_fixed_ns: float = "))
    value = field.split("=", 1)[1].split("#")[0].strip()
    _edit(param / "trnkit/nkisim/cost_params.py", field, field.replace(f"= {value}", f"= {value} + 1", 1))
    assert fingerprint.cost_model_hash(param) != fingerprint.cost_model_hash(base)
    # comments, docstrings, a doc page and a test leave it (and every kernel's hash) where it was
    prose = _tree(tmp_path, "prose")
    _edit(prose / "trnkit/nkisim/cost.py", "from __future__ import annotations\n",
          "from __future__ import annotations  # a comment\n")
    _edit(prose / "trnkit/nkisim/cost_params.py", '"""The cost model\'s uncertain',
          '"""The cost model\'s (edited) uncertain')
    (prose / "docs/cost-model.md").write_text("rewritten\n")
    (prose / "tests/test_bench_fingerprint.py").write_text("# nothing\n")
    assert fingerprint.cost_model_hash(prose) == fingerprint.cost_model_hash(base)
    # the trace code an instruction records with is part of it
    isa = _tree(tmp_path, "isa")
    _edit(isa / "trnkit/nkisim/isa/common.py", "def emit(", "def emit_(")
    assert fingerprint.cost_model_hash(isa) != fingerprint.cost_model_hash(base)


def test_kernel_hash_moves_with_its_family_and_what_it_imports(tmp_path):
    base = _tree(tmp_path, "base")
    moe = _tree(tmp_path, "moe")
    _edit(moe / "trnkit/kernels/moe/layout.py", "from __future__ import annotations\n",
          "from __future__ import annotations\n\n_UNUSED = 1\n")
    h = {(t, fam): fingerprint.source_hash(f"trnkit/kernels/{fam}", r)
         for t, r in (("base", base), ("moe", moe)) for fam in ("moe", "mlp", "rope", "attention")}
    assert h["moe", "moe"] != h["base", "moe"]
    assert h["moe", "mlp"] != h["base", "mlp"]  # mlp_kernels imports moe_fused and moe_bwd
    assert h["moe", "rope"] == h["base", "rope"] and h["moe", "attention"] == h["base", "attention"]
    assert fingerprint.cost_model_hash(moe) == fingerprint.cost_model_hash(base)
    with pytest.raises(FileNotFoundError, match="trnkit/kernels/nope"):
        fingerprint.source_hash("trnkit/kernels/nope", base)


def test_row_verdicts(tmp_path):
    root = _tree(tmp_path, "t")
    fp = fingerprint.stamp(["trnkit/kernels/rope"], nkilib="d2ad3a5", root=root)
    assert fp["sources"] == f"trnkit/kernels/rope@{fingerprint.source_hash('trnkit/kernels/rope', root)};" \
                            "nki-library@d2ad3a5"
    assert fingerprint.row_verdict(fp, root, nkilib="d2ad3a5") == "current"
    assert fingerprint.row_verdict(fp, root, nkilib=None) == "current"  # nki-library not compared
    assert fingerprint.row_verdict(fp, root, nkilib="0000000") == "nki-library d2ad3a5"
    assert fingerprint.row_verdict({}, root) == "none"
    assert fingerprint.row_verdict({**fp, "cost_model": "abc"}, root) == "cost model abc"
    old = fp["sources"].split(";")[0]
    assert fingerprint.row_verdict({**fp, "sources": "trnkit/kernels/rope@123"}, root) == "trnkit/kernels/rope 123"
    assert old.startswith("trnkit/kernels/rope@")


def _data_folder(root: Path) -> None:
    """benchmarks/data with a rope sweep, a router sweep and the attention side-by-side stamped in ``root``."""
    data = root / "benchmarks" / "data"
    rows = []
    for kernel, fam in (("rope_hf", "rope"), ("router_topk", "router")):
        details = fingerprint.stamp([f"trnkit/kernels/{fam}"], root=root)
        rows.append(Row(kernel=kernel, impl="nki", mode="forward", metric="est_time", unit="us", x_name="T",
                        x_value=128, p50=1.0, p20=1.0, p80=1.0, device="trn2 (cost model)", timestamp="t",
                        trnkit_version="0", extra=json.dumps({"dtype": "bfloat16", "details": details})))
    write_rows(data / "bench.csv", rows)
    with (data / "attention_peak.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["kernel", "S", *fingerprint.FIELDS])
        w.writeheader()
        w.writerow({"kernel": "trnkit", "S": 4096, **fingerprint.stamp(["trnkit/kernels/attention"], root=root)})
        w.writerow({"kernel": "nki-library", "S": 4096, **fingerprint.stamp(nkilib="d2ad3a5", root=root)})


def test_stale_names_the_job_whose_kernel_changed(tmp_path, monkeypatch, capsys):
    root = _tree(tmp_path, "t")
    _data_folder(root)
    jobs = [j for j in figures.jobs() if j.name in ("bench:rope_hf", "bench:router_topk", "attention_peak",
                                                     "bench:mlp")]
    stale = {j.name: st for j, st in figures.stale_jobs(jobs, root, nkilib="d2ad3a5")}
    assert set(stale) == {"bench:mlp"} and stale["bench:mlp"]["rows"] == 0  # no rows: stale
    # a change to the router's kernel makes its sweep stale and nothing else
    _edit(root / "trnkit/kernels/router/router_fwd.py", "from __future__ import annotations\n",
          "from __future__ import annotations\n\n_UNUSED = 1\n")
    fingerprint.source_hash.cache_clear()
    stale = {j.name: st for j, st in figures.stale_jobs(jobs, root, nkilib="d2ad3a5")}
    assert set(stale) == {"bench:mlp", "bench:router_topk"}
    assert stale["bench:router_topk"]["reasons"][0].startswith("trnkit/kernels/router ")
    # another nki-library checkout makes the side-by-side stale
    stale = {j.name for j, _ in figures.stale_jobs(jobs, root, nkilib="1234567")}
    assert "attention_peak" in stale and "bench:rope_hf" not in stale
    # the command line names them, with the reason and the rows
    monkeypatch.setattr(figures, "ROOT", root)
    monkeypatch.setattr(figures, "_nkilib_commit", lambda: "d2ad3a5")
    assert figures.main(["--stale", "--only", "bench:rope_hf", "bench:router_topk", "attention_peak"]) == 0
    out = capsys.readouterr().out
    assert "1 of 3 jobs stale" in out
    assert "bench:router_topk: 1 of 1 rows in benchmarks/data/bench.csv (trnkit/kernels/router " in out
    assert "bench:rope_hf" not in out and "attention_peak" not in out


def test_only_stale_runs_just_the_stale_jobs(tmp_path, monkeypatch):
    root = _tree(tmp_path, "t")
    _data_folder(root)
    ran = []
    monkeypatch.setattr(figures, "ROOT", root)
    monkeypatch.setattr(figures, "_nkilib_commit", lambda: "d2ad3a5")
    monkeypatch.setattr(figures, "_run_job", lambda job, env: (ran.append(job.name), (job.name, 0, 0.0))[1])
    monkeypatch.setattr(figures, "merge_bench", lambda kernels: 0)
    monkeypatch.setattr(figures, "merge_headline", lambda cases: 0)
    monkeypatch.setattr(figures.subprocess, "call", lambda *a, **k: 0)  # no docs_tables run here
    assert figures.main(["--only-stale", "-j", "1", "--only", "bench:rope_hf", "bench:mlp", "attention_peak"]) == 0
    assert ran == ["bench:mlp"]


def test_every_job_names_its_data():
    for job in figures.jobs():
        assert job.data and (REPO / job.data).exists(), job.name

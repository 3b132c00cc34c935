"""README.md and docs/: every relative link resolves inside the repository, the tables generated from
benchmark outputs are current (scripts/docs_tables.py), every Python block runs, every bash command parses
and every toml block loads as a trainer config as written."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from trnkit.bench.paths import load_script

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCED = re.compile(r"```.*?```", re.S)
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


docs_tables = load_script(ROOT / "scripts" / "docs_tables.py", "docs_tables")
DOC_FILES = docs_tables.doc_files()


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCED.sub("", path.read_text())
    return {github_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def relative_links(path: Path) -> list[str]:
    text = CODE.sub("", path.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_doc_files_found():
    names = {p.relative_to(ROOT).as_posix() for p in DOC_FILES}
    assert {"README.md", "docs/kernels.md", "docs/interpreter.md", "docs/tests.md"} <= names


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve_inside_the_repository(path: Path):
    problems = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.is_relative_to(ROOT):
            problems.append(f"{target}: outside the repository")
        elif not dest.exists():
            problems.append(f"{target}: {dest.relative_to(ROOT)} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading '#{anchor}' in {dest.relative_to(ROOT)}")
    assert not problems, f"{path.relative_to(ROOT)}: broken links:\n" + "\n".join(problems)


def test_link_check_catches_breakage(tmp_path: Path):
    """The checker itself: a link leaving the repository and a missing anchor are both found."""
    assert relative_links(ROOT / "README.md"), "README has relative links"
    assert github_slug("Parity with transformers 5.24 (tests/qwen3/)") == "parity-with-transformers-524-testsqwen3"
    assert github_slug("The `trnkit::` ops") == "the-trnkit-ops"
    assert "speed" in anchors(ROOT / "docs" / "interpreter.md")
    assert "no-such-heading" not in anchors(ROOT / "docs" / "interpreter.md")
    outside = (ROOT / "docs" / "../../benchmarks/data/plots/x.png").resolve()
    assert not outside.is_relative_to(ROOT)


def test_generated_tables_are_current():
    assert docs_tables.stale_regions() == [], "run: python scripts/docs_tables.py"


def test_stale_table_is_detected(monkeypatch):
    """A changed CSV value makes the region stale (the check compares against the CSV, not itself)."""
    read_csv = docs_tables.read_csv
    rows = read_csv("interp_speed.csv")
    rows[0]["ratio"] = str(float(rows[0]["ratio"]) + 1.0)
    monkeypatch.setattr(docs_tables, "read_csv", lambda name: rows if name == "interp_speed.csv" else read_csv(name))
    assert "docs/interpreter.md" in docs_tables.stale_regions()


def test_every_generator_is_used():
    used = {m.group("name") for p in DOC_FILES for m in docs_tables.REGION.finditer(p.read_text())}
    assert used == set(docs_tables.GENERATORS)


def test_quoted_figures_are_in_their_source_csv():
    assert docs_tables.QUOTES, "README quotes figures from the benchmark CSVs"
    assert docs_tables.wrong_quotes() == []


def test_changed_csv_value_breaks_its_quote(monkeypatch):
    read_csv = docs_tables.read_csv
    rows = read_csv("interp_speed.csv")
    for row in rows:
        row["ratio"] = str(float(row["ratio"]) * 1.5)
    monkeypatch.setattr(docs_tables, "read_csv", lambda name: rows if name == "interp_speed.csv" else read_csv(name))
    wrong = docs_tables.wrong_quotes()
    assert len(wrong) == 2 and all(w.startswith("README.md: expected") and "interp_speed.csv" in w for w in wrong)


def test_quote_sources(tmp_path, monkeypatch):
    (tmp_path / "r.json").write_text('{"case": {"time_us": {"mid": 645.71}}}')
    (tmp_path / "r.csv").write_text("k,v\na,1.25\nb,2\na,3.75\n")
    monkeypatch.setattr(docs_tables, "DATA", tmp_path)
    assert docs_tables.json_value("r.json", "case/time_us/mid", "{:,.0f}")() == "646"
    assert docs_tables.csv_cell("r.csv", "v", {"k": "a"}, "{:.2f}")() == "3.75"  # the last matching row
    assert docs_tables.csv_count("r.csv", {"k": "a"})() == "2" and docs_tables.csv_count("r.csv", {})() == "3"
    with pytest.raises(LookupError, match="no row with"):
        docs_tables.csv_cell("r.csv", "v", {"k": "c"})()


def test_changed_headline_csv_makes_every_page_with_its_tables_stale(monkeypatch):
    read_csv = docs_tables.read_csv
    rows = read_csv(docs_tables.HEADLINE_CSV)
    for row in rows:
        row["mid_us"] = str(float(row["mid_us"]) + 1.0)
    monkeypatch.setattr(docs_tables, "read_csv",
                        lambda name: rows if name == docs_tables.HEADLINE_CSV else read_csv(name))
    assert {"docs/kernels.md", "docs/benchmarks.md"} <= set(docs_tables.stale_regions())
    assert "README.md" in "\n".join(docs_tables.wrong_quotes())  # its headline figures are quotes


def test_headline_targets_are_judged_at_their_end_of_the_range(monkeypatch):
    row = {"case": "rope_fwd", "fraction_low_end": "0.69", "fraction_mid": "0.9", "fraction_high_end": "0.95"}
    monkeypatch.setattr(docs_tables, "read_csv", lambda name: [row])
    monkeypatch.setattr(docs_tables, "TARGETS", (("rope_fwd", "low_end", 0.70, "t"), ("rope_fwd", "mid", 0.80, "t"),
                                                 ("moe_bwd", "mid", 0.5, "t")))
    lines = docs_tables.headline_targets().splitlines()[2:]
    assert "| 69.0% (69.0% / 90.0% / 95.0%) | **no** |" in lines[0] and "at the low end" in lines[0]
    assert "| 90.0% (69.0% / 90.0% / 95.0%) | **yes** |" in lines[1]
    assert "| not estimated | - |" in lines[2]


TIME_FIGURE = re.compile(r"\d[\d,.]*\s?(?:µs|μs|us|ms|ns)\b")  # µ: micro sign, μ: Greek mu
DERIVED = re.compile(r"<!-- derived: .*?<!-- end derived -->", re.S)  # hand-computed bounds, says how


def unchecked_time_figures(page: str) -> list[str]:
    """Times (µs, us, ms, ns) in ``page`` outside its generated tables, derived-bound regions, code and checked
    quotes."""
    text = DERIVED.sub("", docs_tables.REGION.sub("", (ROOT / page).read_text()))
    text = " ".join(CODE.sub("", text).split())
    for q in docs_tables.QUOTES:
        if q.page == page:
            try:
                text = text.replace(" ".join(CODE.sub("", q.text()).split()), "")  # as the page: code cut
            except LookupError:  # its CSV row is missing: test_quoted_figures_are_in_their_source_csv says so
                continue
    return TIME_FIGURE.findall(text)


TIME_CHECKED = [p.relative_to(ROOT).as_posix() for p in DOC_FILES]


@pytest.mark.parametrize("page", TIME_CHECKED)
def test_cost_figures_are_generated_or_checked_quotes(page):
    """Every time figure of these pages comes from a benchmark CSV or the model's constants: a generated table or
    a quote in scripts/docs_tables.py QUOTES (which also carries the range), never typed in by hand; bounds
    computed by hand from documented constants sit in a ``<!-- derived: how -->`` ... ``<!-- end derived -->``
    region."""
    assert unchecked_time_figures(page) == [], (
        f"{page}: time figures not from a CSV; put them in a generated table or a Quote (scripts/docs_tables.py)")


def test_every_page_is_time_checked():
    assert {"README.md", "docs/cost-model.md", "docs/interpreter.md", "docs/trainer.md"} <= set(TIME_CHECKED)
    assert len(TIME_CHECKED) == len(DOC_FILES)


def test_changed_model_constant_breaks_its_quote(monkeypatch):
    """Quotes of the cost model's constants follow the code: another mid dma_fixed_ns or ACTIVATE fixed time
    makes the pages' sentences that state them wrong."""
    import dataclasses

    from trnkit.nkisim import cost, cost_params, hardware  # noqa: F401 (cost: imported before the patch)

    # cost.py binds cost_params.MID when it is first imported: imported under the patch, it would keep the
    # patched value for every later test of the process (a snippet estimate then read 3.25 us, not 3.16)
    monkeypatch.setattr(cost_params, "MID", dataclasses.replace(cost_params.MID, dma_fixed_ns=900.0))
    monkeypatch.setitem(hardware.CHIPS, "trn2", dataclasses.replace(hardware.TRN2, act_fixed_ns=300.0))
    wrong = "\n".join(docs_tables.wrong_quotes())
    assert "`dma_fixed_ns`, 619 / 900 / 1,013 ns." in wrong and "**plus a fixed 300 ns** (trn2)" in wrong
    assert "docs/kernels.md: expected '(the grad_x PSUM evacuations, ~300 ns fixed time each)'" in wrong


DERIVED_MARK = re.compile(r"<!-- (derived: (.*?)|end derived) -->", re.S)


def derived_block_problems(text: str) -> list[str]:
    """What is wrong with a page's derived blocks: a start inside an open block, an end without a start, a block
    left open, or a comment too short to say where its figures come from (fewer than 5 words)."""
    problems, open_at = [], None
    text = CODE.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # a marker written in code is an example
    for m in DERIVED_MARK.finditer(text):
        line = text[:m.start()].count("\n") + 1
        if m.group(1) == "end derived":
            if open_at is None:
                problems.append(f"line {line}: end derived without a start")
            open_at = None
            continue
        if open_at is not None:
            problems.append(f"line {line}: derived block inside the one opened at line {open_at}")
        if len(m.group(2).split()) < 5:
            problems.append(f"line {line}: derived comment {m.group(2)!r} does not say where its figures come from")
        open_at = line
    return problems + ([f"line {open_at}: derived block never ended"] if open_at is not None else [])


@pytest.mark.parametrize("page", TIME_CHECKED)
def test_derived_blocks_are_closed_and_say_their_source(page):
    assert derived_block_problems((ROOT / page).read_text()) == []


def test_derived_block_problems_are_found():
    good = "<!-- derived: read off the trace at mid -->\nx 1 us\n<!-- end derived -->\n"
    assert derived_block_problems(good) == []
    assert derived_block_problems("<!-- derived: by hand -->\n1 us\n<!-- end derived -->") == [
        "line 1: derived comment 'by hand' does not say where its figures come from"]
    nested = good.replace("x 1 us", "<!-- derived: the inner block, read off a trace -->")
    assert derived_block_problems(nested + "<!-- end derived -->") == [
        "line 2: derived block inside the one opened at line 1", "line 4: end derived without a start"]
    assert derived_block_problems("<!-- derived: published in the DMA overview -->\n") == [
        "line 1: derived block never ended"]
    assert derived_block_problems("```\nx\n```\nsee `<!-- derived: ... -->` blocks\n") == []


def test_unchecked_time_figure_is_found(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "kernels.md").write_text("fwd 11.42 ms; `code 3 us`\n<!-- generated: headline -->\n"
                                                  "| 5 us |\n<!-- end generated -->\n<!-- derived: by hand -->\n"
                                                  "DMA 258.2 µs at HIGH\n<!-- end derived -->\nbwd 1.5 us, 295 ns "
                                                  "fixed, 2 μs (Greek mu); 3 nsteps\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert unchecked_time_figures("docs/kernels.md") == ["11.42 ms", "1.5 us", "295 ns", "2 μs"]


def test_cpu_overhead_quotes_follow_their_csv(tmp_path, monkeypatch):
    """The CPU-overhead quotes: a median, the dispatch difference, and the "all accept" claim, which turns into
    the refusing ops when a guard row says its kernel refused the shapes."""
    (tmp_path / "cpu_overhead.csv").write_text(
        "case,variant,median,served\nguard,rope_hf,15.71,True\nguard,router_topk,9.9,False\n"
        "dispatch,op,73.85,\ndispatch,direct,47.09,\n")
    monkeypatch.setattr(docs_tables, "DATA", tmp_path)
    assert docs_tables.cpu_median("guard", "rope_hf")() == "15.7"
    assert docs_tables.cpu_difference("dispatch", "op", "direct")() == "27"
    assert docs_tables.cpu_all_served("all accept")() == "do not all accept these shapes: refused by router_topk"
    (tmp_path / "cpu_overhead.csv").write_text("case,variant,median,served\nguard,rope_hf,15.71,True\n")
    assert docs_tables.cpu_all_served("all accept")() == "all accept"


def test_stale_quote_is_rewritten_in_place(tmp_path, monkeypatch):
    (tmp_path / "r.csv").write_text("case,mid,frac\na,1234.5,0.953\n")
    monkeypatch.setattr(docs_tables, "DATA", tmp_path)
    q = docs_tables.Quote("p.md", "fwd {} µs ({} of the\nbound)", "r.csv",
                          (docs_tables.csv_cell("r.csv", "mid", {"case": "a"}, "{:,.1f}"),
                           docs_tables.csv_cell("r.csv", "frac", {"case": "a"}, "{:.1%}")))
    page = "x fwd 999.0 µs (**12.5%** of the\n  bound) y"  # line break inside the sentence is kept
    assert docs_tables.refresh_quote(page, q) is None  # the template's "(" before {} is not "(**"
    q = docs_tables.Quote("p.md", "fwd {} µs ({} of the bound)", "r.csv", q.value)
    assert docs_tables.refresh_quote("x fwd 999.0 µs (12.5% of the\n  bound) y", q) == \
        "x fwd 1,234.5 µs (95.3% of the\n  bound) y"
    assert docs_tables.refresh_quote("fwd 1 µs (2% of the bound), fwd 3 µs (4% of the bound)", q) is None


def test_docs_tables_rewrites_every_quote_after_a_rerun(tmp_path, monkeypatch):
    """After a benchmark re-run changes its CSV, one run of the script brings every quote up to date."""
    for page in {q.page for q in docs_tables.QUOTES}:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text((ROOT / page).read_text())
    read_csv = docs_tables.read_csv
    rows = read_csv(docs_tables.HEADLINE_CSV)
    for row in rows:
        row["mid_us"] = str(float(row["mid_us"]) * 1.5)
        row["fraction_mid"] = str(float(row["fraction_mid"]) / 1.5)
    monkeypatch.setattr(docs_tables, "read_csv",
                        lambda name: rows if name == docs_tables.HEADLINE_CSV else read_csv(name))
    monkeypatch.setattr(docs_tables, "ROOT", tmp_path)
    assert len(docs_tables.wrong_quotes()) >= 3  # rope, router, moe in README, rope in kernels.md
    assert docs_tables.refresh_quotes() == [] and docs_tables.wrong_quotes() == []
    rope = next(r for r in rows if r["case"] == "rope_fwd")
    assert f"fwd {float(rope['mid_us']):,.0f} µs" in (tmp_path / "README.md").read_text()


# ------------------------------------------------------------------------------------------ snippets that run
PYTHON_SNIPPET = re.compile(r"^([ \t]*)```python\n(.*?)^\1```", re.S | re.M)  # also indented (in a list)
# a python block followed by a paragraph "prints ...:" and an unlabelled block: what that python block prints
PRINTS_BLOCK = re.compile(r"\n+prints[^\n]*:\n\n```\n(.*?)```", re.S)


def python_snippets(path: Path) -> list[tuple[int, str]]:
    """(line number, code) of every ```python block of a page, in order, indented ones dedented."""
    return [(line, code) for line, code, _ in python_snippets_and_output(path)]


def python_snippets_and_output(path: Path) -> list[tuple[int, str, list[str] | None]]:
    """(line number, code, documented output lines or None) of every ```python block of a page, in order:
    the output is the block after it when the page says it ``prints`` it."""
    import textwrap

    text = path.read_text()
    out = []
    for m in PYTHON_SNIPPET.finditer(text):
        printed = PRINTS_BLOCK.match(text, m.end())
        out.append((text[:m.start()].count("\n") + 2, textwrap.dedent(m.group(2)),
                    printed.group(1).splitlines() if printed else None))
    return out


def output_problem(documented: list[str], printed: list[str]) -> str | None:
    """None when ``printed`` is what the page shows: the same lines, or, when the documented block ends
    with a ``...`` line, the same first lines."""
    if documented[-1:] == ["..."]:
        ok, printed = printed[:len(documented) - 1] == documented[:-1], printed[:len(documented) - 1]
    else:
        ok = printed == documented
    return None if ok else "prints\n" + "\n".join(printed) + "\nnot what the page shows\n" + "\n".join(documented)


PAGES_WITH_SNIPPETS = [p for p in DOC_FILES if python_snippets(p)]


@pytest.mark.parametrize("path", PAGES_WITH_SNIPPETS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_snippets_run_as_written(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Every ```python block of README.md and docs/*.md runs as written, a page's blocks in order in one
    namespace (a block may use what an earlier block of the same page defined), from an empty folder; a
    block the page says ``prints`` an output block (``prints:``, then the block) prints exactly that."""
    import contextlib
    import copy
    import io

    from trnkit.overrides import registry

    monkeypatch.setattr(registry, "_REGISTRY", copy.deepcopy(registry._REGISTRY))  # pages register impls
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace: dict = {"__name__": "__main__"}
    for line, code, documented in python_snippets_and_output(path):
        where = f"{path.relative_to(ROOT)}, snippet at line {line}"
        stdout = io.StringIO()
        try:
            with contextlib.redirect_stdout(stdout):
                exec(compile(code, f"{path.relative_to(ROOT)}:{line}", "exec"), namespace)  # noqa: S102
        except Exception as e:  # noqa: BLE001 - any error of a snippet fails the test, named
            pytest.fail(f"{where}: {type(e).__name__}: {e}")
        problem = documented and output_problem(documented, stdout.getvalue().splitlines())
        assert not problem, f"{where}: {problem}"


def test_printed_output_blocks_are_found_and_compared():
    outputs = {p.relative_to(ROOT).as_posix(): [d for _, _, d in python_snippets_and_output(p) if d]
               for p in PAGES_WITH_SNIPPETS}
    assert outputs["docs/overrides.md"][0][0].startswith("trnkit overrides (policy fallback)")
    assert outputs["docs/qwen3.md"][0][0].startswith("Qwen3 checkpoint out/ does not match the config")
    assert output_problem(["a", "..."], ["a", "b", "c"]) is None and output_problem(["a", "b"], ["a", "b"]) is None
    assert output_problem(["a"], ["a", "b"]) and output_problem(["a", "..."], ["b", "a"])


def test_snippet_finder_sees_every_python_block():
    assert len(python_snippets(ROOT / "README.md")) == 3
    assert sum(len(python_snippets(p)) for p in DOC_FILES) >= 14
    assert any("scoring=\"sigmoid\"" in code for _, code in python_snippets(ROOT / "docs" / "kernels.md"))
    assert python_snippets(ROOT / "docs" / "trainer.md") == []  # bash / toml blocks are not Python


# ------------------------------------------------------------------------------------------ the docs site
def test_every_docs_page_is_in_the_site_navigation():
    nav = set(re.findall(r":\s*([\w.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    assert nav == {p.name for p in (ROOT / "docs").glob("*.md")} | {"index.md"}


def test_docs_site_builds_with_strict(tmp_path: Path):
    """`mkdocs build --strict` (the docs extra): no broken page link, anchor or configuration warning."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    import subprocess

    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(site)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    home = (site / "index.html").read_text()
    assert "Quick start" in home and 'href="trainer/"' in home  # the README, its docs/ links made relative
    for page in ("trainer", "kernels", "interpreter", "benchmarks"):
        assert (site / page / "index.html").is_file()


def test_cost_model_demo_block_is_what_the_demo_prints():
    """docs/cost-model.md shows ``python -m trnkit demo``'s output; the estimate in it must be today's (the
    wall time on its first line aside): a cost-model change that moves the demo's figures must re-run it."""
    from trnkit.demo import format_result, run

    text = (ROOT / "docs" / "cost-model.md").read_text()
    block = re.search(r"```\n(trnkit demo: tiled matmul .*?)```", text, re.S)
    assert block, "docs/cost-model.md lost its demo output block"
    wall = re.compile(r"\(\d+\.\d+ s wall\)")
    documented = wall.sub("(wall)", block.group(1)).strip().splitlines()
    printed = wall.sub("(wall)", format_result(run())).strip().splitlines()
    assert documented == printed


def test_readme_layout_names_paths_that_exist():
    """README.md's Layout block: every path that starts a line is in the repository."""
    block = output_block("README.md", "trnkit/nki_api.py")
    paths = [line.split()[0] for line in block if line and not line[0].isspace()]
    assert len(paths) >= 10 and [p for p in paths if not (ROOT / p).exists()] == []


# ------------------------------------------------------------------------------------------ error messages
# trainer.md's error-message blocks are what the trainer prints: each documented line is made here from the
# input that gives it and compared whole. The trainer prints "error: <message> (--debug or TRNKIT_DEBUG=1 shows
# the traceback)"; the page leaves the hint out (it says every message ends with it), so it is checked and cut
# here. The only elision: a run-specific path, written /path/... (a plugin's file) or .../ (a checkpoint folder).
DEBUG_HINT = " (--debug or TRNKIT_DEBUG=1 shows the traceback)"


def output_block(page: str, first: str) -> list[str]:
    """The lines of the unlabelled block of ``page`` whose first line starts with ``first`` (an indented
    block, in a list, dedented)."""
    import textwrap

    m = re.search(rf"^([ \t]*)```\n(\1{re.escape(first)}.*?)^\1```", (ROOT / page).read_text(), re.S | re.M)
    assert m, f"{page} lost its output block starting {first!r}"
    return textwrap.dedent(m.group(2)).splitlines()


def trainer_error(args: list[str], tmp_path: Path) -> str:
    """What ``python -m trnkit.harness.train ARGS`` prints on stderr (in this process), the hint cut. A run
    that did not stop at the mistake fails here after one step, never trains on."""
    import contextlib
    import io

    from trnkit.harness.train import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["--job.dump_folder", str(tmp_path / "never"), "--training.steps", "1", *args])
    printed = err.getvalue()
    assert code == 2 and printed.endswith(DEBUG_HINT + "\n"), (code, printed)
    return printed[:-len(DEBUG_HINT) - 1]


def caught(call) -> str:
    """``error: <message>`` of the TrnkitError ``call()`` raises, as the trainer prints it (hint cut)."""
    from trnkit.errors import TrnkitError

    with pytest.raises(TrnkitError) as e:
        call()
    return f"error: {e.value}"


def test_trainer_config_error_block_is_what_the_trainer_prints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import json

    from trnkit.harness.config import load_config
    from trnkit.harness.models import build_spec

    monkeypatch.chdir(tmp_path)
    printed = [trainer_error(["--config", "debug_moe_nki", *args], tmp_path) for args in (
        ["--training.stpes", "20"], ["--training.steps", "ten"],
        ["--overrides.ops", "rope_hf,moe_experts", "--overrides.impl", "nkix"])]
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun --nproc_per_node 2 sets it
    printed.append(trainer_error(["--config", "debug_moe", "--parallelism.data_parallel_shard_degree", "2",
                                  "--parallelism.tensor_parallel_degree", "2"], tmp_path))
    # a checkpoint folder whose config.json has transformers' default RoPE base; the run builds the model
    # before it loads weights (seconds), so the message comes from the same loader the run calls
    folder = tmp_path / "ckpt"
    folder.mkdir()
    hf = json.loads((ROOT / "configs" / "hf" / "qwen3-moe-debug" / "config.json").read_text())
    hf["rope_parameters"]["rope_theta"] = 10000.0
    (folder / "config.json").write_text(json.dumps(hf))
    spec = build_spec(load_config(ROOT / "configs" / "debug_moe.toml"))
    printed.append(caught(lambda: spec.state_dict_adapter.load_hf(str(folder))).replace(str(folder), "..."))
    assert output_block("docs/trainer.md", "error: config: unknown key") == printed


def test_trainer_stack_error_block_is_what_the_trainer_prints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The page's example: a lock of torch 2.13.0+cpu and transformers 5.24.0 where torch 2.14.0+cpu is
    installed and transformers is not (the installed stack is replaced, so the block does not depend on this
    machine's versions)."""
    from trnkit import envinfo

    locked = {**envinfo.current_stack(), "torch": "2.13.0+cpu", "transformers": "5.24.0"}
    installed = {**locked, "torch": "2.14.0+cpu", "transformers": envinfo.NOT_INSTALLED}
    monkeypatch.setattr(envinfo, "current_stack", lambda components=envinfo.LOCK_COMPONENTS:
                        {c: installed[c] for c in components})
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stack.lock").write_text(envinfo.lock_text(locked))
    printed = trainer_error(["--config", "debug_moe", "--job.stack", "stack.lock"], tmp_path)
    assert output_block("docs/trainer.md", "error: job.stack:") == printed.splitlines()


def test_trainer_loss_schedule_error_block_is_what_the_trainer_prints(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    printed = [trainer_error(["--config", config, "--training.loss_schedule", "fused"], tmp_path)
               for config in ("debug_moe", "debug_moe_hf")]  # no loss kernel swapped in; a transformers model
    assert output_block("docs/trainer.md", "error: config training.loss_schedule:") == printed


def test_trainer_finished_job_block_is_what_the_trainer_prints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]):
    """trainer.md's rerun of a finished job: the main job's config (its dump folder, 20 steps, checkpoints), run
    twice. What the message does not name is made small so that 20 steps take seconds: the model's sizes
    (the Qwen3 tokenizer's vocabulary kept), one play's first 40 kB as the corpus, reference ops instead of
    the kernels, no HF export, no plot."""
    import tomllib

    from trnkit.harness.config import from_dict, to_toml
    from trnkit.harness.data import shakespeare_files
    from trnkit.harness.train import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "play.txt").write_text(Path(shakespeare_files()[0]).read_text()[:40_000])
    job = tomllib.loads((ROOT / "configs" / "debug_moe_nki.toml").read_text())
    del job["overrides"]
    job["model"]["config"] = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
                              "hidden_dim": 64, "num_experts": 4, "top_k": 2, "moe_inter_dim": 32}
    job["data"]["dataset"] = str(tmp_path / "corpus")
    job["training"].update(local_batch_size=1, seq_len=32)
    job["checkpoint"]["export_hf"] = False
    job["metrics"].update(plot=False, progress_bar=False, progress_freq=0)
    (tmp_path / "job.toml").write_text(to_toml(from_dict(job)))
    assert main(["--config", "job.toml"]) == 0
    capsys.readouterr()
    assert main(["--config", "job.toml"]) == 0
    printed = capsys.readouterr().out.splitlines()
    first = next(i for i, line in enumerate(printed) if "nothing to train" in line)
    assert output_block("docs/trainer.md", "[trnkit] nothing to train:") == printed[first:first + 3]


PLUGIN_CHECKS = """\"\"\"A plugin whose constraint function cannot decide.\"\"\"
import examples.my_kernels as ex
from trnkit.overrides import register


def my_checks(x, w_router, top_k, **_):
    if top_k > 0:
        # ... a check that cannot tell
        raise RuntimeError("cannot tell")
    return []


register("router_topk", "mine", ex.router_fwd, backward=ex.router_bwd, constraints=my_checks, has_backward=True)
"""


def test_trainer_plugin_error_block_is_what_the_trainer_prints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import copy
    import importlib

    from trnkit.overrides import registry

    monkeypatch.setattr(registry, "_REGISTRY", copy.deepcopy(registry._REGISTRY))
    monkeypatch.syspath_prepend(str(ROOT))  # examples.my_kernels: the repository's examples package
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken_kernels.py").write_text("import torch\n\nraise RuntimeError('no device here')\n")
    (tmp_path / "exiting_kernels.py").write_text("import sys\n\nsys.exit(0)\n")
    printed = [trainer_error(["--config", "debug_moe_nki", "--overrides.plugins", name], tmp_path)
               for name in ("my_pkg.my_kernels", "broken_kernels", "exiting_kernels")]
    # the constraint function raises when the run first checks the model's shapes (after building it):
    # called here as the registry calls it
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "kernels.py").write_text(PLUGIN_CHECKS)
    before = set(sys.modules)
    try:
        importlib.import_module("my_pkg.kernels")
        entry = registry.get_impl("router_topk", "mine")
        printed.append(caught(lambda: entry.check(x=None, w_router=None, top_k=8)))
    finally:  # a later test imports examples.my_kernels again to register its impls in the real registry
        for name in set(sys.modules) - before:
            if name.startswith(("my_pkg", "examples")):
                del sys.modules[name]
    printed = [line.replace(str(tmp_path), "/path") for line in printed]
    assert output_block("docs/trainer.md", "error: config overrides.plugins:") == printed


def test_trainer_step_line_is_the_trainers_format():
    """trainer.md's example step line: its values are an example, its layout is trnkit.harness.metrics'."""
    from trnkit.harness.metrics import format_line

    documented = output_block("docs/trainer.md", "step: 12 ")
    assert documented == [format_line(12, 7.81234, 1.2345, 1.55, 6.60, 312, 0.08, None)]


# ------------------------------------------------------------------------------------------ commands that parse
# Every command of a ```bash block is checked as written, short of running it (most train or sweep for minutes):
# its program is one this repository provides and its arguments are ones that program accepts. Python entry
# points run in this process up to their argument parser's return (``argparse``: the parse as written, errors
# included; the trainer: its config parser with the file and every ``--section.key value``); pytest commands
# name test paths that exist, plugins that import and registered markers; ``bash scripts/run.sh X`` has an X
# branch and is checked as the command that branch runs. Commands of other programs are listed in EXTERNAL.
BASH_BLOCK = re.compile(r"^([ \t]*)```(?:bash|sh|shell)\n(.*?)^\1```", re.S | re.M)
EXTERNAL = {  # (program, first argument): not this repository's; the docs name what they need
    ("git", "clone"),  # the nki-library checkout of the conformance run (docs/interpreter.md)
    ("export", "NKILIB_SRC=/path/to/nki-library"),
}
RUN_SH = {  # scripts/run.sh's branches, as the commands they run (the argv after `python`)
    "train": ["-m", "trnkit.harness.train", "--config", "configs/debug_moe_nki.toml"],
    "test": ["-m", "pytest", "-m", "not slow", "-n", "2", "-q"],
    "demo": ["-m", "trnkit", "demo"],
}


def shell_commands(path: Path) -> list[tuple[int, list[str]]]:
    """(line number, words) of every command of a page's ```bash blocks: continuation lines joined,
    comments dropped, split as the shell does (shlex)."""
    import shlex

    text = path.read_text()
    out = []
    for m in BASH_BLOCK.finditer(text):
        first = text[:m.start()].count("\n") + 2
        lines = m.group(2).splitlines()
        k = 0
        while k < len(lines):
            start, line = k, lines[k]
            while line.rstrip().endswith("\\") and k + 1 < len(lines):
                k += 1
                line = line.rstrip()[:-1] + " " + lines[k]
            k += 1
            words = shlex.split(line, comments=True)
            if words:
                out.append((first + start, words))
    return out


class _Parsed(Exception):
    """Raised once an entry point's argument parser returned: the command parsed as written."""


def _python_argv(words: list[str]) -> list[str] | None:
    """The argv after `python` of a command that runs Python (env assignments, `nice -n N`, `torchrun
    [--opt value]` and a venv's python allowed in front), or None for any other program."""
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # PYTHONPATH=$PWD ...
        words = words[1:]
    if words[:2] == ["nice", "-n"]:
        words = words[3:]
    if words[:1] == ["torchrun"]:
        rest = words[1:]
        while rest and rest[0].startswith("--") and rest[0] != "-m":
            assert rest[0] in ("--nproc_per_node", "--nnodes", "--standalone"), f"torchrun option {rest[0]}"
            rest = rest[1:] if rest[0] == "--standalone" else rest[2:]
        return rest
    if words and (words[0] == "python" or words[0].endswith("/bin/python")):
        return words[1:]
    return None


def _pytest_problems(args: list[str]) -> list[str]:
    """What a `python -m pytest ARGS` command names that is not there: a path, a plugin, a marker."""
    import importlib
    import tomllib

    markers = {m.split(":")[0] for m in tomllib.loads((ROOT / "pyproject.toml").read_text())
               ["tool"]["pytest"]["ini_options"]["markers"]}
    problems, k = [], 0
    while k < len(args):
        a = args[k]
        if a in ("-m", "-p", "-n", "-k"):
            value, k = args[k + 1], k + 2
            if a == "-m":
                unknown = set(re.findall(r"\w+", value)) - {"and", "or", "not"} - markers
                problems += [f"-m {value!r}: marker {u!r} is not registered in pyproject.toml" for u in unknown]
            elif a == "-p":
                try:
                    importlib.import_module(value)
                except ImportError as e:
                    problems.append(f"-p {value}: {e}")
            elif a == "-n":
                try:
                    importlib.import_module("xdist")
                except ImportError:
                    problems.append("-n needs pytest-xdist, which is not installed")
            continue
        k += 1
        if a in ("-q", "-v", "-x", "-ra"):
            continue
        if a.startswith("-"):
            problems.append(f"option {a}: not one this check knows (add it to _pytest_problems)")
        elif not (ROOT / a.split("::")[0]).exists():
            problems.append(f"{a}: no such test path")
    return problems


def _entry_point_problem(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> str | None:
    """Run ``python ARGV`` in this process up to its argument parse; the parser's complaint, or None."""
    import argparse
    import contextlib
    import importlib.util
    import io
    import runpy

    if argv[:2] == ["-m", "pytest"]:
        return "; ".join(_pytest_problems(argv[2:])) or None
    if argv[:2] == ["-m", "trnkit.harness.train"]:  # not argparse: its config parser, file and overrides
        from trnkit.harness.config import ConfigError, parse_args

        try:
            parse_args(argv[2:])
        except (ConfigError, SystemExit, OSError, ValueError) as e:
            return f"{type(e).__name__}: {e}"
        return None
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    if argv[0] == "-m":
        monkeypatch.setattr(sys, "argv", [argv[1], *argv[2:]])
        spec = importlib.util.find_spec(argv[1])
        if spec is None:
            return f"-m {argv[1]}: no such module"
        # the module that runs as __main__ (a package's __main__) runs afresh, as under python -m
        monkeypatch.delitem(sys.modules, argv[1] + ".__main__" if spec.submodule_search_locations else argv[1],
                            raising=False)
        run = lambda: runpy.run_module(argv[1], run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        script = ROOT / argv[0]
        if not script.is_file():
            return f"{argv[0]}: no such script"
        monkeypatch.setattr(sys, "argv", [str(script), *argv[1:]])
        monkeypatch.syspath_prepend(str(script.parent))
        run = lambda: runpy.run_path(str(script), run_name="__main__")  # noqa: E731
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            run()
    except _Parsed:
        return None
    except SystemExit as e:  # a parser that parses only what it knows (parse_known_args) may run to the end
        return None if e.code in (0, None) else f"exit {e.code}: {err.getvalue().strip()[-500:]}"
    return "returned without parsing arguments with argparse: this check cannot tell what it accepts"


def command_problem(words: list[str], monkeypatch: pytest.MonkeyPatch) -> str | None:
    """None when the command ``words`` runs as written (module comment above), else what is wrong."""
    if words[:2] == ["bash", "scripts/run.sh"]:
        branch = words[2] if len(words) > 2 else "test"
        script = (ROOT / "scripts" / "run.sh").read_text()
        if branch not in RUN_SH or not re.search(rf"^\s*{re.escape(branch)}\)", script, re.M):
            return f"scripts/run.sh has no branch {branch!r}"
        return _entry_point_problem(RUN_SH[branch] + words[3:], monkeypatch)
    argv = _python_argv(words)
    if argv is None:
        return None if tuple(words[:2]) in EXTERNAL else f"{words[0]}: not a program this check knows"
    return _entry_point_problem(argv, monkeypatch)


COMMANDS = [(p, line, words) for p in DOC_FILES for line, words in shell_commands(p)]


@pytest.mark.parametrize("path, line, words", COMMANDS,
                         ids=[f"{p.relative_to(ROOT).as_posix()}:{n}" for p, n, _ in COMMANDS])
def test_bash_commands_parse_as_written(path: Path, line: int, words: list[str], monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(ROOT)
    problem = command_problem(words, monkeypatch)
    assert problem is None, f"{path.relative_to(ROOT)}:{line}: `{' '.join(words)}`: {problem}"


def test_command_finder_sees_every_bash_command():
    by_page = {p.relative_to(ROOT).as_posix(): len(shell_commands(p)) for p in DOC_FILES}
    assert by_page["README.md"] >= 2 and by_page["docs/benchmarks.md"] >= 21 and by_page["docs/trainer.md"] >= 3
    assert by_page["docs/interpreter.md"] >= 9 and sum(by_page.values()) == len(COMMANDS) >= 39
    torchrun = next(w for _, _, w in COMMANDS if w[0] == "torchrun")  # a command continued over two lines
    assert torchrun[-2:] == ["--training.local_batch_size", "1"]
    assert not any("#" in w for _, _, w in COMMANDS for w in w)  # comments dropped


# Commands written inline in a sentence (`python -m ...` in backticks) are checked the same way, except a span
# that shows usage rather than a command (a placeholder: <config>, KERNEL, ..., [--option]) and a span that names
# a program in a sentence rather than giving a command to run (INLINE_NAMES).
INLINE_COMMAND = re.compile(r"`((?:python|torchrun|bash scripts/run\.sh) [^`\n]*)`")
USAGE = re.compile(r"<|\.\.\.|\[|\b[A-Z]{2,}\b")
INLINE_NAMES = {"python -m trnkit", "python -m trnkit.bench step", "python -m trnkit.bench calibrate",
                "python -m trnkit.harness.plot", "torchrun --nproc_per_node 2"}


def inline_commands(path: Path) -> list[str]:
    """The inline commands of a page that run as written (outside fenced blocks), a trailing ``> file``
    dropped."""
    text = FENCED.sub("", path.read_text())
    spans = [m.group(1) for m in INLINE_COMMAND.finditer(text)]
    return [re.sub(r"\s*>\s*\S+$", "", s) for s in spans if s not in INLINE_NAMES and not USAGE.search(s)]


INLINE = [(p, c) for p in DOC_FILES for c in inline_commands(p)]


@pytest.mark.parametrize("path, command", INLINE, ids=[f"{p.relative_to(ROOT).as_posix()}:{c}" for p, c in INLINE])
def test_inline_commands_parse_as_written(path: Path, command: str, monkeypatch: pytest.MonkeyPatch):
    import shlex

    monkeypatch.chdir(ROOT)
    problem = command_problem(shlex.split(command), monkeypatch)
    assert problem is None, f"{path.relative_to(ROOT)}: `{command}`: {problem}"


def test_inline_command_finder():
    readme = inline_commands(ROOT / "README.md")
    assert "python -m trnkit env --lock" in readme  # `... > stack.lock` without its redirect
    assert "python -m trnkit.harness.train --config <config>" not in readme  # usage, not a command
    assert len(INLINE) >= 50


@pytest.mark.parametrize("command, problem", [
    ("python -m trnkit.bench step --flavor 0.6B --seq 4096 --lcn 2", "unrecognized arguments: --lcn 2"),
    ("python -m trnkit.bench --mode sideways", "invalid choice: 'sideways'"),
    ("python benchmarks/headline.py --lst", "unrecognized arguments: --lst"),
    ("python benchmarks/no_such_script.py", "no such script"),
    ("python -m trnkit.no_such_module", "no such module"),
    ("python -m trnkit.harness.train --config configs/debug_moe_nki.toml --training.stpes 20", "unknown key"),
    ("bash scripts/run.sh deploy", "scripts/run.sh has no branch 'deploy'"),
    ("bash scripts/run.sh test tests/no_such_folder", "tests/no_such_folder: no such test path"),
    ("python -m pytest -m 'slow and nightly' tests", "marker 'nightly' is not registered"),
    ("curl https://example.com", "curl: not a program this check knows"),
])
def test_a_command_that_would_not_run_is_caught(command: str, problem: str, monkeypatch: pytest.MonkeyPatch):
    import shlex

    monkeypatch.chdir(ROOT)
    found = command_problem(shlex.split(command), monkeypatch)
    assert found is not None and problem in found, found


# ------------------------------------------------------------------------------------------ config snippets
TOML_BLOCK = re.compile(r"^([ \t]*)```toml\n(.*?)^\1```", re.S | re.M)


def toml_snippets(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every ```toml block of a page, indented ones dedented."""
    import textwrap

    text = path.read_text()
    return [(text[:m.start()].count("\n") + 2, textwrap.dedent(m.group(2))) for m in TOML_BLOCK.finditer(text)]


def toml_problem(text: str) -> str | None:
    """None when ``text`` is a trainer config fragment that loads as written: TOML, applied onto the defaults
    by the trainer's own loader and validated (plugins imported, impls registered); else the error."""
    import tomllib

    from trnkit.harness.config import ConfigError, from_dict

    try:
        from_dict(tomllib.loads(text)).validate()
    except (tomllib.TOMLDecodeError, ConfigError) as e:
        return f"{type(e).__name__}: {e}"
    return None


TOML_SNIPPETS = [(p, line, text) for p in DOC_FILES for line, text in toml_snippets(p)]


@pytest.mark.parametrize("path, line, text", TOML_SNIPPETS,
                         ids=[f"{p.relative_to(ROOT).as_posix()}:{n}" for p, n, _ in TOML_SNIPPETS])
def test_toml_snippets_are_trainer_configs_that_load_as_written(path: Path, line: int, text: str,
                                                                 monkeypatch: pytest.MonkeyPatch):
    import copy

    from trnkit.overrides import registry

    monkeypatch.setattr(registry, "_REGISTRY", copy.deepcopy(registry._REGISTRY))  # plugins register impls
    monkeypatch.chdir(ROOT)  # plugins = ["examples.my_kernels"]: the repository's examples package
    monkeypatch.syspath_prepend(str(ROOT))
    before = set(sys.modules)
    try:
        problem = toml_problem(text)
    finally:  # a plugin imported here registers again where a later test imports it (into the real registry)
        for name in set(sys.modules) - before:
            if name.startswith("examples"):
                del sys.modules[name]
    assert problem is None, f"{path.relative_to(ROOT)}:{line}: {problem}"


def test_toml_finder_sees_every_block_and_a_bad_one_is_caught():
    assert len(toml_snippets(ROOT / "docs" / "trainer.md")) >= 3  # one indented (in a list)
    assert any('loss_schedule = "fused"' in text for _, _, text in TOML_SNIPPETS)  # the indented one
    assert "unknown key training.stpes" in toml_problem("[training]\nstpes = 20\n")
    assert "TOMLDecodeError" in toml_problem("[training\nsteps = 20\n")
    assert "policy" in toml_problem('[overrides]\nops = ["rope_hf"]\npolicy = "sometimes"\n')


# ------------------------------------------------------------------------------------------ the config reference
KEY_ROW = re.compile(r"^\| `(\w+)\.(\w+)` \| (`[^|]*`|unset) \|", re.M)


def documented_keys() -> dict[str, str]:
    """``{section.key: default cell}`` of trainer.md's "Every key" table."""
    text = (ROOT / "docs" / "trainer.md").read_text().split("### Every key", 1)[1].split("\n## ", 1)[0]
    return {f"{sec}.{key}": default for sec, key, default in KEY_ROW.findall(text)}


def default_cell(value) -> str:
    """A default as the table writes it: TOML as the trainer's ``--help`` prints it, ``unset`` for None."""
    import tomli_w

    if value is None:
        return "unset"
    if value == {}:
        return "`{}`"
    return "`" + tomli_w.dumps({"v": value})[len("v = "):].strip() + "`"


def test_every_config_key_is_documented_with_its_default():
    """trainer.md's "Every key" table has one row per field of every ``[section]`` of the trainer's config, in
    the dataclasses' order, each with the default the trainer uses; no row names a key that does not exist."""
    import dataclasses

    from trnkit.harness.config import TrainerConfig

    cfg = TrainerConfig()
    expected = {f"{sec.name}.{f.name}": default_cell(getattr(getattr(cfg, sec.name), f.name))
                for sec in dataclasses.fields(cfg) for f in dataclasses.fields(getattr(cfg, sec.name))}
    documented = documented_keys()
    assert list(documented) == list(expected)
    assert documented == expected


def test_config_key_table_check_sees_a_wrong_default():
    assert default_cell(8e-4) == "`0.0008`" and default_cell("off") == '`"off"`' and default_cell(None) == "unset"
    assert default_cell([]) == "`[]`" and default_cell({}) == "`{}`" and default_cell(True) == "`true`"
    assert len(documented_keys()) >= 70

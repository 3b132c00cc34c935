"""``python -m trnkit conformance``: arguments that cannot work are refused before any case runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from trnkit.__main__ import main


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(["conformance", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing ran: not even the "N cases" line
    return err


def test_csv_that_names_a_folder_is_refused_and_nothing_is_written(tmp_path: Path, capsys) -> None:
    before = sorted(tmp_path.parent.iterdir())
    err = _refused(capsys, ["--csv", str(tmp_path), "-k", "core/max"])
    assert f"--csv {str(tmp_path)!r}: must name a file, not a folder" in err
    assert sorted(tmp_path.parent.iterdir()) == before  # no <folder>.tmp / .lock beside it
    assert list(tmp_path.iterdir()) == []


def test_csv_inside_a_file_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("x")
    err = _refused(capsys, ["--csv", str(tmp_path / "notes.txt" / "rows.csv"), "-k", "core/max"])
    assert f"its folder {str(tmp_path / 'notes.txt')!r} is a file" in err
    assert (tmp_path / "notes.txt").read_text() == "x"


def test_filter_that_selects_nothing_is_refused(capsys) -> None:
    err = _refused(capsys, ["-k", "no-such-kernel-xyz", "--list"])
    assert "-k 'no-such-kernel-xyz': no case of the 'unit' tier" in err and "--list shows them" in err


def test_a_filter_that_selects_cases_lists_them(capsys) -> None:
    assert main(["conformance", "-k", "core/max", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and all("core/max" in line for line in lines)

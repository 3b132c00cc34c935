"""``python -m trnkit.bench --device`` guard and ``calibrate`` on a synthetic measured CSV (no Trainium here:
the "measurements" are the cost model's own estimates under a known non-default parameter setting)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from trnkit.bench import calibrate
from trnkit.bench.__main__ import main
from trnkit.bench.cases import cases_for
from trnkit.bench.schema import Row, write_rows
from trnkit.nkisim import cost, cost_params, trace

# The DMA fixed cost at its pessimistic end: the parameter two matmul_tiled sizes pin down (the others
# trade off against each other on two points, so only this one is asserted to come back).
TRUE = replace(cost_params.MID, dma_fixed_ns=cost_params.HIGH.dma_fixed_ns)


def _measured_rows(tmp_path):
    rows = []
    for case in cases_for("matmul_tiled", quick=True, modes=("forward",)):
        with trace.record(trace_only=True) as tr:
            case.build().nki()
        ns = cost.estimate_total(list(tr), "trn2", TRUE)
        rows.append(Row(kernel=case.kernel, impl="nki", mode=case.mode, metric="wall_time", unit="us",
                        x_name=case.x_name, x_value=case.x_value, p50=ns / 1e3, p20=ns / 1e3, p80=ns / 1e3,
                        extra=json.dumps(case.config), device="trainium", timestamp="t", trnkit_version="0"))
    return write_rows(tmp_path / "measured.csv", rows, append=False), len(rows)


def test_device_flag_needs_the_real_nki(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["matmul_tiled", "--device", "--quick"])
    assert exc.value.code == 2
    assert "--device needs the real nki" in capsys.readouterr().err


def test_calibrate_recovers_the_parameters_behind_synthetic_measurements(tmp_path, capsys):
    csv_path, n = _measured_rows(tmp_path)
    out = tmp_path / "fitted.json"
    assert main(["calibrate", str(csv_path), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    m = re.search(r"mean \|log\(estimate / measured\)\|: before ([0-9.]+), after ([0-9.]+)", text)
    before, after = float(m.group(1)), float(m.group(2))
    assert n == 2 and before > 0.1 and after < 0.01
    fitted = json.loads(out.read_text())
    assert fitted["dma_fixed_ns"] == TRUE.dma_fixed_ns
    assert "NOT TESTED ON HARDWARE" in text


def test_calibrate_rejects_a_csv_without_measurements_and_the_real_nki(tmp_path, monkeypatch, capsys):
    est = Row(kernel="matmul_tiled", impl="nki", mode="forward", metric="est_time", unit="us", x_name="M=N=K",
              x_value=512, p50=1.0, p20=1.0, p80=1.0, extra="{}", device="trn2 (cost model)", timestamp="t",
              trnkit_version="0")
    path = write_rows(tmp_path / "est.csv", [est], append=False)
    with pytest.raises(ValueError, match="no measured kernel rows"):
        calibrate.measured_points(path)
    # the CLI says so in one line (exit 2, no traceback), as it does for a file that is not there
    for csv_arg, message in ((path, "no measured kernel rows"), (tmp_path / "none.csv", "No such file")):
        with pytest.raises(SystemExit) as e:
            calibrate.main([str(csv_arg), "--out", str(tmp_path / "fit.json")])
        assert e.value.code == 2
        assert message in capsys.readouterr().err
    import trnkit.nki_api

    monkeypatch.setattr(trnkit.nki_api, "REAL_NKI", True)
    with pytest.raises(RuntimeError, match="TRNKIT_NKI=sim"):
        calibrate.measured_points(path)
    with pytest.raises(ValueError, match="no measured points"):
        calibrate.fit([])

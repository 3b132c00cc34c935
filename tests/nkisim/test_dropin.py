"""Drop-in use: an unmodified NKI script / test suite doing `import nki` runs on the interpreter via
`python -m trnkit.nkisim run`, the pytest plugin, or install_as_nki()."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import trnkit.nkisim as nkisim
from trnkit.nkisim import install_as_nki, nki_installed

REPO = Path(__file__).resolve().parents[2]

# Written the way users write NKI 0.6 kernels: nothing from trnkit, legacy typing import included.
USER_KERNEL = textwrap.dedent('''
    import sys

    import numpy as np
    import nki
    import nki.isa as nisa
    import nki.language as nl
    import neuronxcc.nki.typing as nt
    from nki.isa.constants import oob_mode


    @nki.jit
    def scale_rows(x: nt.tensor[128, 64], out: nt.mutable_tensor, factor):
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x, oob_mode=oob_mode.error)
        y = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y, data=t, op0=nl.multiply, operand0=factor)
        nisa.dma_copy(dst=out, src=y)
        return out
''')

SCRIPT = USER_KERNEL + textwrap.dedent('''

    if __name__ == "__main__":
        factor = float(sys.argv[1])
        x = np.arange(128 * 64, dtype=np.float32).reshape(128, 64) / 64
        out = np.zeros_like(x)
        nki.simulate(scale_rows)(x, out, factor)
        print("backend", nki.__name__, "checksum", float(out.sum()))
''')

TEST_FILE = textwrap.dedent('''
    import numpy as np
    import nki
    from user_kernel import scale_rows


    def test_user_kernel_scales():
        x = np.ones((128, 64), np.float32)
        out = np.zeros_like(x)
        scale_rows(x, out, 3.0)
        assert nki.__name__ == "trnkit.nkisim"
        np.testing.assert_array_equal(out, 3 * x)
''')


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_python_m_trnkit_nkisim_runs_an_unmodified_script(tmp_path: Path) -> None:
    (tmp_path / "user_script.py").write_text(SCRIPT)
    res = _run(["-m", "trnkit.nkisim", "run", "user_script.py", "2.5"], tmp_path)
    assert res.returncode == 0, res.stderr
    x = np.arange(128 * 64, dtype=np.float32).reshape(128, 64) / 64
    want = float((x * np.float32(2.5)).sum())
    backend, checksum = res.stdout.split()[1], float(res.stdout.split()[3])
    assert backend == "trnkit.nkisim" and checksum == pytest.approx(want, rel=1e-6)


def test_pytest_plugin_runs_an_unmodified_test_suite(tmp_path: Path) -> None:
    (tmp_path / "user_kernel.py").write_text(USER_KERNEL)
    (tmp_path / "test_user.py").write_text(TEST_FILE)
    res = _run(["-m", "pytest", "-q", "-p", "trnkit.nkisim.pytest_plugin", "-p", "no:cacheprovider",
                "--rootdir", str(tmp_path), "test_user.py"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 passed" in res.stdout


def test_install_and_uninstall_restore_sys_modules() -> None:
    before = {k: sys.modules.get(k) for k in ("nki", "nki.isa", "neuronxcc", "neuronxcc.nki.typing")}
    with nki_installed():
        import nki
        import nki.isa as nisa
        from neuronxcc.nki.typing import float8_e4m3, tensor
        from nki.isa import constants

        assert nki is nkisim and nisa.nc_stream_shuffle is nkisim.isa.nc_stream_shuffle
        assert constants.oob_mode is nkisim.isa.oob_mode and repr(tensor[128, 4]) == "nt.tensor[128, 4]"
        assert float8_e4m3 == nkisim.language.float8_e4m3
        uninstall = install_as_nki()  # a second install nests and undoes only itself
        uninstall()
        assert sys.modules["nki"] is nkisim
    assert {k: sys.modules.get(k) for k in before} == before


def test_nki_api_does_not_mistake_the_installed_interpreter_for_real_nki(monkeypatch) -> None:
    from trnkit import nki_api

    with nki_installed():
        monkeypatch.delenv("TRNKIT_NKI", raising=False)
        nki, _, _, real = nki_api._resolve()
        assert nki is nkisim and real is False
        monkeypatch.setenv("TRNKIT_NKI", "real")
        with pytest.raises(ImportError, match="is trnkit's interpreter"):
            nki_api._resolve()


def test_runner_usage_error() -> None:
    with pytest.raises(SystemExit):
        from trnkit.nkisim.__main__ import main

        main(["run"])

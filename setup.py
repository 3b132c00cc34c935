"""The wheel's package list (everything else is in pyproject.toml): every package under trnkit/, plus the
repository's configs/ and examples/ folders shipped as trnkit.configs and trnkit.examples (pyproject.toml's
package-dir maps them), so `--config debug_moe_nki` finds a config from any folder."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["trnkit*"]), "trnkit.configs", "trnkit.examples"])

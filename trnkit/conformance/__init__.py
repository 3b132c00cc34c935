"""Conformance of trnkit's NKI interpreter with AWS's nki-library kernels and tests.

``python -m trnkit conformance`` (with ``NKILIB_SRC`` pointing at a checkout of
https://github.com/aws-neuron/nki-library) runs nki-library's core kernels on the interpreter, at the
shapes, inputs and tolerances of nki-library's own tests, against nki-library's own torch references,
and prints one row per case. See :mod:`.harness` (how a case runs) and :mod:`.cases` (which cases).
"""

from .harness import Case, Row, format_table, nkilib_root, run_cases, write_csv

__all__ = ["Case", "Row", "format_table", "nkilib_root", "run_cases", "write_csv"]

"""trnkit's shared benchmark harness: kernel cases -> cost-model estimates and measured times ->
one CSV schema, a markdown table, PNG plots. CLI: ``python -m trnkit.bench --quick``."""

from trnkit.bench.harness import Case, Prepared, run_case, run_cases, time_quantiles
from trnkit.bench.schema import COLUMNS, Row, read_rows, write_rows
from trnkit.bench.table import markdown_table

__all__ = ["COLUMNS", "Case", "Prepared", "Row", "markdown_table", "read_rows", "run_case", "run_cases",
           "time_quantiles", "write_rows"]

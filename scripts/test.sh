#!/usr/bin/env bash
# Sets everything up, test extras included (scripts/setup.sh --test), checks the code with ruff and
# mypy (pyproject.toml's [tool.ruff] and [tool.mypy]; a finding fails the run before any test), and
# runs the test suite. Extra arguments go to pytest.
# The default run skips tests marked slow; PAGEDKV_SLOW=1 (as in CI) runs the slow tier too.
# The suite runs in two phases: the tests not marked `serial` in PAGEDKV_TEST_JOBS processes
# (pytest-xdist; default 2, one per core of a CI machine), then the `serial` ones (they time their
# work, or start servers and replicas that need the CPU) in one process. PAGEDKV_TEST_JOBS=1 runs
# everything in one process, in one phase.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh" --test
cd "$root"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
.venv/bin/ruff check
.venv/bin/mypy  # about a minute from a clean checkout, seconds with its cache (.mypy_cache)
tier="not slow"
if [ "${PAGEDKV_SLOW:-0}" = "1" ]; then
    tier="slow or not slow"
fi
jobs="${PAGEDKV_TEST_JOBS:-2}"
if [ "$jobs" = "1" ]; then
    exec .venv/bin/python -m pytest -m "$tier" -q "$@"
fi
# pytest exits 5 when a phase selects no test (arguments naming only serial tests, or none): not a failure.
status=0
.venv/bin/python -m pytest -n "$jobs" --dist loadfile -m "($tier) and not serial" -q "$@" || status=$?
[ "$status" = "5" ] && status=0
serial=0
.venv/bin/python -m pytest -m "($tier) and serial" -q "$@" || serial=$?
[ "$serial" = "5" ] && serial=0
if [ "$status" != "0" ]; then exit "$status"; fi
exit "$serial"

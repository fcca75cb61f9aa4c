#!/usr/bin/env bash
# Set up (idempotent) and run the test suite: lint, format check, then the unit, multi-process and CLI tests.
# --tier long runs the long end-to-end runs instead (a minute or so each), --tier all both; CI runs the two.
set -euo pipefail
cd "$(dirname "$0")/.."
# PARAMBOX_TESTS_SET_UP=1: the setup and the lint have run already (CI's second tier)
if [ "${PARAMBOX_TESTS_SET_UP:-0}" != 1 ]; then
  python -m pip install -q torch==2.13.0            # the CPU wheel; an unpinned torch pulls a multi-GB CUDA build
  python -m pip install -q -e ".[dev]"
  python -m ruff check parambox tests
  python -m ruff format --check parambox tests
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_osc="${OMPI_MCA_osc:-^ucx}"
# One pytest worker more than the cores, a test file each: many tests wait on their own workers, paced
# runs and SLURM's clock (with one a core the cores were idle for a tenth of the suite); a test marked solo
# runs alone, and tests marked lock(NAME) one at a time (tests/conftest.py).
python -m pytest -q -p no:benchmark -n "${PARAMBOX_TEST_WORKERS:-$(($(nproc) + 1))}" --dist loadfile \
  --durations=25 "$@"

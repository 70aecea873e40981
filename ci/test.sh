#!/usr/bin/env bash
# The README's two commands: `bash ci/test.sh L0` runs the L0 kit as CI does (with its report in
# reports/), `bash ci/test.sh all` runs every test. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=${1:-L0}
shift || true
bash ci/setup.sh
if [ "${KIT_SYSTEM_PYTHON:-0}" = "1" ]; then py=${PYTHON:-python3}; else py=${KIT_VENV:-.venv}/bin/python; fi
case "$tier" in
  L0|L1|L2) select=(-m "$tier") ;;
  all) select=() ;;
  *) echo "ci/test.sh: unknown tier '$tier' (expected L0, L1, L2 or all)" >&2; exit 2 ;;
esac
export PYTHONUNBUFFERED=1
set +e
"$py" -m pytest "${select[@]}" --kit-report=reports --junitxml=reports/junit.xml "$@"
rc=$?
set -e
if [ "$rc" -eq 0 ] && [ -f reports/kit-report.json ]; then
  # The shared session stays leak-free: no process outlived its test, and the pytest process
  # did not grow across the rank tests beyond the bounds in megatron_testkit/session_check.py.
  "$py" -m megatron_testkit.session_check reports/kit-report.json || rc=1
fi
if [ "$rc" -eq 5 ]; then
  echo "ci/test.sh: pytest collected no tests for '$tier': that is a failure here" >&2
  exit 1
fi
exit "$rc"

#!/usr/bin/env bash
# The README's two commands: `bash ci/test.sh L0` runs the L0 kit as CI does (with its report in
# reports/), `bash ci/test.sh all` runs every test. Extra arguments go to pytest.
# The megatron-core release is KIT_MEGATRON_CORE (ci/setup.sh; default the newest). `all` then runs
# the L0 megatron-dependent tests (MCORE_MATRIX_TESTS: the compat layer and the four functional
# megatron tests) again on each release in KIT_MEGATRON_MATRIX (default 0.16.1, the oldest
# supported), each in its own venv, report in reports/mcore-<release>/.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=${1:-L0}
shift || true
py=$(bash ci/setup.sh)
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
# The version matrix: the same megatron tests on the other supported releases (`all` only).
if [ "$tier" = "all" ] && [ "$rc" -eq 0 ] && [ "${KIT_SYSTEM_PYTHON:-0}" != "1" ]; then
  MCORE_MATRIX_TESTS=(unit/test_megatron_compat.py unit/test_megatron_compat_training.py
    functional/test_cp_pretrain_sft.py functional/test_pp_memory.py functional/test_tensor_inspect.py
    functional/test_attention_cp.py)
  for release in ${KIT_MEGATRON_MATRIX-0.16.1}; do
    echo "ci/test.sh: megatron-core $release: ${MCORE_MATRIX_TESTS[*]}" >&2
    mpy=$(KIT_MEGATRON_CORE=$release KIT_VENV='' bash ci/setup.sh)
    out=reports/mcore-$release
    set +e
    "$mpy" -m pytest -m L0 "${MCORE_MATRIX_TESTS[@]}" --kit-report="$out" --junitxml="$out/junit.xml" "$@"
    rc=$?
    set -e
    if [ "$rc" -eq 0 ]; then "$mpy" -m megatron_testkit.session_check "$out/kit-report.json" || rc=1; fi
    [ "$rc" -eq 0 ] || exit "$rc"
  done
fi
exit "$rc"

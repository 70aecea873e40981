#!/usr/bin/env bash
# The README's two commands: `bash ci/test.sh L0` runs the L0 kit as CI does (with its report in
# reports/), `bash ci/test.sh all` runs every test. Extra arguments go to pytest.
# `bash ci/test.sh bench [args]` runs the benchmarks instead (`python -m ci bench [args]`, the
# nightly bench row). With HYPOTHESIS_PROFILE=explore (the nightly properties row) the run draws a
# fresh hypothesis seed unless the arguments give --hypothesis-seed: it is printed and passed to
# pytest as --hypothesis-seed=N, so the report's session pytest_args record it for `ci repro`.
# The megatron-core release is KIT_MEGATRON_CORE (ci/setup.sh; default the newest). `all` then runs
# the L0 megatron-dependent tests (MCORE_MATRIX_TESTS: the compat layer, the FLOPs tests that read
# megatron-core configs, and the four functional megatron tests) again on each release in KIT_MEGATRON_MATRIX (default 0.16.1, the oldest
# supported), each in its own venv, report in reports/mcore-<release>/.
# Tests run on KIT_TEST_WORKERS xdist workers (default 2, the CI runner's cores, on a CPU machine;
# 1 runs them in one process), whole files to a worker (module fixtures run once), under the kit's memory admission:
# a launch waits until its ranks' budgets fit in the runner's memory (KIT_HOST_MEMORY on the CPU
# rows), so parallel workers cannot cross it (docs/ci.md).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=${1:-L0}
shift || true
py=$(bash ci/setup.sh)
# The suite starts hundreds of interpreters (nested sessions, warm parents, cold ranks, CLI
# commands), and where Python may not write bytecode (PYTHONDONTWRITEBYTECODE, set on the CI
# machines) each compiled this repository's modules again: a fifth of a launcher test file's CPU.
# Compiled once here instead (compileall skips what is up to date; Python checks each source's
# mtime, so an edited file is never run stale). A syntax error is left for pytest to report.
"$py" -m compileall -q -j 0 megatron_testkit accounting ci fixtures unit functional conftest.py >/dev/null 2>&1 || true
case "$tier" in
  L0|L1|L2) select=(-m "$tier") ;;
  all|bench) select=() ;;
  *) echo "ci/test.sh: unknown tier '$tier' (expected L0, L1, L2, all or bench)" >&2; exit 2 ;;
esac
export PYTHONUNBUFFERED=1
# Default: 2 on a CPU machine (ci/jobs.py's CPU_WORKERS), 1 where a GPU is (the GPU rows' one).
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then default_workers=1; else default_workers=2; fi
workers=${KIT_TEST_WORKERS:-$default_workers}
case "$workers" in
  1) parallel=() ;;
  ''|*[!0-9]*|0) echo "ci/test.sh: KIT_TEST_WORKERS='$workers': expected a whole number of workers >= 1" >&2; exit 2 ;;
  *) parallel=(-n "$workers" --dist loadfile) ;;
esac
# Declared skips (megatron_testkit/skips.py): on a machine without a GPU, the CPU rows' set, so a
# skip for anything this machine should have (megatron-core, nvdlfw-inspect, matplotlib) fails.
# A CI row sets its own; KIT_ALLOWED_SKIPS= (empty) allows none; on a GPU machine it stays unset.
if [ -z "${KIT_ALLOWED_SKIPS+set}" ] && ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  KIT_ALLOWED_SKIPS=$("$py" -c 'from ci.jobs import CPU_ALLOWED_SKIPS; print(",".join(CPU_ALLOWED_SKIPS))')
  export KIT_ALLOWED_SKIPS
fi
if [ "$tier" = "bench" ]; then
  exec "$py" -m ci bench "$@"
fi
# An exploring run's seed: drawn here, printed, and given to pytest (recorded in the report).
seed=()
if [ "${HYPOTHESIS_PROFILE:-}" = "explore" ] && ! printf '%s\n' "$@" | grep -q -- '^--hypothesis-seed'; then
  drawn=$("$py" -c 'import secrets; print(secrets.randbits(32))')
  echo "ci/test.sh: hypothesis profile explore, seed $drawn (a failure reruns with: python -m ci repro --from-report reports/kit-report.json, which passes --hypothesis-seed=$drawn)" >&2
  seed=("--hypothesis-seed=$drawn")
fi
set +e
"$py" -m pytest "${select[@]}" "${parallel[@]}" --kit-report=reports --junitxml=reports/junit.xml "$@" "${seed[@]}"
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
    unit/test_flops.py unit/test_flops_mla.py unit/test_flops_hybrid.py unit/test_flops_gdn.py unit/test_flops_dsa.py
    functional/test_cp_pretrain_sft.py functional/test_pp_memory.py functional/test_tensor_inspect.py
    functional/test_attention_cp.py)
  for release in ${KIT_MEGATRON_MATRIX-0.16.1}; do
    echo "ci/test.sh: megatron-core $release: ${MCORE_MATRIX_TESTS[*]}" >&2
    mpy=$(KIT_MEGATRON_CORE=$release KIT_VENV='' bash ci/setup.sh)
    out=reports/mcore-$release
    # What an older release lacks: the tests of what the newest added (e.g. megatron>=0.19).
    matrix_env=()
    if [ -n "${KIT_ALLOWED_SKIPS+set}" ]; then
      older=$("$py" -c 'import sys; from ci.jobs import release_skips; print(",".join(release_skips(sys.argv[1])))' "$release")
      matrix_env=("KIT_ALLOWED_SKIPS=${KIT_ALLOWED_SKIPS:+$KIT_ALLOWED_SKIPS,}$older")
    fi
    set +e
    env "${matrix_env[@]}" "$mpy" -m pytest -m L0 "${parallel[@]}" "${MCORE_MATRIX_TESTS[@]}" --kit-report="$out" --junitxml="$out/junit.xml" "$@" "${seed[@]}"
    rc=$?
    set -e
    if [ "$rc" -eq 0 ]; then "$mpy" -m megatron_testkit.session_check "$out/kit-report.json" || rc=1; fi
    [ "$rc" -eq 0 ] || exit "$rc"
  done
fi
exit "$rc"

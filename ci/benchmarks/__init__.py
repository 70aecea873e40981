"""pytest-benchmark benchmarks: ``python -m pytest ci/benchmarks --benchmark-only`` (see ci/bench_compare.py)."""

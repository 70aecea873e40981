"""pytest-benchmark benchmarks, outside the L0 time (each also carries the L2 tier marker).

    python -m pytest ci/benchmarks --benchmark-only --benchmark-storage=reports/benchmarks --benchmark-autosave
    python -m ci.bench_compare reports/benchmarks    # ratios within the run, against the previous runs

Each group pairs the kit's code (``extra_info["role"] = "subject"``) with what it is compared
with in the same run (``"baseline"``); `ci.bench_compare` compares those ratios, never absolute
times, because shared runners are noisy.
"""

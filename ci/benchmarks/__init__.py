"""pytest-benchmark benchmarks, outside the L0 time (each also carries the L2 tier marker).

    python -m ci bench [--compare BASELINE] [pytest args]    # runs all of them, saves the run, compares

Each group pairs the kit's code (``extra_info["role"] = "subject"``) with what it is compared
with in the same run (``"baseline"``); `ci.bench_compare` compares those ratios, never absolute
times, because shared runners are noisy. Figures for people go in ``extra_info`` (printed after
the run).
"""

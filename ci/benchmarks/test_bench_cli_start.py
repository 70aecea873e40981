"""`python -m accounting flops --preset llama3-8b` against a bare `python -c pass`: the start of a command that only does arithmetic.

The command imported torch to print arithmetic (2.3-5.5 s on a 2-core machine); it answers without
it now. Both are run as fresh interpreters, alternately, round by round (the order swapped every
round), and the ratio of their median wall times is recorded as
``extra_info["ratios"]["accounting flops / python -c pass"]`` (the goal: within 10x), what
`python -m ci bench` compares run against run. The medians (seconds) are printed.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.L2, pytest.mark.benchmark]

ROUNDS = 15
COMMANDS = {
    "accounting flops": [
        sys.executable,
        "-m",
        "accounting",
        "flops",
        "--preset",
        "llama3-8b",
        "--seq-len",
        "8192",
    ],
    "accounting memory": [
        sys.executable,
        "-m",
        "accounting",
        "memory",
        "--preset",
        "llama3-8b",
        "--seq-len",
        "8192",
    ],
    "python -c pass": [sys.executable, "-c", "pass"],
}


def _wall(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    return time.perf_counter() - start


def test_cli_start(benchmark, capsys) -> None:
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}

    def one_round() -> None:
        names = list(COMMANDS)
        if len(times["python -c pass"]) % 2:
            names.reverse()
        for name in names:
            times[name].append(_wall(COMMANDS[name]))

    benchmark.pedantic(one_round, rounds=ROUNDS, warmup_rounds=1)
    medians = {name: statistics.median(values) for name, values in times.items()}
    bare = medians["python -c pass"]
    ratios = {
        f"{name} / python -c pass": medians[name] / bare for name in COMMANDS if name != "python -c pass"
    }
    benchmark.extra_info.update({"medians_s": medians, "ratios": ratios})
    with capsys.disabled():
        print()
        for name, value in medians.items():
            print(
                f"{name}: median {value * 1000:.0f} ms"
                + (f" ({value / bare:.1f}x python -c pass)" if value is not bare else "")
            )

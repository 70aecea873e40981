"""Loads the kit's pytest plugin and selects the hypothesis profile.

When the package is installed the `pytest11` entry point has already registered
`megatron_testkit.plugin` under that same name, so this line is then a no-op.
"""

import os

import pytest
from hypothesis import HealthCheck, settings

pytest_plugins = ["megatron_testkit.plugin"]

# The kit's fixtures (the megatron-core CPU layer's `use_cpu_shim` among them) come with its plugin.

# `ci`: derandomised and bounded, so a red CI run replays identically; `dev`: more examples.
settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=60,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=200, deadline=None)

# `explore`: the nightly properties row. New examples every run (derandomize off; the seed comes
# from `--hypothesis-seed=N`, which ci/test.sh draws and prints), many more of them, and the
# failing example printed as a `@reproduce_failure` blob. KIT_HYPOTHESIS_MAX_EXAMPLES sets how
# many; the default 1500 per property runs the unit properties in minutes on a 2-core runner.
EXPLORE_MAX_EXAMPLES_ENV = "KIT_HYPOTHESIS_MAX_EXAMPLES"
EXPLORE_MAX_EXAMPLES = 1500


def _max_examples(raw: str) -> int | None:
    """The example count `raw` names, None when it names none."""
    return int(raw) if raw.strip().isdigit() and int(raw) >= 1 else None


_explore_raw = os.environ.get(EXPLORE_MAX_EXAMPLES_ENV, str(EXPLORE_MAX_EXAMPLES))
settings.register_profile(
    "explore",
    derandomize=False,
    max_examples=_max_examples(_explore_raw) or EXPLORE_MAX_EXAMPLES,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_configure(config: pytest.Config) -> None:
    """A bad KIT_HYPOTHESIS_MAX_EXAMPLES under the explore profile is a one-line usage error."""
    profile = config.getoption("hypothesis_profile", None) or os.environ.get("HYPOTHESIS_PROFILE")
    if profile == "explore" and _max_examples(_explore_raw) is None:
        raise pytest.UsageError(
            f"{EXPLORE_MAX_EXAMPLES_ENV}={_explore_raw!r}: expected a whole number of examples >= 1"
        )

"""Loads the kit's pytest plugin and selects the hypothesis profile.

When the package is installed the `pytest11` entry point has already registered
`megatron_testkit.plugin` under that same name, so this line is then a no-op.
"""

import os

from hypothesis import HealthCheck, settings

pytest_plugins = ["megatron_testkit.plugin"]

# ---- fixtures exposed to this repo's tests (one import line each; keep this section) ----
# The kit's CPU layer for megatron-core, as a fixture (a user's conftest.py can do the same).
from megatron_testkit.megatron_cpu import use_cpu_shim  # noqa: E402, F401  (scoped to the test)

# ---- end of exposed fixtures ----

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
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

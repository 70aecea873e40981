"""Loads the kit's pytest plugin and selects the hypothesis profile.

When the package is installed the `pytest11` entry point has already registered
`megatron_testkit.plugin` under that same name, so this line is then a no-op.
"""

import os

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
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

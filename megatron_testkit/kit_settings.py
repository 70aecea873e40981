"""Every setting of the kit in one table: its ``KIT_*`` environment variables, its ini options and
its command-line option, each with its default and meaning.

``docs/settings.md`` is generated from `SETTINGS` (``python -m megatron_testkit.kit_settings >
docs/settings.md``) and a test fails when the two differ. The table also says which variables the
kit sets for its own processes (``internal``) or which name a path of the machine that ran
(``machine_path``): a session's report never records those as settings of the run
(`megatron_testkit.repro_settings`). Stdlib only.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

ENV, INI, OPTION = "environment", "ini", "option"


@dataclass(frozen=True)
class KitSetting:
    """One setting: its name, where it is set (`ENV`, `INI`, `OPTION`), its default and meaning."""

    name: str
    where: str
    default: str
    meaning: str
    # Set by the kit for its own processes (ranks, xdist workers, nested sessions): never a
    # user's setting, never recorded in a report.
    internal: bool = False
    # A path of the machine that ran: a user's setting, but not recorded (it points nowhere else).
    machine_path: bool = False

    @property
    def recorded(self) -> bool:
        """Whether a session's report records it among the settings a repro restores."""
        return self.where == ENV and not (self.internal or self.machine_path)


SETTINGS: tuple[KitSetting, ...] = (
    # ---- launches ----
    KitSetting(
        "KIT_RANK_TIMEOUT",
        ENV,
        "300",
        "seconds a launch may run after its ranks' process groups are up (set-up not counted) when "
        "run_ranks gets no timeout=; past it every rank's stack is dumped and the launch fails as a hang",
    ),
    KitSetting(
        "KIT_STALL_WINDOW",
        ENV,
        "30",
        "seconds the ranks that wait for each other in collectives (the wait-for graph) may stay "
        "blocked before the launch fails as a hang (off: never); a test's stall_window marker and "
        "run_ranks(stall_window=) come first",
    ),
    KitSetting(
        "KIT_HEARTBEAT",
        ENV,
        "15",
        "seconds between a launch's progress lines once it has run 10 s since its start (where each "
        "rank waits, also while queued for admission, and how long it queued), on the terminal's "
        "stderr under pytest's capture; 0: none",
    ),
    KitSetting(
        "KIT_PG_TIMEOUT_S",
        ENV,
        "from the launch timeout",
        "the ranks' process-group timeout in seconds, set by the launcher for its ranks (80% of the "
        "launch timeout, at most 10 s under it, at least 5 s); megatron's model-parallel groups follow it",
    ),
    KitSetting(
        "KIT_SEED",
        ENV,
        "from the test id",
        "the seed of every launch (0 to 2**31-1) instead of the one derived from the test id; a "
        "failure's repro line and the report's seed column name it",
    ),
    KitSetting(
        "KIT_RANK_LOG_BYTES",
        ENV,
        "8MiB",
        "the cap on each rank's log (at least 64KiB): the first half as it comes, the last half kept",
    ),
    KitSetting(
        "KIT_TRACK_COLLECTIVES",
        ENV,
        "1",
        "0 stops counting each rank's torch.distributed collectives (hang verdicts name fewer waits)",
    ),
    # ---- memory ----
    KitSetting(
        "KIT_HOST_MEMORY",
        ENV,
        "unset",
        "the runner's memory for all ranks of a session (e.g. 7GB): the rank that pushes the ranks' "
        "summed RSS over it fails as oom, and admission shares it out (else the memory cgroup's limit, "
        "else MemAvailable)",
    ),
    KitSetting(
        "KIT_DEVICE_MEMORY",
        ENV,
        "unset",
        "a per-GPU cap (e.g. 40GiB) that each rank's CUDA allocator is held to, the card your CI promises",
    ),
    KitSetting(
        "KIT_CUDA_HOST_ALLOWANCE",
        ENV,
        "4GiB",
        "host RSS a CUDA rank may use beyond its memory_budget(host=...) (what CUDA and its libraries map)",
    ),
    KitSetting(
        "KIT_ADMISSION",
        ENV,
        "1",
        "0 turns memory admission off: every launch starts at once instead of waiting until its "
        "ranks' budgets fit in the runner's memory",
    ),
    KitSetting(
        "KIT_DEFAULT_RANK_MEMORY",
        ENV,
        "1GiB",
        "the memory admission counts for each rank of a test without a memory_budget",
    ),
    KitSetting(
        "KIT_RANK_CGROUP",
        ENV,
        "unset",
        "a memory cgroup's folder each rank joins first: the kernel enforces its limit and a rank it "
        "kills is named oom (python -m megatron_testkit repro sets it)",
        machine_path=True,
    ),
    # ---- skips, GPUs, golden values, CI ----
    KitSetting(
        "KIT_ALLOWED_SKIPS",
        ENV,
        "unset",
        "the capabilities this machine lacks (e.g. cuda,gpus,te): a skip for any other capability, or "
        "without one, fails the session; set (even empty), skips are grouped by capability",
    ),
    KitSetting(
        "KIT_REQUIRE_GPUS",
        ENV,
        "0",
        "the GPUs this machine promises: a gpu test that would skip for want of GPUs fails instead",
    ),
    KitSetting(
        "KIT_GOLDEN_PLATFORM",
        ENV,
        "from the ranks' device",
        "the platform key of golden files (e.g. cpu, h100) when the kit cannot name the runner's device",
    ),
    KitSetting(
        "KIT_CI_JOB",
        ENV,
        "unset",
        "the CI job's name, recorded in the report (session.ci_job) so that repro picks its row; the "
        "kit's GitHub Action sets it",
    ),
    KitSetting(
        "KIT_MACHINE_ADMISSION",
        ENV,
        "1",
        "0 turns the machine's admission ledger off: top-level sessions on one machine then admit their "
        "own runner's memory only, each as if alone",
    ),
    KitSetting(
        "KIT_MACHINE_ADMISSION_DIR",
        ENV,
        "<temp dir>/megatron-testkit-<uid>",
        "the folder of the machine's admission ledger that top-level sessions share (one per user and "
        "boot); refused with one warning unless it is yours and only you can write it",
        machine_path=True,
    ),
    KitSetting(
        "KIT_MACHINE_MEMORY",
        ENV,
        "MemAvailable",
        "the machine's memory that all top-level sessions' launches share (e.g. 20GiB); unset: "
        "MemAvailable within the cgroup's limit, measured again whenever no launch holds any",
    ),
    KitSetting(
        "KIT_WARM_START",
        ENV,
        "1",
        "0: every launch spawns its ranks as fresh interpreters; 1: ranks fork from the session's warm "
        "parent that imported torch once, unless the launch must start cold (docs/testkit.md, warm starts)",
    ),
    KitSetting(
        "KIT_WARM_PRELOAD",
        ENV,
        "unset",
        "comma-separated modules the warm parent imports besides torch and torch.distributed; one that "
        "fails to import is reported (WarmPreloadWarning, each launch's start_reason)",
    ),
    # ---- set by the kit for its own processes ----
    KitSetting(
        "KIT_WARM_ROOM",
        ENV,
        "set by the kit",
        "padding in the warm parent's environment: room for a forked rank to write its own over it",
        internal=True,
    ),
    KitSetting(
        "KIT_ADMISSION_TICKET",
        ENV,
        "set by the kit",
        "the launch's admission marker in each rank's environment (ticket, launcher, ledger): whoever "
        "reclaims a dead launcher's share ends only processes that carry it",
        internal=True,
    ),
    KitSetting(
        "KIT_MACHINE_ADMISSION_TICKET",
        ENV,
        "set by the kit",
        "the launch's marker in the machine's admission ledger, in each rank's environment",
        internal=True,
    ),
    KitSetting(
        "KIT_MACHINE_LEDGER",
        ENV,
        "set by the kit",
        "the machine's admission ledger, named to a top-level session's xdist workers (never to ranks)",
        internal=True,
    ),
    KitSetting(
        "KIT_OUTER_SESSION",
        ENV,
        "set by the kit",
        "the top-level session (pid and start ticks): a session below it keeps its private ledger",
        internal=True,
    ),
    KitSetting(
        "KIT_ADMISSION_DIR",
        ENV,
        "set by the kit",
        "the session's admission ledger, named to its xdist workers and to sessions a test runs inside it; "
        "sessions you start with one folder set share one ledger and one limit (docs/testkit.md)",
        internal=True,
    ),
    KitSetting(
        "KIT_RANK_SPEC",
        ENV,
        "set by the kit",
        "a rank's launch description, given to each rank",
        internal=True,
    ),
    KitSetting(
        "KIT_LAUNCHER_PID",
        ENV,
        "set by the kit",
        "the launcher's process id, given to each rank (its watchdog ends the rank when the launcher goes)",
        internal=True,
    ),
    KitSetting(
        "KIT_METRICS_DIR",
        ENV,
        "set by the kit",
        "where the kit_metrics fixture and the ranks write a test's metric lines",
        internal=True,
    ),
    KitSetting(
        "KIT_PER_TEST_NODE",
        ENV,
        "set by the kit",
        "the test id a rank of --kit-ranks-per-test runs in its own pytest session (per-test ranks "
        "are off there and it writes no report)",
        internal=True,
    ),
    # ---- pytest ini options ([tool.pytest.ini_options], pytest.ini, ...) ----
    KitSetting(
        "kit_leak_guard",
        INI,
        "ranks",
        "which tests the leak guard checks for leftover child processes and process groups: ranks "
        "(tests that launched ranks or are marked world_size/leak_guard), all, off",
    ),
    KitSetting(
        "kit_library_helpers",
        INI,
        "module:megatron.core.dist_checkpointing",
        "processes a library keeps for the life of a rank (one a line: module:PREFIX, a multiprocessing "
        "process started by that module's code; command:TEXT, in its command line): the leak guard ends "
        "them with the rank and warns once instead of counting them as leaked",
    ),
    KitSetting(
        "kit_skip_summary",
        INI,
        "false",
        "group skips by their declared capability in the terminal summary and the report, as "
        "KIT_ALLOWED_SKIPS does",
    ),
    KitSetting(
        "kit_warm_preload",
        INI,
        "none",
        "modules the warm parent imports besides torch and torch.distributed, one a line (as "
        "KIT_WARM_PRELOAD, which adds to it)",
    ),
    KitSetting(
        "kit_require_tier",
        INI,
        "false",
        "make a test without exactly one tier marker (L0, L1, L2) a collection error",
    ),
    KitSetting(
        "kit_ranks_per_test",
        INI,
        "0",
        "the default of --kit-ranks-per-test: each test on that many fresh ranks (0: off)",
    ),
    KitSetting(
        "kit_ranks_per_test_ids",
        INI,
        "none",
        "under --kit-ranks-per-test, the ranks of the tests whose id matches a glob, one 'GLOB = N' a "
        "line, the first match wins (a test's ranks_per_test(n) marker comes first), e.g. "
        "'tests/unit_tests/dist_checkpointing/* = 8'",
    ),
    KitSetting(
        "kit_cpu_shim",
        INI,
        "false",
        "where CUDA is absent, run the whole session inside the CPU layer (cpu_shim: NCCL groups get "
        "gloo, torch.cuda calls land on the CPU), in each per-test rank's session too; the report "
        "lists what it substituted (session.cpu_substitutions)",
    ),
    # ---- pytest command line ----
    KitSetting(
        "--kit-report",
        OPTION,
        "unset",
        "write DIR/kit-report.json and DIR/kit-report.md and keep every rank's log under "
        "DIR/logs/<session>/<test>/ (the report names them relative to DIR: rank_logs, and the Markdown "
        "and failure messages; log_dir keeps the absolute path of the machine that ran)",
    ),
    KitSetting(
        "--kit-ranks-per-test",
        OPTION,
        "0",
        "N: run each selected test (not one marked world_size, nor one that calls run_ranks) on N fresh "
        "ranks, each a pytest session of its own for that test with torchrun's environment "
        "(docs/testkit.md, per-test ranks); overrides the kit_ranks_per_test ini option",
    ),
)

NOT_RECORDED = tuple(s.name for s in SETTINGS if s.where == ENV and not s.recorded)

_HEADINGS = {
    ENV: "## Environment variables",
    INI: "## ini options",
    OPTION: "## Command-line option",
}
_INTROS = {
    ENV: "Set them in the job's `env:` (or your shell). A bad value is a one-line usage error at the session's "
    "start. The report records those a repro restores, never the ones the kit sets for itself.",
    INI: "In `[tool.pytest.ini_options]` of `pyproject.toml`, or `pytest.ini`.",
    OPTION: "Of `pytest`.",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """``docs/settings.md``: one table per kind of setting, in the order of `SETTINGS`."""
    lines = [
        "# Settings",
        "",
        "Every setting of the kit, with its default and what it does. Generated from",
        "`megatron_testkit/kit_settings.py` (`python -m megatron_testkit.kit_settings > docs/settings.md`);",
        "a test fails when this page and that table differ. This repository's own CI variables",
        "(`KIT_MEGATRON_CORE`, `KIT_TEST_WORKERS`, ...) are in [ci.md](ci.md).",
    ]
    for where in (ENV, INI, OPTION):
        lines += [
            "",
            _HEADINGS[where],
            "",
            _INTROS[where],
            "",
            "| name | default | meaning |",
            "|---|---|---|",
        ]
        for s in SETTINGS:
            if s.where == where:
                note = (
                    " Set by the kit for its own processes; never recorded in a report." if s.internal else ""
                )
                lines.append(f"| `{s.name}` | {_cell(s.default)} | {_cell(s.meaning)}.{note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())

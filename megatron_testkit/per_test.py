"""Per-test ranks: each test of a torchrun-style suite runs on N fresh ranks, unchanged.

With ``--kit-ranks-per-test=N`` (ini ``kit_ranks_per_test``), this process runs none of a selected
test's fixtures: it takes the test's runtest protocol and launches `per_test_rank.run_node` on N
fresh ranks through `run_ranks` (warm starts, admission, budgets, the stall rule and the verdict as
for any launch), without the kit's process group. Each rank runs that one test id in a pytest
session of its own (same rootdir, ini file, conftests and plugins) with torchrun's environment, so
the suite's own ``init_process_group`` sets up its groups. The test's report row is this process'
one row; a failing rank's error is the test's own report (assertion and traceback).

Which tests and how many ranks:

- a test marked ``world_size(n)`` launches its own ranks (`run_ranks`) and is never wrapped; nor is
  one whose function names ``run_ranks`` itself;
- a test marked ``ranks_per_test(n)`` gets n ranks; else the first line of the ini table
  ``kit_ranks_per_test_ids`` (``GLOB = n``, matched against the test id with `fnmatch`) that
  matches it; else N.

Session- and module-scoped fixtures run once per test (each test's session is its own).
"""

from __future__ import annotations

import fnmatch
import functools
import os
import socket
from typing import Any, NoReturn

import pytest

from megatron_testkit.per_test_rank import NODE_ENV

OPTION = "--kit-ranks-per-test"
INI = "kit_ranks_per_test"
TABLE_INI = "kit_ranks_per_test_ids"
SHIM_INI = "kit_cpu_shim"
MARKER = "ranks_per_test(n): the number of fresh ranks this test runs on under --kit-ranks-per-test"
# Options of the outer command line that a rank's session repeats (plugins, ini overrides, imports).
_FORWARDED = ("-p", "-o", "--override-ini", "--import-mode")


def add_options(parser: pytest.Parser, group: Any) -> None:
    """The mode's command-line option and ini keys, and the CPU layer's ini key (named as the
    constants above; written out here, where docs/settings.md's check reads them)."""
    group.addoption(
        "--kit-ranks-per-test",
        metavar="N",
        type=int,
        default=None,
        help="run each selected test on N fresh ranks, each rank a pytest session of its own for "
        "that test with torchrun's environment (a torchrun-style suite, unchanged); 0: off",
    )
    parser.addini("kit_ranks_per_test", "the default of --kit-ranks-per-test (0: off)", default="0")
    parser.addini(
        "kit_ranks_per_test_ids",
        "under --kit-ranks-per-test, the ranks of the tests whose id matches a glob, one 'GLOB = N' "
        "per line (the first match wins; a test's ranks_per_test(n) marker comes first)",
        type="linelist",
        default=[],
    )
    parser.addini(
        "kit_cpu_shim",
        "enter the CPU layer (megatron_testkit.megatron_cpu.cpu_shim) for the whole session where "
        "CUDA is absent: NCCL groups get gloo, torch.cuda calls land on the CPU (on in the ranks of "
        "--kit-ranks-per-test too)",
        type="bool",
        default=False,
    )


def inside_rank() -> bool:
    """True in the pytest session a per-test rank runs (the mode is off there, and no report)."""
    return bool(os.environ.get(NODE_ENV))


def ranks_setting(config: pytest.Config) -> int:
    """N of ``--kit-ranks-per-test`` (else the ini's); 0 inside a per-test rank or when off."""
    if inside_rank():
        return 0
    value = config.getoption(OPTION)
    where = OPTION
    if value is None:
        raw, where = str(config.getini(INI) or "0").strip(), f"{INI} in the pytest ini"
        try:
            value = int(raw)
        except ValueError:
            raise pytest.UsageError(f"{where} = {raw!r}: expected a number of ranks (0: off)") from None
    if value < 0:
        raise pytest.UsageError(f"{where} = {value}: expected a number of ranks (0: off)")
    return value


def parse_table(lines: list[str]) -> list[tuple[str, int]]:
    """``kit_ranks_per_test_ids``: (glob, ranks) per line; UsageError naming a bad line."""
    table = []
    for line in lines:
        glob, sep, count = line.rpartition("=")
        glob = glob.strip()
        if not sep or not glob or not count.strip().isdigit() or int(count) < 1:
            raise pytest.UsageError(
                f"{TABLE_INI}: {line!r} is not 'GLOB = N' (a test-id glob and a number of ranks)"
            )
        table.append((glob, int(count)))
    return table


class PerTestRanks:
    """The mode, registered as a plugin of the process that runs the tests (each xdist worker)."""

    def __init__(self, config: pytest.Config, ranks: int) -> None:
        from megatron_testkit.ranks import in_torchrun

        if in_torchrun():
            raise pytest.UsageError(
                f"{OPTION} launches ranks itself: run pytest directly, not under torchrun"
            )
        self.config = config
        self.ranks = ranks
        self.table = parse_table(config.getini(TABLE_INI))
        self.cpu_shim = bool(config.getini(SHIM_INI))

    def wraps(self, item: pytest.Item) -> bool:
        """Whether this test runs on per-test ranks (see the module docstring)."""
        if not isinstance(item, pytest.Function) or item.get_closest_marker("world_size") is not None:
            return False
        code = getattr(getattr(item, "function", None), "__code__", None)
        return not (code is not None and "run_ranks" in code.co_names)

    def ranks_for(self, item: pytest.Item) -> int:
        """The test's marker, else the first matching line of the ini table, else N."""
        mark = item.get_closest_marker("ranks_per_test")
        if mark is not None:
            value = mark.args[0] if mark.args else mark.kwargs.get("n")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise pytest.UsageError(f"{item.nodeid}: ranks_per_test(n) needs a number of ranks >= 1")
            return value
        for glob, count in self.table:
            if fnmatch.fnmatchcase(item.nodeid, glob):
                return count
        return self.ranks

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        """A wrapped test: its three phases without its fixtures, the call on its ranks."""
        if not self.wraps(item):
            return None
        from _pytest.runner import CallInfo

        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        reraise = (pytest.exit.Exception, KeyboardInterrupt)
        setup = CallInfo.from_call(functools.partial(_set_up, item), when="setup", reraise=reraise)
        phases = [setup]
        if setup.excinfo is None:
            phases.append(
                CallInfo.from_call(functools.partial(self.launch, item), when="call", reraise=reraise)
            )
        phases.append(CallInfo.from_call(lambda: None, when="teardown", reraise=reraise))
        for call in phases:
            report = ihook.pytest_runtest_makereport(item=item, call=call)
            ihook.pytest_runtest_logreport(report=report)
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def launch(self, item: pytest.Item) -> None:
        """Run the test on its ranks; its outcome here (skip and xfail included)."""
        __tracebackhide__ = True
        from megatron_testkit import per_test_rank, warm_start
        from megatron_testkit.ranks import run_ranks

        function = getattr(item, "function", None)
        rank_fn = (
            per_test_rank.run_node_megatron
            if warm_start.imports_megatron(function)
            else per_test_rank.run_node
        )
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), NODE_ENV: item.nodeid}
        results = run_ranks(
            rank_fn, self.ranks_for(item), args=(self.request(item),), env=env, process_group=False
        )
        outcomes = {result["outcome"] for result in results}
        if outcomes == {"skipped"}:
            _skip(results[0]["reason"])
        if "xfailed" in outcomes:
            pytest.xfail(next(r["reason"] for r in results if r["outcome"] == "xfailed"))

    def request(self, item: pytest.Item) -> dict[str, Any]:
        """What a rank's session needs: the test's path as an argument, the outer session's rootdir,
        ini file and forwarded options."""
        config = self.config
        path, _, rest = item.nodeid.partition("::")
        target = str(config.rootpath / path) + (f"::{rest}" if rest else "")
        args = [target, "-p", "no:cacheprovider", "--rootdir", str(config.rootpath)]
        if config.inipath is not None:
            args += ["-c", str(config.inipath)]
        args += _forwarded(list(config.invocation_params.args))
        if config.pluginmanager.hasplugin("xdist"):
            args += ["-n", "0"]  # the rank's session runs its one test itself
        return {"nodeid": item.nodeid, "args": args, "invocation_dir": str(config.invocation_params.dir)}


def _set_up(item: pytest.Item) -> None:
    """The kit's markers for the launch (budget, stall window, gpu gate) and the test's skip marks,
    read here; the test's fixtures run in its ranks."""
    from megatron_testkit.marker_context import apply_test_markers

    for mark in item.iter_markers("skip"):
        _skip(str(mark.kwargs.get("reason", mark.args[0] if mark.args else "unconditional skip")))
    apply_test_markers(item)


def _skip(reason: str) -> NoReturn:
    """Skip at the test's own location (``-rs`` names the test's file and line, not the line of
    pytest's runner the launcher raised from), as pytest does for a skip mark: the skip itself
    happened in the ranks, out of this traceback."""
    raise pytest.skip.Exception(reason, _use_item_location=True)


def _forwarded(args: list[str]) -> list[str]:
    """The outer command line's ``-p``, ``-o``/``--override-ini`` and ``--import-mode`` options."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name = next((o for o in _FORWARDED if arg == o or arg.startswith(o + "=")), None)
        if name is None and arg.startswith("-p") and len(arg) > 2 and not arg.startswith("--"):
            out.append(arg)  # -pname
        elif name is not None and arg == name and i + 1 < len(args):
            out += [arg, args[i + 1]]
            i += 1
        elif name is not None:
            out.append(arg)
        i += 1
    return out


def _free_port() -> int:
    """A TCP port free now on the loopback, for the ranks' ``MASTER_PORT`` (rank 0's store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])

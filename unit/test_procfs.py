"""megatron_testkit.procfs: what a descendant adds to a rank's memory is its private pages.

A real fork of a real process that holds 64 MiB: the child's RSS shows the shared pages, its
private pages only what it wrote since. The kernel (and so the runner) charges shared pages once.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_testkit import procfs

pytestmark = pytest.mark.L0

MiB = 2**20
FORKS = """
import os, sys
buf = bytearray(64 * 2**20)
buf[::4096] = b"x" * len(buf[::4096])  # resident in the parent before the fork
child = os.fork()
if child == 0:
    sys.stdin.readline()                 # measured sharing everything
    buf[::4096] = b"y" * len(buf[::4096])  # copy-on-write: every page becomes the child's own
    print("written", flush=True)
    sys.stdin.readline()
    os._exit(0)
print(child, flush=True)
os.waitpid(child, 0)
"""


def test_a_fork_adds_its_private_pages_not_the_pages_it_still_shares() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", FORKS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(proc.stdout.readline())
        shared_rss, shared_own = procfs.rss_bytes(child), procfs.unique_bytes(child)
        tree, _ = procfs.tree_rss(proc.pid)
        parent = procfs.rss_bytes(proc.pid)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "written"
        written_own = procfs.unique_bytes(child)
        proc.stdin.write("\n")
        proc.stdin.flush()
    finally:
        proc.wait(timeout=60)
    assert shared_rss >= 64 * MiB  # RSS counts the shared pages: summing it would count them twice
    assert shared_own < 16 * MiB  # the interpreter's few private pages at most
    assert parent >= 64 * MiB and tree - parent < 16 * MiB  # the tree: the parent, not its pages twice
    assert written_own >= 64 * MiB  # once written, the pages are the child's own

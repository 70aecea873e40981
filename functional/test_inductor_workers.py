"""A rank leaves no Inductor compile workers behind.

``torch.compile`` (Transformer Engine >= 2.10 compiles its std statistic with it) warms Inductor's
compile-worker pool: a sidecar process and its workers, shut down by an atexit handler. A rank ends
with ``os._exit``, so that handler never runs, and the sidecar outlived the rank: the launch
counted it as leaked and its workers' memory against the rank. Ranks get
``TORCHINDUCTOR_COMPILE_THREADS=1`` (compile in the rank's own process, no pool) unless the test
or the session sets it.
"""

from __future__ import annotations

import pytest

from megatron_testkit import attribution
from megatron_testkit.ranks import run_ranks

pytestmark = pytest.mark.L0


def warm_compile_pool(rank: int, world_size: int) -> int:
    # What Inductor's backend does on a first torch.compile (a plain compile here starts no pool).
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile

    AsyncCompile.warm_pool()
    return config.compile_threads


def compile_threads(rank: int, world_size: int) -> int:
    from torch._inductor import config

    return config.compile_threads


def test_a_rank_that_warms_the_compile_pool_leaves_no_process_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    threads = run_ranks(warm_compile_pool, 1)
    context = attribution.current()
    assert context is not None
    assert context.runs[-1].leaked_processes == 0  # the pool's sidecar outlived the rank
    assert threads == [1]


def test_a_tests_own_compile_threads_setting_reaches_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    assert run_ranks(compile_threads, 1, env={"TORCHINDUCTOR_COMPILE_THREADS": "3"}) == [3]
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "2")  # the session's setting wins too
    assert run_ranks(compile_threads, 1) == [2]

"""Step ``hang``: an NCCL collective that cannot complete is called a ``hang``, and its flight recorder read.

The collective's stream is held by a sleeping kernel, on a group with megatron's 30-minute
timeout; the flight-recorder dump requested through ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` is
collected and parsed into "collective #N not completed on rank 0". Each run writes into a folder of
its own (`fresh_run_dir`), so a rerun into the same OUTDIR never reads the previous run's dump.
The dry run instead diagnoses a real dump of a two-rank gloo desync (the CPU build writes the
same format).
Rank functions are module-level so `run_ranks` can import them by name in fresh processes.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ci.gpu_check.summary import expect

if TYPE_CHECKING:
    from ci.gpu_check.summary import CheckState


def hang_rank(rank: int, world_size: int, marker: str) -> None:
    """An all_reduce that cannot complete, on a group made as megatron makes its groups (30 min).

    The collective waits behind a kernel that spins for minutes; the host then polls it, as a
    training loop waiting on it would, without holding the GIL (the dump needs it for stacks).
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    group = dist.new_group(list(range(world_size)), timeout=timedelta(minutes=30))
    t = torch.ones(1024, device="cuda")
    dist.all_reduce(t, group=group)  # collective #1 completes
    torch.cuda.synchronize()
    torch.cuda._sleep(2**40)  # minutes of spinning on the current stream
    work = dist.all_reduce(t, group=group, async_op=True)  # #2: enqueued, never completes
    Path(marker).write_text("entered")
    while not work.is_completed():
        time.sleep(0.1)


def canned_desync_rank(rank: int, world_size: int, stem: str) -> bool:
    """A real two-rank desync on gloo: rank 0 enters all_reduce #2 of a subgroup; rank 1 dumps
    its flight recorder before entering it (then enters, so nothing hangs)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    sub = dist.new_group([0, 1], timeout=timedelta(minutes=30))
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.all_reduce(t, group=sub)
    dump = Path(f"{stem}{rank}")
    if rank == 0:
        work = dist.all_reduce(t, group=sub, async_op=True)
        dump.write_bytes(torch._C._distributed_c10d._dump_fr_trace())
        dist.barrier()
        work.wait()
    else:
        dump.write_bytes(torch._C._distributed_c10d._dump_fr_trace())
        dist.barrier()
        dist.all_reduce(t, group=sub)
    return True


def step(check: CheckState) -> dict[str, Any]:
    """On the GPU: the hang verdict and the dump taken while the collective is stuck."""
    from megatron_testkit import flight_recorder as fr

    fr_dir = fresh_run_dir(check.out / "flight_recorder")
    if check.dry:
        return canned_dump(check, fr_dir)
    env = fr.nccl_env(fr_dir)
    stem = env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"]
    marker = fr_dir / "entered"
    marker.unlink(missing_ok=True)
    outcome: dict[str, Any] = {}
    thread = threading.Thread(target=_launch, args=(env, marker, outcome), name="gpu-check-hang")
    thread.start()
    deadline = time.monotonic() + 40
    while not marker.exists() and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    expect(marker.exists(), "the hanging rank never reached its collective (see the launch's log)")
    time.sleep(2.0)  # the collective is enqueued and stuck
    asked = time.monotonic()
    dumps = fr.dump_before_kill(stem, [0], wait_s=15.0)
    figures: dict[str, Any] = {"dump_request": dumps[0], "dump_s": round(time.monotonic() - asked, 2)}
    thread.join()
    figures.update(verdict=outcome.get("verdict"), verdict_s=outcome.get("verdict_s"))
    (check.out / "hang_message.txt").write_text(outcome.get("message", ""))
    expect(outcome.get("verdict") == "rank 0 hang", f"an NCCL hang gave {outcome.get('verdict')}")
    expect(dumps[0] == "dumped", f"flight-recorder dump through the pipe: {dumps[0]}")
    figures.update(_diagnosis(stem), dump_dir=str(fr_dir))
    return figures


def fresh_run_dir(parent: Path) -> Path:
    """A new, empty folder under ``parent`` for this run's dumps, pipes and marker.

    `flight_recorder.wait_for_dumps` takes any readable ``<stem>0`` as the dump it asked for:
    rerun into the same OUTDIR, a previous run's dump would read as "dumped" at once and its
    trace be diagnosed as this run's. In a folder of its own no earlier file can be there.
    """
    import tempfile

    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="run-", dir=parent))


def _launch(env: dict[str, str], marker: Path, outcome: dict[str, Any]) -> None:
    """The hanging launch (in a thread, so the step can ask for the dump meanwhile); its verdict into `outcome`."""
    from megatron_testkit.ranks import RankFailure, run_ranks

    start = time.monotonic()
    try:
        run_ranks(hang_rank, 1, backend="nccl", args=(str(marker),), env=env, timeout=45)
        outcome["verdict"] = "passed"
    except RankFailure as failure:
        outcome.update(verdict=f"rank {failure.rank} {failure.kind}", message=str(failure))
    outcome["verdict_s"] = round(time.monotonic() - start, 2)


def _diagnosis(stem: str) -> dict[str, Any]:
    """The dump read back: it must show collective #2 not completed on rank 0."""
    from megatron_testkit import flight_recorder as fr

    traces = fr.read_dumps(stem, [0])
    lines = fr.diagnose(traces, world_size=1)
    expect(
        any("#2" in line and "not completed on rank(s) [0]" in line for line in lines),
        f"the dump does not show collective #2 stuck on rank 0: {lines}",
    )
    entries = [f"{e.group} #{e.seq} {e.op} {e.state}" for e in traces[0].entries][-4:]
    return {"diagnosis": lines, "entries": entries}


def canned_dump(check: CheckState, fr_dir: Path) -> dict[str, Any]:
    """Dry run: a real flight-recorder dump of a two-rank gloo desync, parsed and diagnosed."""
    from megatron_testkit import flight_recorder as fr
    from megatron_testkit.ranks import run_ranks

    env = fr.nccl_env(fr_dir)
    stem = str(fr_dir / "canned_rank")
    for rank in (0, 1):
        fr.dump_path(stem, rank).unlink(missing_ok=True)
    fr_env = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}
    timeout = min(180, check.remaining())
    run_ranks(canned_desync_rank, 2, backend="gloo", args=(stem,), env=fr_env, timeout=timeout)
    traces = fr.read_dumps(stem, [0, 1])
    lines = fr.diagnose(traces, world_size=2)
    expect(
        any(
            "rank(s) [0] entered collective #2" in line and "rank 1 at #1 never entered it" in line
            for line in lines
        ),
        f"the canned desync was not diagnosed: {lines}",
    )
    return {
        "nccl_env": env,
        "canned_dump_version": traces[0].version,
        "diagnosis": lines,
        "dump_dir": str(fr_dir),
    }

"""megatron_testkit.flight_recorder: the dump request through PyTorch's pipe, and reading real dumps.

The dumps here are real: the CPU build's gloo process groups record into PyTorch's flight
recorder and `torch._C._distributed_c10d._dump_fr_trace()` writes the same format NCCL's monitor
thread writes on a GPU. What cannot run here is NCCL's monitor thread itself; where a test needs
something to answer the pipe, a thread plays it with the protocol PyTorch's `DumpPipe` uses
(`mkfifo`, opened `O_RDONLY | O_NONBLOCK`, any bytes read mean "dump"), and says so.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_testkit import flight_recorder as fr

_ONE_RANK_RUN = """
import pickle
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo", store=dist.FileStore(out + "/store", 1), rank=0, world_size=1)
sub = dist.new_group([0], timeout=timedelta(seconds=60))
t = torch.ones(3, 5)
dist.all_reduce(t)
dist.broadcast(t, 0)
dist.all_reduce(t, group=sub)
# gloo marks a collective completed from its own thread, after the call returns: wait until both
# groups' last enqueued collective shows as completed, or the two dumps below can differ (an empty
# status is not "all completed": a loaded machine can dump before the groups report any).
deadline = time.monotonic() + 60
while True:
    status = pickle.loads(torch._C._distributed_c10d._dump_fr_trace()).get("pg_status", {})
    busy = [s for s in status.values() if s["last_enqueued_collective"] > 0]
    if len(busy) >= 2 and all(s["last_completed_collective"] == s["last_enqueued_collective"] for s in busy):
        break
    assert time.monotonic() < deadline, status
    time.sleep(0.01)
open(out + "/dump.pkl", "wb").write(torch._C._distributed_c10d._dump_fr_trace())
open(out + "/dump.json", "wb").write(torch._C._distributed_c10d._dump_fr_trace_json())
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def one_rank_dump(tmp_path_factory):
    """A real dump of a one-rank gloo run: 2 collectives on the default group, 1 on a subgroup.

    Made in a fresh interpreter: the recorder is a process-wide ring buffer that would also hold
    this pytest process' earlier collectives. The buffer size is set for releases before 2.8, which
    did not record by default.
    """
    out = tmp_path_factory.mktemp("fr")
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}
    run = subprocess.run(
        [sys.executable, "-c", _ONE_RANK_RUN, str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    return (out / "dump.pkl").read_bytes(), (out / "dump.json").read_bytes()


# ---- the environment ---------------------------------------------------------------------------
@pytest.mark.L0
def test_nccl_env_sets_both_names_of_every_setting_into_the_launch_directory(tmp_path):
    env = fr.nccl_env(tmp_path, environ={})
    stem = str(tmp_path / fr.DUMP_STEM)
    assert env["TORCH_FR_BUFFER_SIZE"] == env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == stem
    # The pipe is created only with this set; the monitor polls it every COORD_CHECK ms only
    # while DUMP_ON_TIMEOUT is on (otherwise once per heartbeat timeout, minutes).
    assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == stem
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(env["TORCH_NCCL_COORD_CHECK_MILSEC"]) < 1000
    assert "TORCH_NCCL_COORD_CHECK_MILSEC" not in fr.nccl_env(
        tmp_path, environ={"TORCH_NCCL_COORD_CHECK_MILSEC": "5000"}
    )


@pytest.mark.L0
def test_dump_and_pipe_paths_follow_pytorchs_naming(tmp_path):
    stem = tmp_path / "fr_rank"
    assert fr.dump_path(stem, 3) == tmp_path / "fr_rank3"
    assert fr.pipe_path(stem, 3) == tmp_path / "fr_rank3.pipe"


# ---- the request ---------------------------------------------------------------------------------
@pytest.mark.L0
def test_request_reaches_a_listening_pipe_and_reports_every_other_case(tmp_path):
    stem = tmp_path / "fr_rank"
    os.mkfifo(fr.pipe_path(stem, 0))
    reader = os.open(fr.pipe_path(stem, 0), os.O_RDONLY | os.O_NONBLOCK)  # as PyTorch's DumpPipe
    os.mkfifo(fr.pipe_path(stem, 1))  # a pipe whose process is gone: nobody reads it
    fr.pipe_path(stem, 2).write_text("")  # not a FIFO
    try:
        outcome = fr.request_dumps(stem, [0, 1, 2, 3])
        assert os.read(reader, 128) == b"dump\n"
    finally:
        os.close(reader)
    assert outcome == {0: "requested", 1: "no-reader", 2: "not-a-fifo", 3: "no-pipe"}


def _play_the_monitor(
    stem: Path, rank: int, dump: bytes, stop: threading.Event, listening: threading.Event
) -> None:
    """Stands in for NCCL's heartbeat monitor (no GPU here): read the pipe, write the dump.

    ``listening`` is set once the pipe is open for reading: between mkfifo and open a writer gets
    ENXIO, which `request_dumps` rightly reports as ``no-reader``.
    """
    path = fr.pipe_path(stem, rank)
    os.mkfifo(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    listening.set()
    try:
        while not stop.is_set():
            try:
                got = os.read(fd, 128)
            except BlockingIOError:
                got = b""
            if got:
                tmp = fr.dump_path(stem, rank).with_suffix(".tmp")
                tmp.write_bytes(dump)
                tmp.rename(fr.dump_path(stem, rank))
                return
            stop.wait(0.02)
    finally:
        os.close(fd)


@pytest.mark.L0
def test_dump_before_kill_waits_for_the_answering_ranks_only(tmp_path, one_rank_dump):
    stem = tmp_path / "fr_rank"
    stop, listening = threading.Event(), threading.Event()
    monitor = threading.Thread(target=_play_the_monitor, args=(stem, 0, one_rank_dump[0], stop, listening))
    monitor.start()
    try:
        assert listening.wait(10), "the stand-in monitor never opened its pipe"
        # rank 1 has a pipe but nobody answers; rank 2 never created one (e.g. died before NCCL init).
        os.mkfifo(fr.pipe_path(stem, 1))
        deaf = os.open(fr.pipe_path(stem, 1), os.O_RDONLY | os.O_NONBLOCK)
        try:
            outcome = fr.dump_before_kill(stem, [0, 1, 2], wait_s=0.5)
        finally:
            os.close(deaf)
    finally:
        stop.set()
        monitor.join()
    assert outcome == {0: "dumped", 1: "requested, no dump within 0.5 s", 2: "no-pipe"}
    assert fr.load_dump(fr.dump_path(stem, 0))["entries"]


# ---- reading dumps -----------------------------------------------------------------------------
@pytest.mark.L0
def test_a_real_pickled_dump_and_its_json_form_parse_to_the_same_trace(tmp_path, one_rank_dump):
    pickled, as_json = one_rank_dump
    (tmp_path / "a0").write_bytes(pickled)
    (tmp_path / "b0").write_bytes(as_json)
    from_pickle = fr.parse_dump(fr.load_dump(tmp_path / "a0"), 0)
    from_json = fr.parse_dump(fr.load_dump(tmp_path / "b0"), 0)
    assert from_pickle == from_json
    # What the run did: all_reduce #1 and broadcast #2 on the default group, all_reduce #1 on the
    # subgroup (sequence numbers count per group), all on [3, 5] tensors.
    default = [e for e in from_pickle.entries if "default_pg" in e.group]
    other = [e for e in from_pickle.entries if "default_pg" not in e.group]
    assert [(e.seq, e.op) for e in default] == [(1, "gloo:all_reduce"), (2, "gloo:broadcast")]
    assert [(e.seq, e.op) for e in other] == [(1, "gloo:all_reduce")]
    assert {e.input_sizes for e in from_pickle.entries} == {((3, 5),)}
    assert sorted(from_pickle.enqueued.values()) == [1, 2]
    # One rank, everything finished: nothing to report.
    assert fr.diagnose([from_pickle]) == []
    assert fr.diagnose([from_pickle], world_size=2) == ["no flight-recorder dump from rank(s) [1]"]


@pytest.mark.L0
def test_a_dump_that_imports_anything_is_refused(tmp_path):
    path = tmp_path / "evil0"
    path.write_bytes(pickle.dumps({"entries": [os.getcwd]}))  # a global reference
    with pytest.raises(ValueError, match=r"evil0: not a flight-recorder dump.*refusing to import"):
        fr.load_dump(path)


@pytest.mark.parametrize(
    ("content", "match"),
    [(b"\x80\x04half a pick", "neither pickle nor JSON"), (json.dumps({"x": 1}).encode(), "no 'entries'")],
)
@pytest.mark.L0
def test_what_is_not_a_dump_says_which_file(tmp_path, content, match):
    path = tmp_path / "dump0"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"dump0: not a flight-recorder dump.*{match}"):
        fr.load_dump(path)


@pytest.mark.L0
def test_wait_for_dumps_returns_what_is_there_at_the_deadline(tmp_path, one_rank_dump):
    stem = tmp_path / "fr_rank"
    fr.dump_path(stem, 1).write_bytes(one_rank_dump[0])
    fr.dump_path(stem, 2).write_bytes(one_rank_dump[0][: len(one_rank_dump[0]) // 2])  # mid-write
    found = fr.wait_for_dumps(stem, [0, 1, 2], timeout_s=0.2)
    assert found == {1: fr.dump_path(stem, 1)}
    assert [t.rank for t in fr.read_dumps(stem, [0, 1, 2])] == [1]


# ---- a real desync on two gloo ranks -------------------------------------------------------------
def desync_body(rank: int, world_size: int, out: str) -> bool:
    """Rank 0 enters subgroup all_reduce #2 and dumps; rank 1 dumps before entering it, then does."""
    sub = dist.new_group([0, 1], timeout=timedelta(minutes=30))
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.all_reduce(t, group=sub)
    stem = Path(out) / "fr_rank"
    if rank == 0:
        work = dist.all_reduce(t, group=sub, async_op=True)
        fr.dump_path(stem, rank).write_bytes(torch._C._distributed_c10d._dump_fr_trace())
        dist.barrier()
        work.wait()
    else:
        fr.dump_path(stem, rank).write_bytes(torch._C._distributed_c10d._dump_fr_trace())
        dist.barrier()
        dist.all_reduce(t, group=sub)
    return True


@pytest.mark.L1
@pytest.mark.world_size(2)
def test_the_diagnosis_of_a_real_two_rank_desync_names_the_rank_that_never_entered(tmp_path, monkeypatch):
    from megatron_testkit.ranks import run_ranks

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    assert run_ranks(desync_body, 2, backend="gloo", args=(str(tmp_path),), timeout=180) == [True, True]
    traces = fr.read_dumps(tmp_path / "fr_rank", [0, 1])
    assert [t.rank for t in traces] == [0, 1]
    lines = fr.diagnose(traces, world_size=2)
    assert len(lines) == 1, lines
    assert (
        "rank(s) [0] entered collective #2 gloo:all_reduce [[4]]; rank 1 at #1 never entered it" in lines[0]
    )
    assert "default_pg" not in lines[0]  # the default group is level on both ranks


def desync_then_fail(rank: int, world_size: int) -> None:
    """`desync_body` dumping where the launcher reads dumps (its launch directory); then rank 0 fails."""
    run_dir = json.loads(Path(os.environ["KIT_RANK_SPEC"]).read_text())["run_dir"]
    sub = dist.new_group([0, 1], timeout=timedelta(minutes=30))
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.all_reduce(t, group=sub)
    stem = Path(run_dir) / fr.DUMP_STEM
    if rank == 0:
        dist.all_reduce(t, group=sub, async_op=True)
    fr.dump_path(stem, rank).write_bytes(torch._C._distributed_c10d._dump_fr_trace())
    dist.barrier()
    if rank == 0:
        raise RuntimeError("rank 0 gives up waiting")
    time.sleep(60)


@pytest.mark.L1
@pytest.mark.world_size(2)
def test_a_failed_launch_says_what_the_flight_recorder_dumps_show(monkeypatch):
    from megatron_testkit.ranks import RankFailure, run_ranks

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    with pytest.raises(RankFailure) as info:
        run_ranks(desync_then_fail, 2, backend="gloo", timeout=180)
    findings = [line for line in str(info.value).splitlines() if line.startswith("flight recorder: ")]
    assert len(findings) == 1, str(info.value)
    assert (
        "rank(s) [0] entered collective #2 gloo:all_reduce [[4]]; rank 1 at #1 never entered it"
        in findings[0]
    )


# ---- megatron's group timeout ------------------------------------------------------------------
@pytest.mark.L0
def test_megatron_timeout_is_the_launchers_group_timeout_in_minutes():
    assert fr.megatron_timeout_minutes({}) == 30.0
    assert fr.megatron_timeout_minutes({"KIT_PG_TIMEOUT_S": "90"}) == 1.5
    with pytest.raises(ValueError, match=r"KIT_PG_TIMEOUT_S='soon'"):
        fr.megatron_timeout_minutes({"KIT_PG_TIMEOUT_S": "soon"})
    with pytest.raises(ValueError, match=r"KIT_PG_TIMEOUT_S='0'.*> 0"):
        fr.megatron_timeout_minutes({"KIT_PG_TIMEOUT_S": "0"})


@pytest.mark.L1
def test_init_model_parallel_gives_megatrons_groups_the_launchs_timeout(tmp_path, monkeypatch):
    """Without distributed_timeout_minutes, fixtures.megatron.init_model_parallel takes the launch's
    group timeout from KIT_PG_TIMEOUT_S (what the launcher exports to every rank)."""
    from megatron.core import parallel_state as ps

    from fixtures.megatron import cpu_shim, destroy_model_parallel, init_model_parallel

    monkeypatch.setenv("KIT_PG_TIMEOUT_S", "75")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=75))
    try:
        with cpu_shim():
            init_model_parallel(1, 1, 1)
            try:
                group = ps.get_tensor_model_parallel_group()
                assert group._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=75)
            finally:
                destroy_model_parallel()
    finally:
        dist.destroy_process_group()


@pytest.mark.L1
def test_megatrons_groups_take_the_timeout_passed_to_them(tmp_path):
    """megatron-core builds its groups with timedelta(minutes=distributed_timeout_minutes): with
    the launcher's timeout passed, they time out with the default group instead of after 30 min."""
    from megatron.core import parallel_state as ps

    from fixtures.megatron import cpu_shim, destroy_model_parallel, init_model_parallel

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=90))
    try:
        with cpu_shim():
            minutes = fr.megatron_timeout_minutes({"KIT_PG_TIMEOUT_S": "90"})
            init_model_parallel(1, 1, 1, distributed_timeout_minutes=minutes)
            try:
                for group in (ps.get_data_parallel_group(), ps.get_tensor_model_parallel_group()):
                    backend = group._get_backend(torch.device("cpu"))
                    assert backend.options._timeout == timedelta(seconds=90)
            finally:
                destroy_model_parallel()
    finally:
        dist.destroy_process_group()

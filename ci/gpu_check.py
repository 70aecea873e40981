"""The single-GPU check: what one GPU can prove about the kit, in one command, under 8 minutes.

    python -m ci.gpu_check OUTDIR [--dry-run] [--only STEP[,STEP...]] [--budget-s SECONDS]
    bash ci/gpu_check.sh OUTDIR [...]          (the same, after installing carried wheels, if any)

Steps (each one line in OUTDIR/summary.json, JSON per line, and printed as it finishes):

- ``environment``: torch, CUDA, NCCL, device, megatron-core; the kit's modules import.
- ``memory``: `memory_report` on CUDA in an NCCL rank (and the host RSS a CUDA rank carries, the
  figure behind the CUDA host allowance); a device budget with a planted CUDA OOM must give
  ``oom`` naming rank 0, and how many seconds that took.
- ``hang``: an NCCL collective that cannot complete (its stream is held by a sleeping kernel) on a
  group with megatron's 30-minute timeout: the launcher must call it a ``hang``, and the
  flight-recorder dump requested through ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` is collected and
  parsed into "collective #N not completed on rank 0".
- ``sync``: `add_microbatch`/`resolve` under ``torch.cuda.set_sync_debug_mode("error")`` raise
  nothing; `step` is where the one host sync is (counted under "warn").
- ``bench``: `add_microbatch` on CUDA with a busy stream vs one ``.item()`` per microbatch (as
  Megatron-Bridge's `_real_subseq_lengths` does with a device argmin) vs a ``.tolist()`` loop, at
  8/512/8192 documents; figures in OUTDIR/bench.json.
- ``gpt``: a 1-rank megatron-core GPT with the kit's reference attention on CUDA over NCCL: bf16
  training steps, save, load into a fresh model, the same loss after the load.
- ``pytest``: ``pytest -m "L0 and gpu"`` with ``KIT_REQUIRE_GPUS=1`` (a GPU test that skips for
  want of a GPU fails); its report and junit XML in OUTDIR/pytest/.

``--dry-run`` runs what the CPU can: the imports, the commands and environments the GPU steps
would use, a real flight-recorder dump of a two-rank gloo desync (the CPU build writes the same
format) parsed and diagnosed, the accounting calls, the benchmark's code on CPU tensors, and the
pytest selection collected. Exit status 0 when every step passed (or dry-ran), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("environment", "memory", "hang", "sync", "bench", "gpt", "pytest")
# The whole check must end within 8 minutes on one H200; the budget leaves a margin for start-up.
DEFAULT_BUDGET_S = 450.0
GiB = 1024**3


@dataclass
class StepResult:
    """One line of summary.json: a step, its verdict, its figures and what it saw."""

    step: str
    status: str  # ok, failed, skipped, dry-ok
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    detail: str = ""


class StepFailed(Exception):
    """A step's check did not hold; the message says what was expected and what was seen."""


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise StepFailed(message)


# ------------------------------------------------------------------------------------- ranks
# Rank functions are module-level so `run_ranks` can import them by name in fresh processes.


def _host_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def memory_rank(rank: int, world_size: int) -> dict[str, Any]:
    """memory_report on CUDA in an NCCL rank, before and after an allocation and a collective."""
    import torch
    import torch.distributed as dist

    from accounting import memory_report

    x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    report = memory_report()
    free, total = torch.cuda.mem_get_info()
    return {
        "report": report,
        "tensor_bytes": x.numel(),
        "host_rss_bytes": _host_rss(),  # a CUDA + NCCL rank's RSS: the host allowance's figure
        "card_used_bytes": total - free,  # context + NCCL + allocator: what the cap does not see
        "all_reduce": float(t.item()),
    }


def oom_rank(rank: int, world_size: int, size_bytes: int) -> None:
    """Allocate past the device budget the launcher capped this rank to."""
    import torch

    torch.empty(size_bytes, dtype=torch.uint8, device="cuda")


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


def sync_rank(rank: int, world_size: int, device: str) -> dict[str, Any]:
    """add_microbatch and resolve under sync-debug "error"; step's syncs counted under "warn"."""
    import warnings

    import torch
    import torch.distributed as dist

    from accounting import FlopsAccumulator
    from accounting.presets import preset

    shape = preset("llama3-8b")
    packs = [_pack_cu_seqlens(docs, seed) for seed, docs in enumerate((8, 512, 8192, 1))]
    on_device = [(cu.to(device), pad.to(device)) for cu, pad in packs]
    acc = FlopsAccumulator(packed=True, dp_group=dist.group.WORLD)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        for cu, pad in on_device:
            acc.add_microbatch(cu_seqlens=cu, cu_seqlens_padded=pad, seq_len=8192 * 8)
        acc.resolve()
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
    control_raised = None
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
        try:
            on_device[0][0].sum().item()
            control_raised = False
        except RuntimeError:
            control_raised = True
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flops = acc.step(shape)
    if cuda:
        torch.cuda.set_sync_debug_mode(0)
    step_syncs = sum("synchroniz" in str(w.message) for w in caught)
    # The same microbatches on the CPU, a second accumulator: the device path must agree exactly.
    ref = FlopsAccumulator(packed=True, dp_group=dist.group.WORLD)
    for cu, pad in packs:
        ref.add_microbatch(cu_seqlens=cu, cu_seqlens_padded=pad, seq_len=8192 * 8)
    return {
        "flops": flops,
        "cpu_flops": ref.step(shape),
        "step_syncs": step_syncs,
        "control_raised": control_raised,
    }


def _pack_cu_seqlens(docs: int, seed: int, pack_len: int = 8192 * 8) -> tuple[Any, Any]:
    """A 1-D pack of `docs` documents with a -1 tail, and its padded form (lengths rounded to 8)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max(2, pack_len // docs // 2), (docs,), generator=gen)
    padded = (lengths + 7) // 8 * 8
    zero = torch.zeros(1, dtype=torch.int64)
    cu = torch.cat([zero, lengths.cumsum(0), torch.full((2,), -1)]).to(torch.int32)
    pad = torch.cat([zero, padded.cumsum(0), torch.full((2,), -1)]).to(torch.int32)
    return cu, pad


def gpt_rank(rank: int, world_size: int, root: str, steps: int) -> dict[str, Any]:
    """The 1-rank megatron-core GPT run (the one call into the training harness)."""
    return train_save_load(root, steps)


def train_save_load(root: str, steps: int) -> dict[str, Any]:
    """Train `steps` steps with `fixtures.training.Trainer`, save, load into a fresh model, compare.

    The only place the check uses the harness's public API (Trainer, ModelConfig, ParallelConfig,
    TrainConfig; train_step, forward_loss, save, load, close), so a change there is one edit here.
    Reference attention (``use_te=False``): TE is not carried to the check's machine.
    """
    import random

    import torch

    from fixtures.data import Example, pack_examples
    from fixtures.megatron import cpu_shim, destroy_model_parallel
    from fixtures.training import ModelConfig, ParallelConfig, TrainConfig, Trainer

    rng = random.Random(0)
    model = ModelConfig()
    examples = []
    for _ in range(24):
        n = rng.randint(20, 120)
        tokens = [rng.randrange(1, 256) for _ in range(n + 1)]
        examples.append(Example(tuple(tokens[:-1]), tuple(tokens[1:]), (1,) * n))
    packs = pack_examples(examples, model.max_sequence_length, 1, pad_id=0)
    batches = [packs[i : i + 2] for i in range(0, 2 * steps, 2)]
    probe = packs[2 * steps : 2 * steps + 2] or packs[:2]
    out: dict[str, Any] = {}
    with cpu_shim():
        trainer = Trainer(model, ParallelConfig(), TrainConfig(use_te=False, lr=3e-3))
        params = list(trainer.model[0].module.parameters())
        out["param_dtypes"] = sorted({str(p.dtype) for p in params})
        out["param_device"] = str(params[0].device)
        t0 = time.perf_counter()
        results = [trainer.train_step(b) for b in batches]
        out["train_s"] = time.perf_counter() - t0
        out["losses"] = [r.loss for r in results]
        out["tflops_per_gpu"] = results[-1].tflops_per_gpu
        out["memory"] = results[-1].memory or results[-1].local_memory
        out["total_flops"] = trainer.flops.total_flops
        out["loss_before_save"] = trainer.forward_loss(probe)
        trainer.save(root)
        trainer.close()
        fresh = Trainer(model, ParallelConfig(), TrainConfig(use_te=False, lr=3e-3, seed=99))
        out["loss_fresh"] = fresh.forward_loss(probe)
        out["loaded_iteration"] = fresh.load(root)
        out["loss_after_load"] = fresh.forward_loss(probe)
        out["flops_after_load"] = fresh.flops.total_flops
        fresh.close()
        destroy_model_parallel()
    out["bf16"] = torch.cuda.is_available()
    return out


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


# ------------------------------------------------------------------------------------- steps
class Check:
    """Runs the steps in order within a time budget, writing summary.json line by line."""

    def __init__(self, outdir: Path, *, dry_run: bool, budget_s: float) -> None:
        self.out = outdir
        self.dry = dry_run
        self.deadline = time.monotonic() + budget_s
        self.summary = outdir / "summary.json"
        self.results: list[StepResult] = []

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, names: list[str]) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        self.summary.write_text("")
        for name in names:
            step: Callable[[], StepResult | dict[str, Any]] = getattr(self, f"step_{name}")
            start = time.monotonic()
            if self.remaining() < 10:
                result = StepResult(name, "skipped", detail="out of time: the check's budget is spent")
            else:
                try:
                    got = step()
                    figures = got if isinstance(got, dict) else {}
                    result = StepResult(name, "dry-ok" if self.dry else "ok", figures=figures)
                except StepFailed as exc:
                    result = StepResult(name, "failed", detail=str(exc))
                except Exception as exc:  # an unexpected error is this step's failure, not the check's
                    (self.out / f"{name}.traceback.txt").write_text(traceback.format_exc())
                    result = StepResult(name, "failed", detail=f"{type(exc).__name__}: {exc}")
            result.seconds = round(time.monotonic() - start, 2)
            self.results.append(result)
            line = json.dumps(asdict(result), default=str)
            with self.summary.open("a") as f:
                f.write(line + "\n")
            print(
                f"[gpu-check] {result.step:<12} {result.status:<8} {result.seconds:7.1f}s  {line}", flush=True
            )
        return 0 if all(r.status in ("ok", "dry-ok") for r in self.results) else 1

    # -- environment ---------------------------------------------------------------------------
    def step_environment(self) -> dict[str, Any]:
        import torch

        import accounting  # noqa: F401
        import fixtures.training  # noqa: F401
        import megatron_testkit.ranks  # noqa: F401
        from megatron_testkit import devices, flight_recorder  # noqa: F401

        figures: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__}
        try:
            from megatron.core import package_info

            figures["megatron_core"] = package_info.__version__
        except ImportError as exc:
            raise StepFailed(
                f"megatron-core does not import ({exc}): carry its wheel (ci/gpu_check.sh)"
            ) from None
        figures["cuda_available"] = torch.cuda.is_available()
        if self.dry:
            return figures
        _expect(torch.cuda.is_available(), "torch.cuda.is_available() is False: no GPU for the GPU check")
        figures.update(
            device=torch.cuda.get_device_name(0),
            gpus=torch.cuda.device_count(),
            cuda=torch.version.cuda,
            nccl=_nccl_version(),
        )
        return figures

    # -- memory ------------------------------------------------------------------------------------
    def step_memory(self) -> dict[str, Any]:
        from megatron_testkit import devices
        from megatron_testkit.budgets import MemoryBudget
        from megatron_testkit.ranks import RankFailure, run_ranks

        budget = MemoryBudget.parse(device="1GiB")
        cap = devices.device_memory_cap(budget.device_bytes, {})
        _expect(cap == GiB, f"device cap of a 1GiB budget is {cap}")
        if self.dry:
            return {"device_cap_bytes": cap, "planted_oom_bytes": 2 * GiB}
        figures: dict[str, Any] = {}
        got = run_ranks(memory_rank, 1, backend="nccl", timeout=min(90, self.remaining()))[0]
        report = got["report"]
        _expect(
            "allocated_bytes" in report, f"memory_report() on a CUDA rank gave host keys: {sorted(report)}"
        )
        _expect(
            report["peak_allocated_bytes"] >= got["tensor_bytes"],
            f"peak_allocated_bytes {report['peak_allocated_bytes']} < the {got['tensor_bytes']} B tensor",
        )
        _expect(all(type(v) is int for v in report.values()), f"non-int values in {report}")
        figures.update(
            cuda_rank_host_rss_bytes=got["host_rss_bytes"],
            card_used_bytes=got["card_used_bytes"],
            allocator_reserved_bytes=report["reserved_bytes"],
        )
        start = time.monotonic()
        try:
            run_ranks(
                oom_rank, 1, backend="nccl", args=(2 * GiB,), budget=budget, timeout=min(90, self.remaining())
            )
        except RankFailure as failure:
            figures["oom_verdict_s"] = round(time.monotonic() - start, 2)
            figures["oom_first_line"] = str(failure).splitlines()[0]
            _expect(
                (failure.rank, failure.kind) == (0, "oom"),
                f"planted CUDA OOM gave rank {failure.rank} {failure.kind}: {str(failure).splitlines()[0]}",
            )
            _expect(str(failure).startswith("rank 0 oom"), f"message does not lead with the rank: {failure}")
            return figures
        raise StepFailed("allocating 2 GiB under a 1 GiB device budget succeeded: the cap was not applied")

    # -- hang + flight recorder ------------------------------------------------------------------
    def step_hang(self) -> dict[str, Any]:
        from megatron_testkit import flight_recorder as fr

        fr_dir = self.out / "flight_recorder"
        fr_dir.mkdir(parents=True, exist_ok=True)
        if self.dry:
            return self._canned_dump(fr_dir)
        from megatron_testkit.ranks import RankFailure, run_ranks

        env = fr.nccl_env(fr_dir)
        stem = env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"]
        marker = fr_dir / "entered"
        marker.unlink(missing_ok=True)
        outcome: dict[str, Any] = {}

        def launch() -> None:
            start = time.monotonic()
            try:
                run_ranks(hang_rank, 1, backend="nccl", args=(str(marker),), env=env, timeout=45)
                outcome["verdict"] = "passed"
            except RankFailure as failure:
                outcome.update(verdict=f"rank {failure.rank} {failure.kind}", message=str(failure))
            outcome["verdict_s"] = round(time.monotonic() - start, 2)

        thread = threading.Thread(target=launch, name="gpu-check-hang")
        thread.start()
        deadline = time.monotonic() + 40
        while not marker.exists() and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        _expect(marker.exists(), "the hanging rank never reached its collective (see the launch's log)")
        time.sleep(2.0)  # the collective is enqueued and stuck
        asked = time.monotonic()
        dumps = fr.dump_before_kill(stem, [0], wait_s=15.0)
        figures: dict[str, Any] = {"dump_request": dumps[0], "dump_s": round(time.monotonic() - asked, 2)}
        thread.join()
        figures.update(verdict=outcome.get("verdict"), verdict_s=outcome.get("verdict_s"))
        (self.out / "hang_message.txt").write_text(outcome.get("message", ""))
        _expect(outcome.get("verdict") == "rank 0 hang", f"an NCCL hang gave {outcome.get('verdict')}")
        _expect(dumps[0] == "dumped", f"flight-recorder dump through the pipe: {dumps[0]}")
        traces = fr.read_dumps(stem, [0])
        lines = fr.diagnose(traces, world_size=1)
        figures["diagnosis"] = lines
        figures["entries"] = [f"{e.group} #{e.seq} {e.op} {e.state}" for e in traces[0].entries][-4:]
        _expect(
            any("#2" in line and "not completed on rank(s) [0]" in line for line in lines),
            f"the dump does not show collective #2 stuck on rank 0: {lines}",
        )
        return figures

    def _canned_dump(self, fr_dir: Path) -> dict[str, Any]:
        """Dry run: a real flight-recorder dump of a two-rank gloo desync, parsed and diagnosed."""
        from megatron_testkit import flight_recorder as fr
        from megatron_testkit.ranks import run_ranks

        env = fr.nccl_env(fr_dir)
        stem = str(fr_dir / "canned_rank")
        for rank in (0, 1):
            fr.dump_path(stem, rank).unlink(missing_ok=True)
        fr_env = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}
        run_ranks(
            canned_desync_rank,
            2,
            backend="gloo",
            args=(stem,),
            env=fr_env,
            timeout=min(180, self.remaining()),
        )
        traces = fr.read_dumps(stem, [0, 1])
        lines = fr.diagnose(traces, world_size=2)
        _expect(
            any(
                "rank(s) [0] entered collective #2" in line and "rank 1 at #1 never entered it" in line
                for line in lines
            ),
            f"the canned desync was not diagnosed: {lines}",
        )
        return {"nccl_env": env, "canned_dump_version": traces[0].version, "diagnosis": lines}

    # -- sync debug mode ---------------------------------------------------------------------------
    def step_sync(self) -> dict[str, Any]:
        from megatron_testkit.ranks import run_ranks

        backend, device = ("gloo", "cpu") if self.dry else ("nccl", "cuda")
        got = run_ranks(sync_rank, 1, backend=backend, args=(device,), timeout=min(120, self.remaining()))[0]
        _expect(
            got["flops"] == got["cpu_flops"], f"device FLOPs {got['flops']} != CPU FLOPs {got['cpu_flops']}"
        )
        if not self.dry:
            _expect(got["control_raised"] is True, "sync debug mode 'error' did not catch a plain .item()")
        return got

    # -- benchmark --------------------------------------------------------------------------------
    def step_bench(self) -> dict[str, Any]:
        figures = bench_add_microbatch(cuda=not self.dry, repeat=3 if self.dry else 50)
        (self.out / "bench.json").write_text(json.dumps(figures, indent=2))
        _write_bench_figure(figures, self.out / "bench.png")
        return figures

    # -- GPT ------------------------------------------------------------------------------------------
    def step_gpt(self) -> dict[str, Any]:
        from megatron_testkit.ranks import run_ranks

        root = self.out / "gpt_checkpoint"
        if self.dry:
            # The same function on the CPU over gloo (fp32, reference attention): the harness calls
            # hold; the GPU run differs only in device and precision.
            got = run_ranks(
                gpt_rank, 1, backend="gloo", args=(str(root), 1), timeout=min(300, self.remaining())
            )[0]
        else:
            got = run_ranks(
                gpt_rank, 1, backend="nccl", args=(str(root), 3), timeout=min(200, self.remaining())
            )[0]
            _expect(
                got["param_dtypes"] == ["torch.bfloat16"], f"parameters are {got['param_dtypes']}, not bf16"
            )
            _expect(got["param_device"].startswith("cuda"), f"parameters on {got['param_device']}")
        _expect(
            got["loss_after_load"] == got["loss_before_save"],
            f"loss after load {got['loss_after_load']} != before save {got['loss_before_save']}",
        )
        _expect(got["loss_fresh"] != got["loss_before_save"], "a fresh model already had the trained loss")
        _expect(got["flops_after_load"] == got["total_flops"], "FLOPs counter not restored by load")
        return got

    # -- pytest -m "L0 and gpu" ---------------------------------------------------------------------
    def pytest_command(self) -> tuple[list[str], dict[str, str]]:
        """The pytest command and environment of the last step (printed by the dry run)."""
        report = self.out / "pytest"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "L0 and gpu",
            "-p",
            "no:randomly",
            "-q",
            f"--kit-report={report}",
            f"--junitxml={report}/junit.xml",
        ]
        env = {"KIT_REQUIRE_GPUS": "1", "CI": "true", "HYPOTHESIS_PROFILE": "ci", "PYTHONUNBUFFERED": "1"}
        return cmd, env

    def step_pytest(self) -> dict[str, Any]:
        cmd, env = self.pytest_command()
        if self.dry:
            cmd = [*cmd[:3], "--collect-only", *cmd[3:7], "-q"]
        log = self.out / "pytest.log"
        timeout = max(10.0, self.remaining() - 5)
        with log.open("w") as f:
            try:
                proc = subprocess.run(
                    cmd,
                    cwd=ROOT,
                    env={**os.environ, **env},
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    timeout=timeout,
                )
            except subprocess.TimeoutExpired:
                raise StepFailed(f"pytest did not finish within {timeout:.0f} s (log: {log})") from None
        tail = log.read_text().strip().splitlines()[-1:] or [""]
        figures: dict[str, Any] = {
            "command": shlex.join(cmd),
            "env": env,
            "returncode": proc.returncode,
            "last_line": tail[0],
        }
        if self.dry:
            _expect(proc.returncode == 0, f"collecting 'L0 and gpu' failed: {tail[0]} (log: {log})")
            return figures
        figures.update(_junit_counts(self.out / "pytest" / "junit.xml"))
        _expect(proc.returncode == 0, f"pytest -m 'L0 and gpu' exited {proc.returncode}: {tail[0]}")
        _expect(figures.get("tests", 0) > 0, "no 'L0 and gpu' test ran")
        return figures


def _nccl_version() -> str:
    import torch

    version = torch.cuda.nccl.version()  # a tuple in recent torch, an int (e.g. 21803) before
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _junit_counts(path: Path) -> dict[str, int]:
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


# ------------------------------------------------------------------------------------- benchmark
def bench_add_microbatch(
    *, cuda: bool, repeat: int, docs: tuple[int, ...] = (8, 512, 8192)
) -> dict[str, Any]:
    """Host time per microbatch of three ways to count a pack, each behind a busy stream on CUDA.

    Before every microbatch a short sleeping kernel is queued (the stand-in for the microbatch's
    forward pass); `add_microbatch` only queues its own kernels behind it, the other two wait for
    it: one `.item()` of the device argmin (Megatron-Bridge's `_real_subseq_lengths` when the argmin
    lives on the device), or a `.tolist()` of the boundaries and a Python loop.
    """
    import torch

    from accounting import FlopsAccumulator
    from ci.benchmarks.accounting_packs import make_pack, syncing_stats

    device = "cuda" if cuda else "cpu"
    busy_cycles = 2_000_000 if cuda else 0  # ~1 ms on a ~2 GHz SM clock

    def busy() -> None:
        if cuda:
            torch.cuda._sleep(busy_cycles)

    def item_per_microbatch(cu: torch.Tensor) -> torch.Tensor:
        row = cu[0]
        end = int(torch.argmin(row).item())  # the first -1 of the tail: the one sync
        lengths = row[1:end] - row[: end - 1]
        return (lengths.to(torch.int64) ** 2).sum()

    figures: dict[str, Any] = {
        "device": device,
        "repeat": repeat,
        "busy_stream": cuda,
        "us_per_microbatch": {},
    }
    for n in docs:
        cu = make_pack(n, 1).to(device)
        acc = FlopsAccumulator(packed=True)
        variants = {
            "add_microbatch": lambda cu=cu, acc=acc: acc.add_microbatch(cu_seqlens=cu, seq_len=8192 * 8),
            "item_per_microbatch": lambda cu=cu: item_per_microbatch(cu),
            "tolist_loop": lambda cu=cu: syncing_stats(cu),
        }
        row = {}
        for name, fn in variants.items():
            busy()
            fn()  # warm-up
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(repeat):
                busy()
                fn()
            elapsed = time.perf_counter() - start
            if cuda:
                torch.cuda.synchronize()
            row[name] = round(elapsed / repeat * 1e6, 1)
        figures["us_per_microbatch"][str(n)] = row
    return figures


def _write_bench_figure(figures: dict[str, Any], path: Path) -> None:
    """bench.png when matplotlib is there; the numbers are in bench.json either way."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    table = figures["us_per_microbatch"]
    docs = list(table)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.27
    for i, name in enumerate(("add_microbatch", "item_per_microbatch", "tolist_loop")):
        ax.bar(
            [j + (i - 1) * width for j in range(len(docs))], [table[d][name] for d in docs], width, label=name
        )
    ax.set_xticks(range(len(docs)), [f"{d} docs" for d in docs])
    ax.set_yscale("log")
    ax.set_ylabel("host µs per microbatch")
    ax.set_title(
        f"counting a pack on {figures['device']}"
        + (" behind a busy stream" if figures["busy_stream"] else "")
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the steps, return the exit status (2 for bad arguments)."""
    parser = argparse.ArgumentParser(prog="python -m ci.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path, help="folder for summary.json, figures and logs")
    parser.add_argument("--dry-run", action="store_true", help="run the CPU-side steps only")
    parser.add_argument("--only", default="", help=f"comma-separated steps out of {','.join(STEPS)}")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="time budget for all steps")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    names = [s for s in args.only.split(",") if s] or list(STEPS)
    unknown = [s for s in names if s not in STEPS]
    if unknown:
        print(f"gpu-check: unknown step(s) {unknown}: expected some of {', '.join(STEPS)}", file=sys.stderr)
        return 2
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    check = Check(args.outdir.resolve(), dry_run=args.dry_run, budget_s=args.budget_s)
    mode = "dry run (CPU side only)" if args.dry_run else "on the GPU"
    print(f"[gpu-check] {mode}: steps {', '.join(names)}; results in {check.summary}", flush=True)
    status = check.run(names)
    print(f"[gpu-check] {'passed' if status == 0 else 'FAILED'}: {check.summary}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

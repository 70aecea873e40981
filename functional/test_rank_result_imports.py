"""Reading a rank's result imports nothing new into the launching process.

megatron-core replaces ``torch.storage._load_from_bytes`` when it is imported, and a tensor pickles
its storage as a call to whatever that attribute is. A rank that imported megatron-core used to
return tensors that imported megatron-core (and, on a GPU machine, Transformer Engine) into pytest
when read there: hundreds of MiB the session's memory check counts. The launching process here is
a fresh interpreter, so its ``sys.modules`` says exactly what reading the results imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fixtures.inner_session import inner_env
from megatron_testkit import skips

pytestmark = pytest.mark.L0

RANK_MODULE = textwrap.dedent(
    """
    import torch


    def megatron_tensors(rank, world_size):
        import megatron.core  # noqa: F401  (replaces torch.storage._load_from_bytes)
        import torch.storage

        return {
            "tensor": torch.arange(3) * (rank + 1),
            "loader_in_rank": torch.storage._load_from_bytes.__module__,
        }
    """
)

LAUNCHER = textwrap.dedent(
    """
    import json
    import sys

    from rank_fns import megatron_tensors
    from megatron_testkit.ranks import run_ranks

    before = "megatron.core" in sys.modules
    results = run_ranks(megatron_tensors, 2, timeout=120)
    print(json.dumps({
        "before": before,
        "after": sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron.")),
        "tensors": [r["tensor"].tolist() for r in results],
        "loaders": [r["loader_in_rank"] for r in results],
    }))
    """
)


def test_tensors_from_ranks_that_imported_megatron_core_do_not_import_it_here(tmp_path: Path) -> None:
    skips.importorskip("megatron.core", "megatron")  # its import is what swaps the loader
    (tmp_path / "rank_fns.py").write_text(RANK_MODULE)
    env = inner_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCHER], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # The premise: inside the ranks megatron-core did swap the loader (else this test proves nothing).
    assert out["loaders"] == ["megatron.core.safe_globals"] * 2
    assert out["tensors"] == [[0, 1, 2], [0, 2, 4]]
    assert out["before"] is False
    assert out["after"] == [], f"reading the results imported {out['after']}"

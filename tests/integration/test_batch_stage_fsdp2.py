"""Batch-level credit and KL under FSDP2 (torchrun, gloo, 2 ranks on CPU): ScaleRL's std is
all-reduced over both ranks' shards, so each rank trains on the whole batch's advantages;
the reference policy works on sharded training."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
HERE = Path(__file__).resolve().parent

# rank 0: group a (0,0,0,1) -> c = (-0.25 x3, 0.75); rank 1: group b (0,0,0,5) ->
# c = (-1.25 x3, 3.75). Over the batch of 8 (both shards): std = sqrt(19.5 / 8) = 1.5612
# -> rank 0 trains on (-0.16013 x3, 0.48038), rank 1 on (-0.80064 x3, 2.40192). A per-rank
# std would give (-0.577 x3, 1.732) on both.
STD = math.sqrt(19.5 / 8)


def test_batch_stage_all_reduces_over_ranks_and_kl_runs_sharded(tiny_model_dir, tmp_path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parents[1]))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(HERE / "batch_stage_worker.py"),
            str(tiny_model_dir),
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r0 = json.loads((out / "rank0.json").read_text())
    r1 = json.loads((out / "rank1.json").read_text())
    assert sorted(r0["weights"]) == pytest.approx(
        sorted([-0.25 / STD] * 3 + [0.75 / STD]), rel=1e-6
    )
    assert sorted(r1["weights"]) == pytest.approx(
        sorted([-1.25 / STD] * 3 + [3.75 / STD]), rel=1e-6
    )
    for r in (r0, r1):
        assert r["ref_sharded"] == 1.0  # every reference parameter is a shard on each rank
        assert r["kl"][0] == pytest.approx(0.0, abs=1e-6)  # step 1: policy == reference
        assert r["kl"][1] > 1e-6  # step 2: the sharded policy moved, the reference did not

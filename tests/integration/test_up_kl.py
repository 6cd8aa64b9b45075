"""`ludic up` with a custom algorithm (a composite loss with a KL term) trains end to end:
the learner's frozen reference policy supplies the reference logprobs the KL term reads
(before, the learner raised KeyError 'ref_logprobs' at its first step). Tiny budget. GRPO's
own ``kl_coeff`` through `ludic up` is test_up_options.py's first run (its reference forward
asserted there); this file's GRPO-with-k3 run was folded into it to keep the up tier short.
Starts vLLM: run under ``flock /tmp/ludic-vllm.lock``."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_up import config, finished, ludic_up, procs_of_run  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.up]


def test_up_trains_a_custom_algorithm_named_in_the_config(tmp_path, tiny_model_dir):
    """``algorithm: {name: custom}``: a credit assigner and a composite loss (clipped
    surrogate with TIS + a KL term) named in the run config train through feeder, credit and
    learner."""
    import yaml

    run_id = f"upcustom-{os.getpid()}"
    cfg = config(tmp_path, tiny_model_dir, run_id, num_steps=2, eval_n=0)
    data = yaml.safe_load(cfg.read_text())
    data["algorithm"] = {
        "name": "custom",
        "group_size": 4,
        "kwargs": {
            "credit": {"kind": "GroupNormalizedReturn"},
            "loss": {
                "kind": "CompositeLoss",
                "kwargs": {
                    "terms": [
                        {
                            "name": "pg",
                            "loss": {
                                "kind": "TokenClippedSurrogateLoss",
                                "kwargs": {"off_policy": {"mismatch_correction": "tis"}},
                            },
                        },
                        {"name": "kl", "coeff": 0.05, "loss": {"kind": "TokenKLLoss"}},
                    ]
                },
            },
        },
    }
    cfg.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "runs" / run_id
    learner = run_dir / "logs" / "learner.log"
    finished(ludic_up(cfg, tmp_path / "up.log"), tmp_path / "up.log", also=learner)
    learner_log = learner.read_text(errors="replace")
    assert '"name": "custom"' in learner_log
    assert "ref_logprobs" not in learner_log  # no KeyError: the reference policy supplied them
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] >= 2 and s["samples_trained"] >= 2 * 8
    time.sleep(1)
    assert procs_of_run(run_id) == [], "services left running after ludic up exited"

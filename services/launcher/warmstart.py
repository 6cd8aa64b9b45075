"""``python -m services.launcher.warmstart --config FILE``: only the model step of ``ludic up``.

Builds the starting policy exactly as ``ludic up`` does (``prepare_model``: the ``up:``
section's ``model`` or a fresh ``init_size`` model, then ``sft_steps`` of SFT warm start,
reused when already done with the same arguments) into ``<runs_dir>/<name>/``, and points
``<runs_dir>/<name>/policy`` at the result. The compose stack's ``model-init`` service runs
it so that the containers start from the same policy as ``make demo``.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from services.common.settings import load_settings, setup_logging
from services.launcher.main import prepare_model
from services.launcher.settings import UpSettings

log = logging.getLogger("ludic.warmstart")


def main(argv: list[str] | None = None) -> int:
    s = load_settings(UpSettings, argv, service="up", description=__doc__ or "")
    setup_logging(s.log_level)
    run_dir = Path(s.runs_dir) / s.name
    run_dir.mkdir(parents=True, exist_ok=True)
    model = prepare_model(s, run_dir)
    link = run_dir / "policy"
    tmp = run_dir / ".policy.tmp"
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(os.path.relpath(model, run_dir))
    tmp.replace(link)  # atomic: a reader sees the old or the new policy, never none
    log.info("starting policy: %s -> %s", link, model)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

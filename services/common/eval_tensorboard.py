"""Evaluation figures as TensorBoard scalars: tag ``eval/<set>/<figure>`` at the learner step.

Written by ``ludic up`` (``<run>/tensorboard/eval``) and by the eval service (its
``tensorboard_dir``) when tensorboard is installed (the dev extras); without it nothing is
written and the first call says so in the log. One event file per directory and process,
flushed after each call (``_WRITERS``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("ludic.eval")
UP_EVENTS_DIR = Path("tensorboard") / "eval"  # under ``ludic up``'s run dir
_MISSING: list[str] = []  # the import error, once it has been logged
# one writer per directory for the process's life: a writer per call made one event file
# each, and TensorBoard reads a directory's files in name order, where a writer counter of
# 10 sorts before 9 (an earlier step read last purges the later ones as "out of order")
_WRITERS: dict[str, Any] = {}


def write_scalars(
    directory: str | Path, per_set: Mapping[str, Mapping[str, float]], step: int
) -> bool:
    """``per_set`` (``{set: {figure: value}}``) as scalars ``eval/<set>/<figure>`` at
    ``step``; False when tensorboard is not installed."""
    try:
        # optional (tensorboard, in the dev extras); torch is loaded by the evaluation anyway
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        if not _MISSING:
            _MISSING.append(str(e))
            log.info("tensorboard is not installed (%s): no eval scalars in %s", e, directory)
        return False
    key = str(Path(directory).resolve())
    writer = _WRITERS.get(key)
    if writer is None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        writer = _WRITERS[key] = SummaryWriter(str(directory))
    for name, figures in per_set.items():
        for figure, value in figures.items():
            writer.add_scalar(f"eval/{name}/{figure}", float(value), step)
    writer.flush()
    return True

"""The held-out split every procedural env shares: a problem is an *eval* problem when a hash
of its key (its question text, or its operands) falls in one bucket of ``EVAL_BUCKETS``, a
pseudo-random tenth unrelated to the problem's content, so the held-out set has the training
distribution and never shares a problem with it, whatever the seeds or dataset sizes.
``split="train"`` never yields one, ``split="eval"`` only those, ``split=None`` anything."""

from __future__ import annotations

import hashlib

SPLITS = (None, "train", "eval")
EVAL_BUCKETS = 10  # one bucket of ten is held out


def in_eval_split(key: str) -> bool:
    h = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") % EVAL_BUCKETS == 0

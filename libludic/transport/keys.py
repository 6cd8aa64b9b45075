"""Redis key names of a run (``ludic:{run_id}:...``), stream names, consumer groups.

Keys (all of one run share the Redis Cluster hash tag ``{run_id}``, so the Lua scripts
of ``consumer`` and ``accounting`` may touch several of them atomically)::

    ludic:{run_id}:requests | rollouts | saw | deadletter      streams
    ludic:{run_id}:policy_version                              learner's published version
    ludic:{run_id}:learner_step                                learner's optimizer step
    ludic:{run_id}:admission                                   served_step, batch_size (learner)
    ludic:{run_id}:admission:wake                              list: "room may have opened"
    ludic:{run_id}:feeder:seed                                 next env seed (INCRBY)
    ludic:{run_id}:heartbeat:{role}:{consumer}                 liveness, SET ... EX ttl
    ludic:{run_id}:lease:{role}                                singleton lease (credit)
    ludic:{run_id}:acct, acct:*                             run accounting (libludic/transport/accounting.py)
    ludic:{run_id}:done:{role}:{item_id}                       de-dup marker, EX done_ttl
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass

log = logging.getLogger("libludic.transport")

GROUP_ACTORS = "actors"
GROUP_CREDIT = "credit"
GROUP_LEARNER = "learner"

#: lifetime of a de-dup marker (``done:{role}:{id}``, ``Keys.done``): how long after an
#: input's commit a redelivery or a late duplicate of it is still recognised. It must outlast
#: the longest a consumer can still commit an input it has lost to a claimer (claim_idle_ms
#: plus a stalled process's pause) and the latest a group's last rollout can reach credit.
#: Markers are written for every input, so Redis holds rate x DONE_TTL_S of them: the soak
#: (scripts/soak.py: the demo, 4 actors) writes 202 a second at about 157 bytes each, which a
#: week-long TTL would make 19 GB, past the embedded Redis's 2 GB maxmemory within 19 hours.
DONE_TTL_S = 3600

# --------------------------------------------------------------------------------------
# keys


@dataclass(frozen=True)
class Keys:
    """Every Redis key of run ``run_id``."""

    run_id: str

    def __post_init__(self) -> None:
        if not self.run_id or any(c in self.run_id for c in "{}: \t\n"):
            raise ValueError(
                f"run_id={self.run_id!r} must be non-empty without braces, colons or spaces; "
                "set LUDIC_RUN_ID"
            )

    @property
    def prefix(self) -> str:
        return f"ludic:{{{self.run_id}}}"

    @property
    def requests(self) -> str:
        return f"{self.prefix}:requests"

    @property
    def rollouts(self) -> str:
        return f"{self.prefix}:rollouts"

    @property
    def saw(self) -> str:
        return f"{self.prefix}:saw"

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}:deadletter"

    @property
    def policy_version(self) -> str:
        return f"{self.prefix}:policy_version"

    @property
    def learner_step(self) -> str:
        return f"{self.prefix}:learner_step"

    @property
    def admission(self) -> str:  # hash: served_step, batch_size (written by the learner)
        return f"{self.prefix}:admission"

    @property
    def admission_wake(self) -> str:  # list: the learner pushes when room may have opened
        return f"{self.prefix}:admission:wake"

    @property
    def feeder_seed(self) -> str:
        return f"{self.prefix}:feeder:seed"

    def heartbeat(self, role: str, consumer: str) -> str:
        return f"{self.prefix}:heartbeat:{role}:{consumer}"

    def heartbeat_pattern(self, role: str) -> str:
        # the braces of the hash tag are glob metacharacters: escape them for SCAN MATCH
        return f"ludic:\\{{{self.run_id}\\}}:heartbeat:{role}:*"

    def lease(self, role: str) -> str:
        return f"{self.prefix}:lease:{role}"

    def done(self, role: str, item_id: str) -> str:
        return f"{self.prefix}:done:{role}:{item_id}"

    def streams(self) -> dict[str, str]:
        """Short name -> key of every stream, with the consumer group reading it."""
        return {
            "requests": self.requests,
            "rollouts": self.rollouts,
            "saw": self.saw,
            "deadletter": self.deadletter,
        }


STREAM_GROUPS = {"requests": GROUP_ACTORS, "rollouts": GROUP_CREDIT, "saw": GROUP_LEARNER}


def consumer_name(role: str) -> str:
    """Unique, human-readable consumer name: ``actor-host-pid-ab12``."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"

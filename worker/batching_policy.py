"""Continuous batching and the static (request-level) batching it is measured against, as one object.

The scheduler asks its policy two things and nothing else branches on the mode:

* when waiting requests may join the batch: every step (continuous), or only as a whole cohort once
  nothing is running, never backfilled (static);
* what happens to a member that ends normally: it leaves at once, or (``static`` with padding) it
  keeps its slot and its KV blocks and is computed greedily as padding until the cohort's longest
  member ends, as fixed-shape batch generation does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from protocol.engine_config import SchedulingMode


class Joining(enum.Enum):
    EVERY_STEP = "every_step"  # waiting requests fill any free room each step
    COHORT = "cohort"  # a new cohort fills the batch now; nothing joins it later
    CLOSED = "closed"  # a cohort is running: nothing joins


@dataclass(frozen=True)
class BatchingPolicy:
    cohorts: bool  # admit whole cohorts only when the batch is empty
    padding: bool  # finished cohort members keep running as padding

    @classmethod
    def for_mode(cls, mode: SchedulingMode | str) -> BatchingPolicy:
        mode = SchedulingMode(mode)
        return cls(cohorts=mode is not SchedulingMode.CONTINUOUS, padding=mode is SchedulingMode.STATIC)

    def joining(self, num_running: int) -> Joining:
        if not self.cohorts:
            return Joining.EVERY_STEP
        return Joining.CLOSED if num_running else Joining.COHORT

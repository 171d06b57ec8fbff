"""The scheduling policy: pure decisions, no Dask, no torch (see :mod:`.core`)."""

from digenrl.schedulers.policy.core import (HELD_REASONS, Decision, SchedulingPolicy, TaskInfo,
                                            WorkerInfo, validate_task)

__all__ = ["TaskInfo", "WorkerInfo", "Decision", "SchedulingPolicy", "validate_task",
           "HELD_REASONS"]

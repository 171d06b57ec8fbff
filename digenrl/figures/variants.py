"""The named schedule variants: every mode and ablation the benchmark compares.

A variant is a set of ``schedule.*`` overrides on top of the base work. ``digenrl bench``
runs them on one cluster (:mod:`digenrl.commands.bench`), ``digenrl simulate`` in the simulator
(:mod:`digenrl.sim.simulate`); both read them, and their schedule settings, from here.
"""

from __future__ import annotations

from typing import Any

from digenrl.config import ConfigError, ScheduleConfig
from digenrl.schedulers.switches import MODE_NAMES

__all__ = ["VARIANTS", "DEFAULT_VARIANTS", "variant_schedule"]

#: Named variants: schedule overrides on top of the base work.
VARIANTS: dict[str, dict[str, Any]] = {
    # Every mode as it is.
    **{mode: {"schedule.mode": mode} for mode in MODE_NAMES},
    # Each technique alone, on top of the synchronous disaggregated design.
    "gap": {"schedule.mode": "disaggregated", "schedule.gap": True},
    "tsp": {"schedule.mode": "disaggregated", "schedule.tsp": True},
    "tag": {"schedule.mode": "disaggregated", "schedule.tag": True},
    "rat": {"schedule.mode": "disaggregated", "schedule.tsp": True, "schedule.rat": True},
    "staleness-1": {"schedule.mode": "disaggregated", "schedule.max_staleness": 1},
    # DigenRL without asynchrony, and with it only for the tail bubble.
    "digenrl-sync": {"schedule.mode": "digenrl", "schedule.max_staleness": 0},
    "digenrl-tail": {"schedule.mode": "digenrl", "schedule.stale_groups": 1},
    # DigenRL with every chunk pinned to the worker it started on (no rebalancing).
    "digenrl-pinned": {"schedule.mode": "digenrl", "schedule.rebalance": False},
    # DigenRL without rollout-assisted training: only the trainers lend (TAG).
    "digenrl-no-rat": {"schedule.mode": "digenrl", "schedule.rat": False},
    # ... and without trainer-assisted generation: only the rollout workers lend.
    "digenrl-no-tag": {"schedule.mode": "digenrl", "schedule.tag": False},
}
#: What ``digenrl bench`` runs when no ``--variants`` are named.
DEFAULT_VARIANTS = ("colocated", "disaggregated", "digenrl", "gap", "tsp", "tag",
                    "staleness-1")


def variant_schedule(name: str) -> ScheduleConfig:
    """The schedule settings of variant ``name``: its overrides on the defaults, validated."""
    if name not in VARIANTS:
        raise ConfigError(f"variants: expected names from {sorted(VARIANTS)}, got {name!r}")
    fields = {}
    for key, value in VARIANTS[name].items():
        section, _, field = key.partition(".")
        if section != "schedule":
            raise ConfigError(f"variants.{name}: expected schedule.* overrides only, got {key!r}")
        fields[field] = value
    cfg = ScheduleConfig(**fields)
    cfg.validate()
    return cfg

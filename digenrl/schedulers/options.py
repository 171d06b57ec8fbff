"""Scheduling options. Pure data: the plugin, the policy and the simulator share it.

:class:`ScheduleOptions` has a field per switch the policy reads, declared here so that
readers and type checkers see them; each field's type, default and meaning are the
switch's own in :mod:`digenrl.schedulers.switches`, and importing this module checks
that every switch has its field, of its type and default, and no field is without a
switch (:func:`check_fields`). :data:`MODES` is each mode's preset of them.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from digenrl.schedulers.switches import SWITCHES, Switch, mode_presets, switches

__all__ = ["ScheduleOptions", "MODES", "check_fields"]


def _default(name: str) -> Any:
    """The declared default of plain setting ``name``."""
    return field(default=SWITCHES[name].default)


@dataclass(frozen=True, kw_only=True)
class ScheduleOptions:
    """What the scheduling policy does: a mode's preset with any switch overridden.
    Each field but ``mode`` is the switch of its name
    (:mod:`digenrl.schedulers.switches` says what it does); a mode preset has no
    default, since every options object starts from a preset."""

    mode: str
    pools: bool
    max_staleness: int
    gap: bool
    tsp: bool
    tag: bool
    rebalance: bool
    rat: bool
    transfer_bandwidth: float = _default("transfer_bandwidth")
    slots_per_worker: int = _default("slots_per_worker")
    context_parallel_wait: float = _default("context_parallel_wait")
    stall_timeout: float | None = _default("stall_timeout")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ScheduleOptions":
        return cls(**data)


def check_fields(cls: type, declared: tuple[Switch, ...], field_type, field_default) -> None:
    """``cls`` has ``mode`` and exactly a field per switch of ``declared``, each of the
    type ``field_type(switch)`` with the default ``field_default(switch)``
    (``dataclasses.MISSING``: none); raises TypeError naming the first that does not."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "mode"}
    for s in declared:
        if s.name not in fields:
            raise TypeError(f"{cls.__name__}: expected a field {s.name}: "
                            f"{field_type(s)} for the declared switch {s.name}, got none")
        if hints[s.name] != field_type(s):
            raise TypeError(f"{cls.__name__}.{s.name}: expected the type {field_type(s)} "
                            f"of its switch, got {hints[s.name]}")
        if fields[s.name].default != field_default(s):
            raise TypeError(f"{cls.__name__}.{s.name}: expected the default "
                            f"{field_default(s)!r} of its switch, got "
                            f"{fields[s.name].default!r}")
    extra = set(fields) - {s.name for s in declared}
    if extra:
        raise TypeError(f"{cls.__name__}: expected a declared switch for each field, got "
                        f"{sorted(extra)} without one")


check_fields(ScheduleOptions, tuple(s for s in switches() if s.scheduling),
             field_type=lambda s: s.type | None if s.nullable else s.type,
             field_default=lambda s: dataclasses.MISSING if s.preset else s.default)

#: Each mode is a preset of the scheduling switches; the graph is the same for all.
MODES: dict[str, dict[str, Any]] = mode_presets()

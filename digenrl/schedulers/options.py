"""Scheduling options. Pure data: the plugin, the policy and the simulator share it.

:class:`ScheduleOptions` and :data:`MODES` are built from the switches declared in
:mod:`digenrl.schedulers.switches`: one field per switch the policy reads, and each
mode's preset of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from digenrl.schedulers.switches import Switch, mode_presets, switches

__all__ = ["ScheduleOptions", "MODES"]


def _field(s: Switch) -> tuple[str, Any, dataclasses.Field]:
    """A mode preset is always given (every options object starts from a preset); a
    plain setting has its default."""
    kind = s.type | None if s.nullable else s.type
    if s.preset:
        return s.name, kind, dataclasses.field()
    return s.name, kind, dataclasses.field(default=s.default)


def _as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def _from_dict(cls, data: dict[str, Any]) -> "ScheduleOptions":
    return cls(**data)


_DOC = "\n".join(
    ["What the scheduling policy does: a mode's preset with any switch overridden.", ""]
    + [f"``{s.name}``: {s.help}" for s in switches() if s.scheduling])

#: ``mode`` and one field per scheduling switch (keyword arguments only).
ScheduleOptions = dataclasses.make_dataclass(
    "ScheduleOptions",
    [("mode", str, dataclasses.field())]
    + [_field(s) for s in switches() if s.scheduling],
    frozen=True, kw_only=True,
    namespace={"__module__": __name__, "__doc__": _DOC, "as_dict": _as_dict,
               "from_dict": classmethod(_from_dict)})

#: Each mode is a preset of the scheduling switches; the graph is the same for all.
MODES: dict[str, dict[str, Any]] = mode_presets()

"""The decision trail: per task, the decisions that held, released, placed or moved it.

Each rule notes its decisions on the task they concern (:meth:`SchedulingPolicy.note
<digenrl.schedulers.policy.core.SchedulingPolicy.note>`): the time, what happened (a
verb: ``held``, ``released``, ``lent``, ``stolen``, ``kept``, ...), the rule, the worker
and the reason. A task keeps its last :data:`TRAIL_LENGTH` decisions, like Dask's
transition log; the same decision taken again in a row (a worker declining the same
grad round after round) is counted on the entry rather than repeated. An entry is a
compact tuple whose reason is a template and its arguments: the text is formatted only
when the trail is read (:func:`trail_text`), so recording costs a tuple per decision,
and with the trail off (a policy made with ``trail=0``) a test where a decision is
taken.

The plugin stores each finished task's trail in the ``decisions`` column of its task
record (:mod:`digenrl.records`), one decision per line; :func:`story` tells a task's
story from such a record (``digenrl why``, the dashboard page, the simulator's records).
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Mapping, NamedTuple

__all__ = ["TRAIL_LENGTH", "Entry", "Step", "trail_text", "parse_trail", "story", "key_parts",
           "HELD", "ELIGIBLE", "DEFERRED", "REQUEUED", "RELEASED", "PLACED", "LENT",
           "STOLEN", "KEPT", "DECLINED", "WAITS", "LOST", "RETRIED"]

#: How many decisions a task keeps (the oldest go first).
TRAIL_LENGTH = 32

# What a decision did to its task (the verb of the story's line).
HELD = "held"             # ready, but held back (staleness, barrier)
ELIGIBLE = "eligible"     # no longer held
DEFERRED = "deferred"     # queued after its generation's steps (GAP)
REQUEUED = "requeued"     # queued at its own place again (GAP)
RELEASED = "released"     # released to a worker
PLACED = "placed"         # a task without a GPU slot released to a worker
LENT = "lent"             # a grad released to a rollout worker (RAT)
STOLEN = "stolen"         # taken from the worker holding its inputs (rebalance)
KEPT = "kept"             # not taken by a worker that could have (rebalance, TAG)
DECLINED = "declined"     # not lent to a rollout worker (RAT)
WAITS = "waits"           # ready, but no worker may take it yet (hand-off, pools)
LOST = "lost"             # back to waiting: its worker left or an input was lost
RETRIED = "retried"       # its release could not be applied: queued again

#: How the worker of an entry reads after its verb.
_PREPOSITION = {RELEASED: "to", PLACED: "on", LENT: "to", STOLEN: "by", KEPT: "from",
                DECLINED: "by"}


class Entry(NamedTuple):
    """One decision as recorded: its reason is ``reason.format(*args)``."""

    time: float
    verb: str
    rule: str
    worker: str
    reason: str
    args: tuple
    repeats: int = 0          # the same decision taken again right after, this many times
    last: float = math.nan    # when it was last taken again


class Step(NamedTuple):
    """One decision as read back from a record."""

    time: float
    verb: str
    rule: str
    worker: str
    reason: str
    repeats: int
    last: float

    def line(self, t0: float = 0.0) -> str:
        """``time  verb [to worker]: rule -- reason`` (times in seconds after ``t0``)."""
        who = f" {_PREPOSITION.get(self.verb, 'at')} {self.worker}" if self.worker else ""
        rule = f" {self.rule} --" if self.rule else ""
        again = (f" (taken again {self.repeats} times, last at {self.last - t0:.3f} s)"
                 if self.repeats else "")
        return f"{self.time - t0:10.3f} s  {self.verb}{who}:{rule} {self.reason}{again}"


def note(trail: list | None, entry: Entry, length: int = TRAIL_LENGTH) -> list:
    """``trail`` with ``entry`` added (a new list when ``trail`` is None): counted on the
    last entry when it is the same decision, the oldest dropped beyond ``length``."""
    if trail is None:
        return [entry]
    last = trail[-1]
    if (last.verb == entry.verb and last.rule == entry.rule and last.worker == entry.worker
            and last.reason == entry.reason):
        trail[-1] = last._replace(repeats=last.repeats + 1, last=entry.time)
        return trail
    if len(trail) >= length:
        del trail[0]
    trail.append(entry)
    return trail


def _one_line(text: str) -> str:
    return " ".join(text.replace("\t", " ").splitlines())


def trail_text(trail: Iterable[Entry] | None) -> str:
    """A trail as the text of the ``decisions`` column: one decision a line, its fields
    separated by tabs (time, verb, rule, worker, reason, repeats, last)."""
    if not trail:
        return ""
    return "\n".join(
        f"{e.time!r}\t{e.verb}\t{e.rule}\t{e.worker}\t"
        f"{_one_line(e.reason.format(*e.args) if e.args else e.reason)}\t{e.repeats}\t{e.last!r}"
        for e in trail)


def parse_trail(text: str) -> list[Step]:
    """The decisions of a ``decisions`` column's text (:func:`trail_text`)."""
    steps = []
    for line in (text or "").splitlines():
        time, verb, rule, worker, reason, repeats, last = line.split("\t")
        steps.append(Step(float(time), verb, rule, worker, reason, int(repeats), float(last)))
    return steps


def key_parts(text: str) -> tuple[str, ...]:
    """A task key's elements as text, however it is written: as a store prints it
    (``('grad', 3, 1, 2)``) or plainly (``grad,3,1,2``, ``grad 3 1 2``)."""
    return tuple(re.findall(r"[^\s,()\[\]'\"]+", str(text)))


def _time(value: Any, t0: float) -> str:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return "-"
    return "-" if math.isnan(v) or (v <= 0 < t0) else f"{v - t0:.3f} s"


def story(record: Mapping[str, Any], t0: float = 0.0) -> str:
    """A task's story from its record (the columns of :data:`digenrl.records.TASK_COLUMNS`
    it has): its kind, when it became ready and eligible, was released, started and
    stopped (seconds after ``t0``), which worker ran it, and every decision the policy
    noted on it, with the rule and the reason, in order. A record of a task not
    finished yet has its policy ``state`` instead (and the worker it is released to)."""
    key = record.get("key")
    lines = [f"{key}: {record.get('kind', '?')} of iteration {record.get('iteration', '?')}"
             f" (policy version {record.get('policy_version', '?')})"]
    worker = record.get("worker_name") or record.get("worker") or ""
    pool = record.get("pool") or ""
    flags = [name for name in ("tag", "rat", "stolen") if record.get(name)]
    if "state" in record:       # a task not finished yet: where it is now
        lines.append(f"  now {record['state']}" + (f" on {worker}" if worker else ""))
    else:
        lines.append(f"  ran on {worker or '-'}" + (f" ({pool} pool)" if pool else "")
                     + (f" [{', '.join(flags)}]" if flags else ""))
    times = [(name, record[name]) for name in ("ready", "eligible", "released", "start",
                                                "stop", "finished") if name in record]
    lines.append("  " + "  ".join(f"{name} {_time(v, t0)}" for name, v in times))
    if "decisions" not in record:
        lines.append("  (no decision trail recorded for this task)")
        return "\n".join(lines)
    steps = parse_trail(record["decisions"])
    if not steps:
        lines.append("  (no decision noted on this task)")
    lines += ["  " + s.line(t0) for s in steps]
    if len(steps) >= TRAIL_LENGTH:
        lines.append(f"  (a task keeps its last {TRAIL_LENGTH} decisions)")
    return "\n".join(lines)

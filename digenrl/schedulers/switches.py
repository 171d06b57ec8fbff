"""The scheduling switches, each declared once: its name, type, default, meaning and the
value each mode gives it.

Everything else about a switch is derived from its declaration here or checked against
it: the field of :class:`~digenrl.schedulers.options.ScheduleOptions` the policy reads
and the mode presets :data:`~digenrl.schedulers.options.MODES`; the field of the
config's ``schedule`` section (:class:`~digenrl.config.ScheduleConfig`), its check and
its line in the configuration reference; the command line's flag (``--gap/--no-gap``,
``--max-staleness``). Plain data, importing nothing of the project, so the scheduler,
the config and the command line all read it.

A new switch is one :func:`declare` call below, plus its field in ``ScheduleOptions``
(a switch the policy reads) and in ``ScheduleConfig`` (one a config sets): both classes
are declared for readers and type checkers, and importing them checks that each field
has its switch's type and default and that no switch lacks its field
(:func:`~digenrl.schedulers.options.check_fields`). The policy then reads it as
``options.NAME``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["Switch", "SWITCHES", "MODE_NAMES", "DEFAULT_MODE", "declare", "switches",
           "mode_presets"]

#: The modes: each is a preset of the switches that have a value per mode.
MODE_NAMES = ("colocated", "disaggregated", "digenrl")
#: The mode a config runs when it names none.
DEFAULT_MODE = "digenrl"


@dataclass(frozen=True)
class Switch:
    """One scheduling switch.

    A switch with ``modes`` is a mode preset: each mode gives it a value, the config's
    field is null ("the mode's") unless set, and the command line gets a flag (``--NAME``
    and ``--no-NAME`` for a bool, ``--NAME VALUE`` otherwise) saying ``title``. A switch
    without ``modes`` is a plain setting with a ``default``, set in the config only.
    """

    name: str
    #: bool, int or float.
    type: type
    #: What it does (the configuration reference and the policy's options say it).
    help: str
    #: A mode preset: the value each of :data:`MODE_NAMES` gives it.
    modes: Mapping[str, Any] | None = None
    #: A mode preset: the few words the command-line flag's help names it by.
    title: str = ""
    #: A plain setting: its value when the config sets none.
    default: Any = None
    #: A plain setting: null is a value of its own (its meaning is in ``help``).
    nullable: bool = False
    #: Bounds of a number: ``low`` (exclusive with ``low_open``) and ``high``.
    low: float | None = None
    low_open: bool = False
    high: float | None = None
    #: Mode -> why a run in that mode must keep the mode's value (the config refuses
    #: any other, naming the reason).
    fixed: Mapping[str, str] = field(default_factory=dict)
    #: False: only the mode sets it (no config field, no flag).
    configurable: bool = True
    #: False: a config setting that shapes the graph, not a decision of the policy
    #: (no field of ScheduleOptions).
    scheduling: bool = True

    def __post_init__(self) -> None:
        if self.type not in (bool, int, float):
            raise TypeError(f"switch {self.name}: type: expected bool, int or float, "
                            f"got {self.type!r}")
        if self.modes is not None and set(self.modes) != set(MODE_NAMES):
            raise ValueError(f"switch {self.name}: modes: expected a value for each of "
                             f"{list(MODE_NAMES)}, got {sorted(self.modes)}")
        if self.modes is not None and self.configurable and not self.title:
            raise ValueError(f"switch {self.name}: title: expected the words its "
                             f"command-line flag names it by")
        if self.modes is not None and not self.scheduling:
            raise ValueError(f"switch {self.name}: scheduling: expected true for a mode "
                             f"preset (the policy reads what a mode sets)")
        if not set(self.fixed) <= set(MODE_NAMES) or (self.fixed and self.modes is None):
            raise ValueError(f"switch {self.name}: fixed: expected modes of a mode "
                             f"preset, got {sorted(self.fixed)}")

    @property
    def preset(self) -> bool:
        """Whether each mode gives it a value (the config's null means the mode's)."""
        return self.modes is not None

    @property
    def flag(self) -> str:
        """Its command-line flag."""
        return "--" + self.name.replace("_", "-")


#: Every switch by name, in declaration order (the order of the config's fields).
SWITCHES: dict[str, Switch] = {}
_built = False


def declare(switch: Switch) -> Switch:
    """Add ``switch``. Only before :mod:`digenrl.schedulers.options` is imported: the
    options and the config's section are checked against the switches, and the flags
    built from them, then."""
    if _built:
        raise RuntimeError(f"switch {switch.name}: declared after "
                           f"digenrl.schedulers.options built the options from the "
                           f"switches; declare it in a module imported before")
    if switch.name in SWITCHES or switch.name == "mode":
        raise ValueError(f"switch {switch.name}: already declared")
    SWITCHES[switch.name] = switch
    return switch


def switches() -> tuple[Switch, ...]:
    """The declared switches, now final (what the options and the config are built
    from)."""
    global _built
    _built = True
    return tuple(SWITCHES.values())


def mode_presets() -> dict[str, dict[str, Any]]:
    """Each mode's preset: the value it gives each switch that has one."""
    return {mode: {s.name: s.modes[mode] for s in switches()
                   if s.modes is not None}      # (s.preset)
            for mode in MODE_NAMES}


def _modes(colocated: Any, disaggregated: Any, digenrl: Any) -> dict[str, Any]:
    return dict(zip(MODE_NAMES, (colocated, disaggregated, digenrl)))


declare(Switch(
    "pools", bool, configurable=False, modes=_modes(False, True, True),
    help="Rollout tasks only on rollout workers and training tasks only on trainers "
         "(otherwise every GPU worker is one colocated pool)."))
declare(Switch(
    "max_staleness", int, low=0, high=8, modes=_modes(0, 0, 1),
    title="the bounded staleness k",
    fixed={"colocated": "its phases are synchronous"},
    help="k: rollouts of iteration i start once version i - k exists; no sample is "
         "trained more than k versions old."))
declare(Switch(
    "gap", bool, modes=_modes(False, False, True), title="generation-axis pipeline",
    help="Generation-axis pipeline: a group's training starts as soon as it is scored, "
         "and denoising finishes groups one after another (otherwise training waits "
         "for the whole iteration)."))
declare(Switch(
    "tsp", bool, modes=_modes(False, False, True), title="time-step parallelism",
    help="Time-step parallelism: any trainer takes any micro-step (otherwise a chunk's "
         "micro-steps all run on the trainer the chunk is assigned to, as in "
         "data-parallel training)."))
declare(Switch(
    "tag", bool, modes=_modes(False, False, True), title="trainer-assisted generation",
    fixed={"colocated": "there is no trainer pool"},
    help="Trainer-assisted generation: idle trainers take rollout tasks while no "
         "training work is runnable."))
declare(Switch(
    "rebalance", bool, modes=_modes(True, True, True), title="straggler rebalancing",
    help="Straggler rebalancing: a worker with nothing of its own to generate takes a "
         "rollout step whose latents sit on another rollout worker only when it is "
         "expected to finish it sooner there, counting the transfer of the inputs it "
         "lacks at transfer_bandwidth, and a chunk starts on whichever worker frees "
         "first. false: a chunk runs on the worker that drew its noise, dealt "
         "round-robin."))
declare(Switch(
    "rat", bool, modes=_modes(False, False, True), title="rollout-assisted training",
    fixed={"colocated": "there is no rollout pool"},
    help="Rollout-assisted training: an idle rollout worker with no runnable rollout "
         "work takes one grad micro-step at a time when every trainer is busy and it is "
         "expected to finish the step no later than the trainers would (its input "
         "transfer counted); reductions, optimizer steps and the rest stay on "
         "trainers."))
declare(Switch(
    "transfer_bandwidth", float, default=1.0e9, low=0.0, low_open=True,
    help="Bytes/s the rebalancing assumes for moving a step's inputs between workers."))
declare(Switch(
    "stale_groups", int, nullable=True, low=0, scheduling=False,
    help="Leading prompt groups of an iteration generated with version i - k (null: "
         "all)."))
declare(Switch(
    "slots_per_worker", int, default=2, low=1,
    help="GPU tasks released to a worker at once (one runs, the rest wait on the "
         "worker and hide the scheduler round trip)."))
declare(Switch(
    "context_parallel_wait", float, default=60.0, low=0.0,
    help="Seconds a context-parallel step of degree d waits while fewer than d workers "
         "serve its pool (a lost worker's nanny restarts it, a replacement joins) before "
         "it runs at the largest degree dividing d that the workers there take; its "
         "later steps are placed at the full degree again once the pool is."))
declare(Switch(
    "stall_timeout", float, nullable=True, low=0.0, low_open=True,
    help="Seconds without a finished GPU task after which a run the progress watchdog "
         "cannot help stops, naming what it waits for (exit status 1; --resume "
         "continues it). null: many times the longest expected task, at least ten "
         "minutes (digenrl.schedulers.watchdog)."))

"""The pieces of a run in the cluster, as states (docs/architecture.md, "Where state
lives"): pure code, no Dask. The driver's :class:`~digenrl.run.driver.Pipeline` decides
when a piece goes in and what it reads; this records what is in and holds the futures
(any objects) each state needs, and a transition from a state it does not follow
raises :class:`IllegalTransition`.

An iteration moves ``planned -> rollout -> train -> tail -> collected``:

* ``rollout``: its rollout piece is in; it holds the futures the driver collects
  (decode, rewards) and those its train piece reads (the latents the micro-steps
  train on);
* ``train``: its advantages, micro-steps and reduction are in; the rollout's held
  futures are handed back to be released, the reduction's root is held for the tail;
* ``tail``: its optimizer step is in (which makes the next version); the root is
  handed back;
* ``collected``: the driver took its outputs (and its evaluations', which may join it
  in any state before).

A policy version's weights move ``stored -> published -> released`` (``stored``: a
resumed run's starting version, whose checkpoint the store holds and whose read-back
is not in yet; a version this run makes is published as its maker goes in). Its
published weights are held until released; its state read back is held until the tail
that starts from it takes it. Its checkpoint is, beside that, ``not written`` by this
run, ``writing`` (the checkpoint's future held until it is written) or ``written``
(or, for a version restored from the store, already there).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Iterable

from digenrl.vocabulary import Key

__all__ = ["IllegalTransition", "Stage", "Weights", "Checkpoint", "IterationPieces",
           "VersionPieces", "Pieces"]



class IllegalTransition(RuntimeError):
    """A piece was asked to move from a state that transition does not start from."""


class Stage(enum.IntEnum):
    """An iteration's pieces in the cluster, in the order they go in."""

    PLANNED = 0
    ROLLOUT = 1
    TRAIN = 2
    TAIL = 3
    COLLECTED = 4

    def __str__(self) -> str:
        return self.name.lower()


class Weights(enum.Enum):
    """A policy version's published weights."""

    STORED = "stored"        # in the store only: its read-back is not in yet
    PUBLISHED = "published"  # its publish is in; the run holds its weights
    RELEASED = "released"    # no longer retained: its weights were let go

    def __str__(self) -> str:
        return self.value


class Checkpoint(enum.Enum):
    """A policy version's checkpoint."""

    NOT_WRITTEN = "not written"  # this run does not write it (``store.checkpoint_every``)
    WRITING = "writing"
    WRITTEN = "written"

    def __str__(self) -> str:
        return self.value


def _illegal(what: str, move: str, state: Any, expected: Iterable[Any]) -> IllegalTransition:
    return IllegalTransition(f"{what}: cannot {move} in state {str(state)!r} "
                             f"(expected {' or '.join(repr(str(s)) for s in expected)})")


@dataclass
class IterationPieces:
    """One iteration's pieces in the cluster and the futures they hold."""

    iteration: int
    stage: Stage = Stage.PLANNED
    #: the futures of its outputs the driver collects
    outputs: dict[Key, Any] = field(default_factory=dict)
    #: the futures of its pieces that a later piece of it reads
    held: dict[Key, Any] = field(default_factory=dict)
    #: the futures of the evaluations collected with it
    evals: dict[Key, Any] = field(default_factory=dict)

    def _move(self, to: Stage) -> None:
        if self.stage is not Stage(to - 1):
            raise _illegal(f"iteration {self.iteration}", f"move to {str(to)!r}",
                           self.stage, [Stage(to - 1)])
        self.stage = to

    def rollout_in(self, outputs: dict[Key, Any], held: dict[Key, Any]) -> None:
        """Its rollout is in: ``outputs`` to collect, ``held`` for its train piece."""
        self._move(Stage.ROLLOUT)
        self.outputs.update(outputs)
        self.held = dict(held)

    def train_in(self, outputs: dict[Key, Any], held: dict[Key, Any]) -> list[Any]:
        """Its train piece is in: ``outputs`` to collect, ``held`` for its tail. Returns
        what the rollout held, which nothing needs any more."""
        self._move(Stage.TRAIN)
        self.outputs.update(outputs)
        done, self.held = list(self.held.values()), dict(held)
        return done

    def tail_in(self, outputs: dict[Key, Any]) -> list[Any]:
        """Its tail is in: ``outputs`` to collect. Returns what the train piece held."""
        self._move(Stage.TAIL)
        self.outputs.update(outputs)
        done, self.held = list(self.held.values()), {}
        return done

    def add_evals(self, evals: dict[Key, Any]) -> None:
        """Evaluations collected with it are in."""
        if self.stage is Stage.COLLECTED:
            raise _illegal(f"iteration {self.iteration}", "add evaluations", self.stage,
                           [s for s in Stage if s is not Stage.COLLECTED])
        self.evals.update(evals)

    def collect(self) -> dict[Key, Any]:
        """It is complete: hand over the futures of its outputs and evaluations."""
        self._move(Stage.COLLECTED)
        out, self.outputs, self.evals = {**self.outputs, **self.evals}, {}, {}
        return out


@dataclass
class VersionPieces:
    """One policy version's weights, state read back and checkpoint in the cluster."""

    version: int
    weights: Weights
    checkpoint: Checkpoint
    #: its publish task's future, while published
    published: Any = None
    #: its state read back, until the tail that starts from it takes it
    state: Any = None
    #: its checkpoint task's future, while writing
    writing: Any = None
    #: its evaluation is in (or not computed: none wanted, or stored already)
    evaluated: bool = False

    def publish(self, published: Any, state: Any = None) -> None:
        """Its read-back (``state``, None when no tail starts from it) and publish are
        in: from ``stored``."""
        if self.weights is not Weights.STORED:
            raise _illegal(f"version {self.version}", "publish it", self.weights, [Weights.STORED])
        self.weights, self.published, self.state = Weights.PUBLISHED, published, state

    def take_state(self) -> Any:
        """Hand its state read back to the tail that starts from it."""
        if self.weights is not Weights.PUBLISHED or self.state is None:
            raise IllegalTransition(f"version {self.version}: no state read back to take "
                                    f"(weights {str(self.weights)!r}, taken already or "
                                    f"none read)")
        state, self.state = self.state, None
        return state

    def written(self) -> Any:
        """Its checkpoint is written: hand back the checkpoint task's future."""
        if self.checkpoint is not Checkpoint.WRITING:
            raise _illegal(f"version {self.version}", "note its checkpoint written",
                           self.checkpoint, [Checkpoint.WRITING])
        self.checkpoint, f, self.writing = Checkpoint.WRITTEN, self.writing, None
        return f

    def release(self) -> Any:
        """It is no longer retained: hand back its published weights' future."""
        if self.weights is not Weights.PUBLISHED:
            raise _illegal(f"version {self.version}", "release", self.weights,
                           [Weights.PUBLISHED])
        self.weights, f, self.published = Weights.RELEASED, self.published, None
        return f

    def evaluate(self) -> None:
        """Its evaluation is in (or decided against)."""
        if self.evaluated or self.weights is not Weights.PUBLISHED:
            raise IllegalTransition(f"version {self.version}: cannot evaluate it "
                                    f"(weights {str(self.weights)!r}, evaluated "
                                    f"{self.evaluated})")
        self.evaluated = True


class Pieces:
    """Every iteration's and version's record in a run (created as first needed)."""

    def __init__(self) -> None:
        self.iterations: dict[int, IterationPieces] = {}
        self.versions: dict[int, VersionPieces] = {}

    def iteration(self, j: int) -> IterationPieces:
        """Iteration ``j``'s record (``planned`` when nothing of it is in yet)."""
        rec = self.iterations.get(j)
        if rec is None:
            rec = self.iterations[j] = IterationPieces(j)
        return rec

    def stage(self, j: int) -> Stage:
        rec = self.iterations.get(j)
        return Stage.PLANNED if rec is None else rec.stage

    def version(self, v: int) -> VersionPieces:
        """Version ``v``'s record (:class:`KeyError` when it has none yet)."""
        return self.versions[v]

    def stored(self, v: int) -> VersionPieces:
        """Version ``v`` is in the store (a resumed run restores it)."""
        if v in self.versions:
            raise _illegal(f"version {v}", "restore it from the store",
                           self.versions[v].weights, ["none"])
        rec = self.versions[v] = VersionPieces(v, Weights.STORED, Checkpoint.WRITTEN)
        return rec

    def made(self, v: int, published: Any, state: Any = None,
             checkpoint: Any = None) -> VersionPieces:
        """Version ``v`` is made in this run: its maker, read-back (``state``) and publish
        are in, and its checkpoint task when the run writes it (``checkpoint``)."""
        if v in self.versions:
            raise _illegal(f"version {v}", "make it", self.versions[v].weights, ["none"])
        rec = self.versions[v] = VersionPieces(
            v, Weights.STORED,
            Checkpoint.NOT_WRITTEN if checkpoint is None else Checkpoint.WRITING,
            writing=checkpoint)
        rec.publish(published, state)
        return rec

    def is_published(self, v: int) -> bool:
        """Whether version ``v``'s weights are published and held."""
        rec = self.versions.get(v)
        return rec is not None and rec.weights is Weights.PUBLISHED

    def in_weights(self, state: Weights) -> list[VersionPieces]:
        """The versions whose weights are in ``state``, oldest first."""
        return [r for v, r in sorted(self.versions.items()) if r.weights is state]

    def writing(self) -> list[VersionPieces]:
        """The versions whose checkpoint is being written, oldest first."""
        return [r for v, r in sorted(self.versions.items())
                if r.checkpoint is Checkpoint.WRITING]

    def describe(self) -> str:
        """Each iteration's stage and each version's states, for an error message."""
        its = ", ".join(f"{j}: {r.stage}" for j, r in sorted(self.iterations.items()))
        vs = ", ".join(f"{v}: {r.weights}/{r.checkpoint}"
                       for v, r in sorted(self.versions.items()))
        return f"iterations {{{its}}}, versions {{{vs}}}"

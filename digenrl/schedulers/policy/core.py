"""The core of the scheduling policy: tasks, workers, ready queues, and the decision round.

The plugin (or the simulator) feeds it events -- workers join and leave, tasks are
added, become ready, finish or are lost -- and asks it for decisions: which ready task to
release to which worker. The core keeps what every rule reads (the tasks and their
state, the workers and what is released to each, the ready queues, the facts several
rules read: :class:`~.state.Facts`) and, at each event, calls the rules of
:data:`RULES` that define it (:mod:`digenrl.schedulers.policy.rules`), in order: whether
a ready task is held, where it waits and in which order, which worker takes what, and
what each finished task teaches. It names no rule: a rule is added by its module and
one entry in :data:`RULES`.

A ready GPU task waits in a heap, most urgent first: rollout work with *affinity* to
the worker holding most of its input bytes (a chain's previous step), or to nobody;
training work in one queue, or one per trainer without TSP; background work apart.
Tasks that need no GPU are released at once (:mod:`.rules.pools`). A decision round
(:meth:`SchedulingPolicy.decide`) looks only at the workers whose slots changed and the
free workers that can take a kind of work that has new ready tasks; they take one task
per round, the least loaded first, so new work spreads over idle workers. A worker
takes tasks with affinity to it or to nobody first, and only then a task waiting for
another, busy worker (stealing, :mod:`.rules.rebalance`).

With a trail (``trail > 0``) every decision is noted on its task with the rule and the
reason (:mod:`.trail`); with ``trail=0`` (the simulator's default) nothing is recorded.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from typing import Any, Callable, Iterable, Mapping

from digenrl.schedulers.options import ScheduleOptions
from digenrl.schedulers.policy import trail as _trail
from digenrl.schedulers.policy.queues import ReadyEntry, ReadyQueues, more_urgent
from digenrl.schedulers.policy.rules import EVENTS, PASS, Pick, Rule
from digenrl.schedulers.policy.rules.background import Background
from digenrl.schedulers.policy.rules.gang import Gang
from digenrl.schedulers.policy.rules.gap import Gap
from digenrl.schedulers.policy.rules.handoff import Handoff
from digenrl.schedulers.policy.rules.pools import Pools, pool_problem, worker_pool
from digenrl.schedulers.policy.rules.rat import Rat
from digenrl.schedulers.policy.rules.rebalance import Rebalance
from digenrl.schedulers.policy.rules.staleness import Staleness, stale_training
from digenrl.schedulers.policy.rules.tag import Tag
from digenrl.schedulers.policy.rules.tsp import Tsp
from digenrl.schedulers.policy.state import (ADDED, DONE, FORGOTTEN, QUEUED, READY, RELEASED,
                                             Decision, Facts, Key, TaskInfo, WorkerInfo)
from digenrl.schedulers.policy.trail import LOST, RETRIED, TRAIL_LENGTH, Entry
from digenrl.vocabulary import COLOCATED, PUBLISH, ROLLOUT, TRAINER

__all__ = ["TaskInfo", "WorkerInfo", "Decision", "SchedulingPolicy", "validate_task",
           "HELD_REASONS", "RULES"]

#: The rules, in the order the core calls them at each event (:mod:`.rules`). Where the
#: first answer counts the order matters: training work before rollout work before
#: background work before lending a trainer to generation (:meth:`.Rule.take`), the
#: hand-off before the pools (:meth:`.Rule.place`), the newly eligible before the
#: requeued (:meth:`.Rule.published`), a steal noted before a trainer's lending, a
#: gang's members claimed before any other rule queues them (:meth:`.Rule.queue`).
RULES: tuple[type[Rule], ...] = (
    Staleness,
    Gang,
    Gap,
    Handoff,
    Tsp,
    Pools,
    Background,
    Rebalance,
    Tag,
    Rat,
)

#: Why a ready task is not running yet (telemetry).
HELD_REASONS = ("staleness", "barrier", "slot", "no-worker")


def validate_task(info: TaskInfo, options: ScheduleOptions) -> str | None:
    """Why ``info`` can never run under ``options`` (None when it can)."""
    return pool_problem(info) or stale_training(info, options)


class SchedulingPolicy:
    """Feed it events; call :meth:`decide` for the releases to make now.

    ``trail``: how many decisions each task keeps in its trail (:mod:`.trail`; 0: none
    are recorded), fixed when the policy is made. ``rules``: the rules' classes, in the
    order they are called (:data:`RULES`).
    """

    __slots__ = ("options", "clock", "trail_length", "tasks", "workers", "facts",
                 "rejected", "queues", "rules", "_on",
                 # the decision round
                 "dirty", "free", "new_rollout", "new_training", "_pool_lists", "_ranked",
                 "_seq", "_arrivals", "_copies", "_withdrawn", "_counts", "_released",
                 "_turn",
                 "__weakref__")      # (the rules hold the core weakly)

    def __init__(self, options: ScheduleOptions, clock: Callable[[], float] = time.time,
                 *, trail: int = TRAIL_LENGTH, rules: Iterable[type[Rule]] = RULES):
        self.options = options
        self.clock = clock
        self.trail_length = trail
        self.tasks: dict[Key, TaskInfo] = {}
        self.workers: dict[str, WorkerInfo] = {}
        # What several rules read, kept here (and the newest published version).
        self.facts = Facts(self.tasks, self.workers, options.transfer_bandwidth, clock,
                           busy=options.rebalance)
        self.rejected: dict[Key, str] = {}
        self.queues = ReadyQueues()
        # Which workers decide() must look at: those whose slots changed, and the free
        # workers of a kind of work that has new ready tasks.
        self.dirty: set[str] = set()
        # Workers with a free GPU slot, by pool.
        self.free: dict[str, set[str]] = {ROLLOUT: set(), TRAINER: set(), COLOCATED: set()}
        self.new_rollout = False
        self.new_training = False
        self._pool_lists: dict[str, list[WorkerInfo]] = {}
        self._ranked = True                        # every worker's rank is current
        self._seq = itertools.count()
        self._arrivals = itertools.count()
        self._turn: dict[str, int] = defaultdict(int)   # the next worker in turn, by pool
        # Results to copy to a worker ahead of need (see take_copies).
        self._copies: list[tuple[Key, str]] = []
        # Releases the rules took back (see take_withdrawn).
        self._withdrawn: list[Key] = []
        # Telemetry (releases are counted apart: one is counted per task).
        self._counts: dict[str, int] = defaultdict(int)
        self._released = 0
        # The rules, and for each event the bound methods of those defining it, in order.
        self.rules: tuple[Rule, ...] = tuple(cls(self) for cls in rules)
        self._on: dict[str, tuple] = {
            event: tuple(getattr(r, event) for r in self.rules
                         if getattr(type(r), event) is not getattr(Rule, event))
            for event in EVENTS}
        for r in self.rules:
            for event in EVENTS:
                if not callable(getattr(r, event)):
                    raise TypeError(f"{type(r).__name__}.{event}: expected the event's "
                                    f"method, got a {type(getattr(r, event)).__name__}")

    @property
    def version(self) -> int:
        """The newest published policy version (-1: none yet)."""
        return self.facts.version

    @version.setter
    def version(self, v: int) -> None:
        self.facts.version = v

    def rule(self, cls: type[Rule]) -> Rule:
        """The policy's rule of class ``cls`` (for tests and tools; the core calls its
        rules by event only)."""
        for r in self.rules:
            if type(r) is cls:
                return r
        raise KeyError(f"rule: expected one of {[type(r).__name__ for r in self.rules]}, "
                       f"got {cls.__name__}")

    # ------------------------------------------------------------------ workers

    def add_worker(self, address: str, name: str, pool: str | None, gpus: int,
                   speed: float = 1.0) -> None:
        """A worker joined. ``pool`` is its tag; with pools off every GPU worker is
        in the ``colocated`` pool. Untagged workers (or ones without GPU slots) are
        not used."""
        pool = worker_pool(pool, self.options)
        if gpus < 1 or pool is None:
            return
        w = self.workers[address] = WorkerInfo(address, name, pool, gpus,
                                               gpus * self.options.slots_per_worker, speed)
        self.dirty.add(address)
        self.free[pool].add(address)
        self._pool_lists.clear()
        self._ranked = False
        for told in self._on["worker_added"]:
            told(w)

    def remove_worker(self, address: str) -> list[Key]:
        """A worker left. Returns the tasks that were released to it (Dask brings them
        back as ready once their inputs exist again)."""
        w = self.workers.pop(address, None)
        self.dirty.discard(address)
        self._pool_lists.clear()
        self._ranked = False
        if w is None:
            return []
        self.free[w.pool].discard(address)
        lost = list(w.inflight | w.cpu_inflight)
        for key in lost:
            info = self.tasks.get(key)
            if info is not None:
                info.where = None
                if info.state is RELEASED:
                    info.state = ADDED
        for told in self._on["worker_removed"]:
            told(w)
        return lost

    def pool_of(self, address: str) -> str | None:
        w = self.workers.get(address)
        return w.pool if w else None

    def pool_workers(self, pool: str) -> list[WorkerInfo]:
        """The workers serving ``pool``, by name (cached until membership changes)."""
        key = pool if self.options.pools else COLOCATED
        cached = self._pool_lists.get(key)
        if cached is None:
            cached = sorted((w for w in self.workers.values()
                             if not self.options.pools or w.pool == pool), key=lambda w: w.name)
            self._pool_lists[key] = cached
        return cached

    def trainers(self) -> list[WorkerInfo]:
        return self.pool_workers(TRAINER)

    def in_turn(self, pool: str) -> WorkerInfo | None:
        """The next worker serving ``pool`` in turn (None: none serves it)."""
        workers = self.pool_workers(pool)
        if not workers:
            return None
        key = pool if self.options.pools else COLOCATED
        i = self._turn[key] % len(workers)
        self._turn[key] = i + 1
        return workers[i]

    # -------------------------------------------------------------------- tasks

    def add_tasks(self, infos: Iterable[TaskInfo]) -> dict[Key, str]:
        """Tasks entered the scheduler. Returns the rejected ones with the reason."""
        rejected = {}
        tasks, arrivals, options = self.tasks, self._arrivals, self.options
        told, back = self._on["added"], self.facts.back
        for info in infos:
            key = info.key
            if tasks.setdefault(key, info) is not info:
                continue   # known already
            info.state = ADDED
            info.order = next(arrivals)
            why = validate_task(info, options)
            if why is not None:
                self.rejected[key] = why
                rejected[key] = why
                continue
            back(info)
            for added in told:
                added(info)
        return rejected

    def task_ready(self, key: Key, locality: Mapping[str, int] | None = None) -> None:
        """All inputs of ``key`` exist; ``locality`` maps worker -> input bytes held
        (the policy keeps the mapping: pass one the caller no longer changes)."""
        info = self.tasks.get(key)
        if info is not None:
            self.ready(info, locality)

    def ready(self, info: TaskInfo, locality: Mapping[str, int] | None = None) -> None:
        """:meth:`task_ready` for a caller that holds the task: ``info`` is the object
        it passed to :meth:`add_tasks` (the simulator's tasks are such objects)."""
        if self.rejected and info.key in self.rejected:
            return
        if info.state in QUEUED:
            return  # a repeated event; DONE tasks may be recomputed after a loss
        info.locality = locality if locality is not None else {}
        now = None
        if info.ready_since is None:
            info.ready_since = now = self.clock()
        for holds in self._on["holds"]:
            if holds(info):
                return
        self.enqueue(info, now)

    def enqueue(self, info: TaskInfo, now: float | None = None) -> None:
        """``info`` is runnable: queue it (``now``: the clock, when the caller read it).
        A task without a GPU slot waits in the CPU queue; a GPU task in the ready heap
        the first rule to queue it picks (:meth:`.Rule.queue`), at the place in the
        order its rules give it (:meth:`.Rule.order`)."""
        info.state = READY
        if info.eligible_since is None:
            info.eligible_since = self.clock() if now is None else now
        if not info.gpu:
            self.queues.cpu[info.key] = info.locality or {}
            return
        entry = self._entry(info, next(self._seq), True)
        for queue in self._on["queue"]:
            if queue(info, entry):
                return
        raise AssertionError(f"no rule queues {info.key!r}")

    def _entry(self, info: TaskInfo, tie: int, queueing: bool) -> ReadyEntry:
        for order in self._on["order"]:
            entry = order(info, tie, queueing)
            if entry is not None:
                return entry
        raise AssertionError(f"no rule orders {info.key!r}")

    def affinity_of(self, loc: Mapping[str, int]) -> str | None:
        """The worker holding most of the input bytes ``loc`` (None: none, or a tie)."""
        best, best_bytes, tie = None, 0, False
        for addr, nbytes in loc.items():
            if addr not in self.workers or nbytes <= 0:
                continue
            if nbytes > best_bytes:
                best, best_bytes, tie = addr, nbytes, False
            elif nbytes == best_bytes:
                tie = True
        return None if tie else best

    def sort_key(self, key: Key) -> ReadyEntry:
        """The order in which ready tasks without a heap are looked at (the rules' order)."""
        info = self.tasks[key]
        return self._entry(info, info.order, False)

    def task_done(self, key: Key, worker: str | None = None,
                  duration: float | None = None) -> None:
        """``key`` finished on ``worker`` after computing for ``duration`` seconds."""
        info = self.tasks.get(key)
        if info is not None:
            self.done(info, worker, duration)

    def done(self, info: TaskInfo, worker: str | None = None,
             duration: float | None = None) -> None:
        """:meth:`task_done` for a caller that holds the task (see :meth:`ready`)."""
        self.facts.done(info, worker, duration)
        for done in self._on["done"]:
            done(info, worker, duration)
        self._unrelease(info)
        info.state = DONE
        info.locality = info.ready_since = info.eligible_since = None
        if info.kind == PUBLISH and info.policy_version > self.version:
            self.version = info.policy_version
            for published in self._on["published"]:
                published(info)
            # The rollout workers generate with it next: they fetch it now, while the
            # chunks it lets start draw their noise, not once their first steps are
            # released.
            pool = ROLLOUT if self.options.pools else COLOCATED
            self._copies.extend((info.key, w.address) for w in self.pool_workers(pool)
                                if w.address != worker)

    def task_lost(self, key: Key) -> None:
        """A released or ready task went back to waiting (its worker died, or an input
        was lost): it is not runnable until it is ready again."""
        info = self.tasks.get(key)
        if info is not None:
            self._lose(info, "", "its worker left or an input was lost")

    def withdraw(self, info: TaskInfo, rule: str, reason: str, *args: Any) -> None:
        """Rule ``rule`` takes back ``info``, released or done, because
        ``reason.format(*args)``: it waits to be ready again, as if lost, and the
        adapter puts it back (:meth:`take_withdrawn`)."""
        self._lose(info, rule, reason, *args)
        self._withdrawn.append(info.key)

    def take_withdrawn(self) -> list[Key]:
        """The tasks the rules took back (:meth:`withdraw`), handed over: the caller
        stops each where it runs, or drops its result, so that it is ready again."""
        out, self._withdrawn = self._withdrawn, []
        return out

    def _lose(self, info: TaskInfo, rule: str, reason: str, *args: Any) -> None:
        """``info`` goes back to waiting: not runnable until it is ready again."""
        if self.trail_length:
            self.note(info, LOST, rule, None, reason, *args)
        self._unrelease(info)
        info.state = ADDED
        self.queues.cpu.pop(info.key, None)
        for lost in self._on["lost"]:
            lost(info)
        self.facts.back(info)
        for back in self._on["back"]:
            back(info)
        info.locality = info.ready_since = info.eligible_since = None

    def task_failed(self, key: Key) -> None:
        info = self.tasks.get(key)
        if info is not None:
            self._unrelease(info)
            info.state = DONE
            info.ready_since = info.eligible_since = None

    def task_forgotten(self, key: Key) -> None:
        info = self.tasks.pop(key, None)
        if info is None:
            return
        state = info.state
        if state is RELEASED:
            self._unrelease(info)
        elif state is not DONE:
            # Held, or held once and then lost: drop it from the CPU queue (and, in the
            # rules, the holds).
            self.queues.cpu.pop(key, None)
        # Queued heap entries of a forgotten task are dead: its state is no longer READY.
        info.state = FORGOTTEN
        info.locality = None
        if self.rejected:
            self.rejected.pop(key, None)
        held = state is not RELEASED and state is not DONE
        self.facts.gone(info)
        for forgotten in self._on["forgotten"]:
            forgotten(info, held)

    def release_failed(self, keys: Iterable[Key]) -> None:
        """The adapter could not apply these releases (the worker vanished, or does not
        run tasks yet): each is queued again. All are taken back before any rule hears
        of one, so a gang whose release was not applied is not a failed step: none of
        its members ran."""
        infos = [info for info in map(self.tasks.get, keys)
                 if info is not None and info.state is RELEASED]
        for info in infos:
            if self.trail_length:
                self.note(info, RETRIED, "", None, "its release could not be applied "
                          "(its worker vanished, or does not run tasks yet)")
            self._unrelease(info)
            info.state = ADDED
        for info in infos:
            self.facts.back(info)
            for back in self._on["back"]:
                back(info)
            self.enqueue(info)

    def _unrelease(self, info: TaskInfo) -> None:
        addr = info.where
        if addr is None:
            return
        info.where = None
        w = self.workers.get(addr)
        if w is None:
            return
        if info.gpu:   # (released GPU tasks are in inflight, others in cpu_inflight)
            w.inflight.discard(info.key)
            self.dirty.add(addr)
            self.free[w.pool].add(addr)
            self.facts.unreleased(info, w)
            for unreleased in self._on["unreleased"]:
                unreleased(info, w)
            if self._lent(info, w):
                w.lent -= 1
        else:
            w.cpu_inflight.discard(info.key)

    # ------------------------------------------------------------ copies ahead

    def copy_ahead(self, key: Key, address: str) -> None:
        """Have ``address`` copy the result of ``key`` ahead of need (:meth:`take_copies`)."""
        self._copies.append((key, address))

    def take_copies(self) -> list[tuple[Key, str]]:
        """The results to copy ahead of need, each to a worker (in the order decided),
        handed over: the caller asks each worker to fetch its results, where they are
        still in memory and the worker is still there. They are a lent grad's gradient
        (to a trainer) and a newly published version's weights (to every rollout
        worker, or every worker without pools)."""
        out, self._copies = self._copies, []
        return out

    # ------------------------------------------------------------ expectations

    def expected_seconds(self, key: Key) -> float | None:
        """Expected seconds of ``key``, a released GPU task, on its worker (the
        progress watchdog's yardstick: :meth:`.Facts.expected_seconds`)."""
        return self.facts.expected_seconds(key)

    def longest_expected(self) -> float | None:
        """The longest :meth:`expected_seconds` a known task could have on any worker."""
        return self.facts.longest_expected()

    # ---------------------------------------------------------------- decisions

    def deadline(self) -> float | None:
        """The earliest time (this policy's clock) from which a round decides otherwise
        with no event before it (:meth:`.Rule.deadline`); None: none. A scheduler runs a
        round once it has passed."""
        times = [t for t in (deadline() for deadline in self._on["deadline"]) if t is not None]
        return min(times, default=None)

    def decide(self) -> list[Decision]:
        """Releases to make now (each is final: the task goes to that worker).

        Only workers whose slots changed, and the free workers that can take a kind of
        work that has new ready tasks, are looked at; they take one task per round, the
        least loaded first, so new work spreads over idle workers.
        """
        now = self.clock()
        out: list[Decision] = []
        if self.queues.cpu:
            placers = self._on["place"]
            for key in sorted(self.queues.cpu, key=self.sort_key):
                info = self.tasks[key]
                loc = self.queues.cpu[key]
                for place in placers:
                    w = place(info, loc)
                    if w is not PASS:
                        break
                else:
                    w = None
                if w is not None:
                    del self.queues.cpu[key]
                    out.append(self.release(info, w, now))
        candidates = self.dirty
        self.dirty = set()
        workers = self.workers
        rollout, training = self.new_rollout, self.new_training
        if rollout or training:
            # The free workers that may take the new kind of work: any worker without
            # pools; rollout workers rollout work and trainers training work; with TAG,
            # trainers with nothing released rollout work too.
            free = self.free
            if not self.options.pools:
                candidates |= free[COLOCATED]
            else:
                if rollout:
                    candidates |= free[ROLLOUT]
                if training:
                    candidates |= free[TRAINER]
                elif self.options.tag:
                    candidates.update(a for a in free[TRAINER] if not workers[a].inflight)
            self.new_rollout = self.new_training = False
        for wake in self._on["wake"]:
            wake(candidates)
        # The least loaded first, by name (ranks are unique: workers are never compared
        # themselves).
        if not self._ranked:
            ordered = sorted(workers.values(), key=lambda w: (w.name, w.address))
            for rank, w in enumerate(ordered):
                w.rank = rank
            self._ranked = True
        active = sorted((w for w in map(workers.get, candidates)
                         if w is not None and len(w.inflight) < w.slots),
                        key=lambda w: (len(w.inflight), w.rank))
        idle = [w for w in active if not w.inflight]
        while active:
            still = []
            for w in active:
                d = self._decide_one(w, now)
                if d is not None:
                    out.append(d)
                    if len(w.inflight) < w.slots:
                        still.append(w)
            active = still
        for round_over in self._on["round_over"]:
            out.extend(round_over(idle, now))
        return out

    def _decide_one(self, w: WorkerInfo, now: float) -> Decision | None:
        """What ``w`` takes in this round: the first rule's pick (:meth:`.Rule.take`),
        unless a rule puts another task before it or keeps the slot
        (:meth:`.Rule.ahead`)."""
        for take in self._on["take"]:
            pick = take(w, now)
            if pick is not None:
                return self.offer(w, pick, now)
        return None

    def offer(self, w: WorkerInfo, pick: Pick, now: float) -> Decision | None:
        """Release ``pick`` to ``w`` unless a rule puts another task before it or keeps
        the slot (:meth:`.Rule.ahead`); every pick goes through here."""
        for ahead in self._on["ahead"]:
            pick = ahead(w, pick)
            if pick is None:
                return None
        if self.trail_length:
            for taken in self._on["taken"]:
                taken(w, pick, now)
        return self.release(pick.info, w, now, stolen=pick.stolen)

    def take_rollout(self, w: WorkerInfo, now: float) -> tuple[TaskInfo | None, bool]:
        """The most urgent rollout step with affinity to ``w`` or to nobody; else one
        waiting for another worker that every rule lets ``w`` take (then True:
        stolen, :meth:`.Rule.lets`)."""
        affine = self.queues.affine.get(w.address)
        own = affine.peek() if affine is not None else None
        pick = more_urgent(own, self.queues.shared.peek())
        if pick is not None:
            return pick.info, False
        steal = self.queues.stealable.peek()
        if steal is None:
            return None, False
        for lets in self._on["lets"]:
            if not lets(w, steal.info, now):
                return None, False
        return steal.info, True

    def release(self, info: TaskInfo, w: WorkerInfo, now: float, *,
                stolen: bool = False) -> Decision:
        """Release ``info`` to ``w`` (``stolen``: from another worker's affinity). A GPU
        task of the other pool is lent: a rollout task to a trainer (TAG), a grad to a
        rollout worker (RAT)."""
        key = info.key
        info.state = RELEASED
        if info.affinity is not None and info.affinity == w.address:
            self.queues.stealable.one_dead()   # its entry among the stealable ones
        info.where = w.address
        tag = rat = False
        if info.gpu:
            inflight = w.inflight
            inflight.add(key)
            if len(inflight) >= w.slots:
                self.free[w.pool].discard(w.address)
            self.facts.released(info, w, now)
            for released in self._on["released"]:
                released(info, w, now)
            if self._lent(info, w):
                w.lent += 1
                tag, rat = w.pool == TRAINER, w.pool == ROLLOUT
                self._counts["tag_released" if tag else "rat_released"] += 1
        else:
            w.cpu_inflight.add(key)
        self._released += 1
        if stolen:
            self._counts["stolen"] += 1
        return Decision(key, w.address, now, tag, stolen, rat, info)

    @staticmethod
    def _lent(info: TaskInfo, w: WorkerInfo) -> bool:
        """Whether GPU task ``info`` on ``w`` is lent: of the other pool (with pools; a
        gang member runs on its own member's worker, lent never)."""
        return info.gang is None and w.pool != info.pool and w.pool != COLOCATED

    # ---------------------------------------------------------------- the trail

    def note(self, info: TaskInfo, verb: str, rule: str, w: WorkerInfo | None, reason: str,
             *args: Any) -> None:
        """Note a decision on ``info``'s trail: ``verb`` (:mod:`.trail`) by ``rule``, at
        worker ``w``, because ``reason.format(*args)`` (formatted when read). Callers
        test :attr:`trail_length` first, so a policy without a trail pays nothing."""
        info.trail = _trail.note(info.trail,
                                 Entry(self.clock(), verb, rule, w.name if w else "", reason,
                                       args),
                                 self.trail_length)

    def trail_of(self, key: Key) -> list[Entry]:
        """The decisions noted on ``key`` so far (empty when unknown or none)."""
        info = self.tasks.get(key)
        return list(info.trail or ()) if info is not None else []

    # ---------------------------------------------------------------- telemetry

    def count(self, counter: str, n: int = 1) -> None:
        """Add ``n`` to a telemetry counter (:attr:`counters`)."""
        self._counts[counter] += n

    @property
    def counters(self) -> dict[str, int]:
        """Telemetry: tasks ``released`` (of them ``tag_released`` to trainers and
        ``stolen`` from another worker's affinity, ``rat_released`` grads to rollout
        workers), steps ``kept`` on a slower worker, grads a rollout worker declined
        (``rat_declined``) because a trainer would finish them sooner or a chunk that
        may start was waiting for it."""
        counts = defaultdict(int, self._counts)
        counts["released"] = self._released
        return counts

    def held(self) -> dict[str, int]:
        """How many ready tasks wait, by reason: those a rule holds back (by its
        reason), those waiting for a slot, and those no worker may run."""
        counts = dict.fromkeys(HELD_REASONS, 0)
        for held in self._on["held"]:
            for reason, n in held().items():
                counts[reason] += n
        lenders = self._on["lends"]
        for info in self.tasks.values():
            if info.state is not READY:
                continue
            if (self.pool_workers(info.pool)
                    or any(self.pool_workers(pool) for pool in (lends(info) for lends in lenders)
                           if pool is not None)):
                counts["slot"] += 1
            else:
                counts["no-worker"] += 1
        return counts

    def ready_since(self, key: Key) -> float | None:
        info = self.tasks.get(key)
        return info.ready_since if info is not None else None

    def eligible_since(self, key: Key) -> float | None:
        """When ``key`` became ready and passed every hold (staleness, barrier)."""
        info = self.tasks.get(key)
        return info.eligible_since if info is not None else None

    def snapshot(self) -> dict[str, Any]:
        pools: dict[str, dict[str, Any]] = {}
        for w in self.workers.values():
            p = pools.setdefault(w.pool, {"workers": 0, "slots": 0, "busy": 0, "tag": 0,
                                          "rat": 0})
            p["workers"] += 1
            p["slots"] += w.slots
            p["busy"] += min(len(w.inflight), 1)
            p["tag"] += min(w.lent, 1) if w.pool == TRAINER else 0
            p["rat"] += min(w.lent, 1) if w.pool == ROLLOUT else 0
        return {
            "options": self.options.as_dict(),
            "policy_version": self.version,
            "pools": pools,
            "workers": {w.address: {"name": w.name, "pool": w.pool,
                                    "inflight": len(w.inflight),
                                    "tag": w.lent if w.pool == TRAINER else 0,
                                    "rat": w.lent if w.pool == ROLLOUT else 0}
                         for w in self.workers.values()},
            "held": self.held(),
            "rejected": {repr(k): v for k, v in self.rejected.items()},
            "counters": dict(self.counters),
            "tasks": len(self.tasks),
        }

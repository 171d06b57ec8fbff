"""Gangs: the members of a collective step are released together, or not at all.

A gang is one task per member of a collective group (the task annotation's ``gang``:
``(gang id, member index, size)``). Member ``i`` runs on the ``i``-th worker of its
pool (by name, as the pools list them), and only there. A gang spanning both pools
(``(gang id, member index, size, trainers)``: a sharded run's gang that publishes by
broadcast) puts its first ``trainers`` members on the trainer pool's workers and the
others on the rollout pool's, each in that order. A gang of ``denoise`` members (a
chunk's step computed with context parallelism) is *placed* instead: its members go to
any ``size`` workers of its pool, those of the chunk's previous step first (so a
chunk's steps stay on one set of workers), then idle ones, then the least loaded
(:meth:`Gang.placement`). The members wait here, in no ready heap, so no other rule sees
them: TAG, RAT and rebalancing never move one.

* **Released together**: once every member of a gang is ready (past every hold), the
  gang *reserves* its members' workers, the oldest complete gang first, each worker for
  one gang at a time: a reserved worker takes nothing else (:meth:`Gang.ahead` keeps
  its slot, an idle worker is lent nothing). When every reserved worker has nothing in
  flight, all members are released in the same round, each to its worker, where it
  runs at once: a member never waits behind another task on its worker while the
  others wait for it in the collective. A gang wider than its pool waits. A placed
  gang's workers are kept at the start of each round too, before any worker takes
  other work, so the workers that just finished a chunk's step are kept for its next.
  A placed gang that starts a chunk waits until every chunk of its iteration (and older
  ones) computed on one worker has started: the gangs take the iteration's tail.
* **Failing together**: a member that goes back to waiting (lost with its worker or an
  input, or ready again after it finished: its result was lost) while the other members
  are released or finished fails the gang's step: every other member is taken back
  (:meth:`SchedulingPolicy.withdraw`: stopped, or its result dropped), and the whole
  gang is released again once every member is ready again. Each failed step is noted in
  :attr:`Gang.failed` (one line each): a gang whose members keep state between steps
  (a sharded run's trainers) cannot simply run again, and its driver reads the line
  (the plugin's ``digenrl_gang_failed``) to form the gang anew. A placed gang's step
  (a chunk's context-parallel step) keeps no state: it simply runs again, on the workers
  placed then, and is counted in :attr:`Gang.retried` instead.
* **Kept for the chunk's next step**: a worker whose member of a placed gang is done
  is kept for the gang of the chunk's next step (:attr:`Gang.kept_for`) until that gang
  is released: it takes no other task that computes with the transformer, and no other
  chunk's gang is placed on it (a gang of the same chunk may be: a step run again). So
  the workers of a chunk's step, ending one by one, are not taken by other chunks'
  steps or lent micro-steps, and the chunk's next step finds them free together. Only
  a step still to be released is kept for (a step computed again because its result
  was lost is often followed by one that already runs or whose results are all held).
  A chunk under way that finds too few workers takes those kept for younger chunks'
  steps too: chunks whose next steps each keep a worker another needs (after a loss,
  two chunks ran at a lower degree on workers of their own) go on oldest first.
* **At a lower degree**: a placed gang whose pool has fewer workers than members waits
  ``options.context_parallel_wait`` seconds for it to grow back (:meth:`Gang.deadline`
  tells the plugin when a round is due), then runs at the largest degree ``k`` dividing
  its size that the workers serve (:meth:`Gang.degree`): members ``0..k-1`` are released
  together, and member ``i >= k`` after member ``i % k`` on its worker (it gives the
  result that member holds for it). The chunk's next gang is placed at full degree as
  soon as the pool is whole.
* **Run again on a member's word**: a member whose group failed where Dask sees
  nothing lost (its rendezvous timed out, a collective erred) says so
  (:meth:`Gang.rerun`, the plugin's ``digenrl_gang_rerun``): the step fails as if a
  member were lost, rather than wait for a loss that never comes.
* **Formations**: each release of a placed gang is noted in :attr:`Gang.formed` (its id,
  its members' workers by index and how many placed steps had failed before it), which
  the plugin hands to the members (the scheduler's metadata under
  :data:`~digenrl.vocabulary.CONTEXT_METADATA`): they learn there which workers form
  their group, and that a step run again forms a group of its own.

Its entry in :data:`~digenrl.schedulers.policy.core.RULES` comes before the rules that
queue ready work (TSP, background, rebalancing): the first rule to queue a task keeps it.
"""

from __future__ import annotations

from typing import Iterable

from digenrl.schedulers.policy.queues import ReadyEntry
from digenrl.schedulers.policy.rules import Pick, Rule
from digenrl.schedulers.policy.state import (DONE, RELEASED, Decision, Key, TaskInfo,
                                             WorkerInfo)
from digenrl.schedulers.policy.trail import KEPT, RELEASED as RELEASED_VERB, WAITS
from digenrl.vocabulary import DENOISE, EVAL, GRAD, ROLLOUT, TRAINER

__all__ = ["Gang"]

#: The kinds that compute with a worker's resident transformer, which a context-parallel
#: step makes context-parallel while it runs: none of them runs beside such a step.
WITH_TRANSFORMER = (DENOISE, EVAL, GRAD)


def _out(member: TaskInfo) -> bool:
    """Whether a gang's member was released: it runs, or it is done."""
    return member.state is RELEASED or member.state is DONE


class _Members:
    """One gang: its members by index, and which of them are ready to be released."""

    __slots__ = ("size", "members", "ready", "pool", "trainers", "placed", "degree",
                 "after", "released_after")

    def __init__(self, size: int, pool: str, trainers: int, placed: bool = False) -> None:
        self.size = size
        self.pool = pool
        #: Its members go to any workers of the pool (a context-parallel step).
        self.placed = placed
        #: Members on the trainer pool (the first ones); the others are on the rollout
        #: pool's workers (with pools).
        self.trainers = trainers
        self.members: dict[int, TaskInfo] = {}
        self.ready: set[int] = set()
        #: A placed gang released at a lower degree k: member index -> the worker it
        #: runs on once its leader (member ``index % k``, on the same worker) is done.
        self.after: dict[int, WorkerInfo] = {}
        #: The degree of its last release (a placed gang's; ``size`` unless lower).
        self.degree = size
        #: How many placed gangs' steps had failed at its last release (a placed
        #: gang's: :attr:`Gang.retried`, which its members read with its placement).
        self.released_after: int | None = None

    def complete(self) -> bool:
        return len(self.ready) == self.size


class Gang(Rule):
    """Releases each gang's members together, on their own workers."""

    __slots__ = ("gangs", "waiting", "reserved", "failed", "_failing", "homes", "retried",
                 "formed", "ended", "handing", "steps", "kept_for", "short", "lowered",
                 "due")
    name = "gang"

    def __init__(self, policy) -> None:
        super().__init__(policy)
        self.gangs: dict[int, _Members] = {}
        # Complete gangs not released yet, oldest first (dicts keep their order).
        self.waiting: dict[int, None] = {}
        # Worker address -> the gang it is kept for (set at the end of each round).
        self.reserved: dict[str, int] = {}
        #: Each failed step, oldest first: one line naming the gang and why.
        self.failed: list[str] = []
        self._failing = False      # taking a failed step's members back
        #: (iteration, chunk) -> its placed gang's last step: the gang's id and its
        #: workers, by member.
        self.homes: dict[tuple, tuple[int, list[str]]] = {}
        #: How many placed gangs' steps failed (each runs again).
        self.retried = 0
        #: Placed gangs released since the plugin last took them: (gang id, each
        #: member's worker address, :attr:`retried` at the release).
        self.formed: list[tuple[int, list[str], int]] = []
        #: Placed gangs whose members are all forgotten since the plugin last took them.
        self.ended: list[int] = []
        #: Whether :attr:`formed` and :attr:`ended` are kept (by a plugin that takes
        #: them; the simulator's members need no placement).
        self.handing = False
        #: (iteration, chunk, timestep) -> the placed gang computing that step.
        self.steps: dict[tuple, int] = {}
        #: Worker address -> (the gang of its chunk's next step, iteration, chunk): a
        #: worker whose part of a chunk's step is done is kept for the chunk's next step
        #: until that step is released, so a chunk's gang finds its workers free.
        self.kept_for: dict[str, tuple[int, int, int | None]] = {}
        #: Placed gang -> since when fewer workers than its members serve its pool
        #: (it runs at a lower degree once ``options.context_parallel_wait`` has passed).
        self.short: dict[int, float] = {}
        #: How many placed gangs' steps were released at a lower degree.
        self.lowered = 0
        #: Members of gangs released at a lower degree whose leader is done: each runs
        #: on its leader's worker in the next round.
        self.due: list[tuple[TaskInfo, WorkerInfo]] = []

    # ---------------------------------------------------------------- members

    def added(self, info: TaskInfo) -> None:
        if info.gang is not None:
            gid, index, size = info.gang[:3]
            g = self.gangs.get(gid)
            if g is None:
                trainers = info.gang[3] if len(info.gang) > 3 else size
                g = self.gangs[gid] = _Members(size, info.pool, trainers,
                                               placed=info.kind == DENOISE)
                if g.placed:
                    self.steps[(info.iteration, info.chunk, info.timestep)] = gid
            g.members[index] = info

    def queue(self, info: TaskInfo, entry: ReadyEntry) -> bool:
        """A ready member waits here, for the rest of its gang."""
        if info.gang is None:
            return False
        gid, index, size = info.gang[:3]
        g = self.gangs[gid]
        self._fail_step(g, info)
        g.ready.add(index)
        if self.noting:
            self.policy.note(info, WAITS, self.name, None,
                             "member {} of gang {}: {} of {} members ready", index, gid,
                             len(g.ready), size)
        if g.complete():
            self.waiting[gid] = None
        return True

    def done(self, info: TaskInfo, worker: str | None, duration: float | None) -> None:
        """A placed gang's member is done: its worker is kept for the chunk's next step
        (when the chunk has one still to be released), while the step's other members
        finish."""
        if info.gang is None or info.kind != DENOISE or info.where is None \
                or info.timestep is None:
            return
        g = self.gangs.get(info.gang[0])
        if g is not None and g.after:
            for index in [i for i in g.after if i % g.degree == info.gang[1]]:
                self.due.append((g.members[index], g.after.pop(index)))
        following = self.steps.get((info.iteration, info.chunk, info.timestep + 1))
        if following is not None and self._to_run(following):
            self.kept_for[info.where] = (following, info.iteration, info.chunk)

    def _to_run(self, gid: int) -> bool:
        """Whether gang ``gid`` is still to be released: none of its members runs or
        is done. A step computed again (its result was lost, and something still needs
        it) is often followed by a step that runs already or whose results are all
        held: that one is not released again, and a worker kept for it would never be
        freed."""
        g = self.gangs.get(gid)
        return g is not None and not any(map(_out, g.members.values()))

    def back(self, info: TaskInfo) -> None:
        """A member waits to be released again (lost, or its release failed)."""
        if info.gang is not None:
            g = self.gangs.get(info.gang[0])
            if g is not None:
                self._not_ready(info.gang[0], g, info.gang[1])
                self._fail_step(g, info)

    def forgotten(self, info: TaskInfo, held: bool) -> None:
        if info.gang is None:
            return
        gid, index = info.gang[:2]
        g = self.gangs.get(gid)
        if g is None or g.members.get(index) is not info:
            return
        del g.members[index]
        self._not_ready(gid, g, index)
        # (A member waiting to run after its leader is never released once forgotten.)
        g.after.pop(index, None)
        if self.due:
            self.due = [(d, w) for d, w in self.due if d is not info]
        if not g.members:
            del self.gangs[gid]
            self.short.pop(gid, None)
            if g.placed:
                if self.handing:
                    self.ended.append(gid)
                if self.steps.get((info.iteration, info.chunk, info.timestep)) == gid:
                    del self.steps[(info.iteration, info.chunk, info.timestep)]
                self._unkeep(gid)
                home = (info.iteration, info.chunk)
                if self.homes.get(home, (None,))[0] == gid:
                    del self.homes[home]

    def worker_removed(self, w: WorkerInfo) -> None:
        """A worker left: the members released to it are lost (Dask reports each
        later), which fails their gangs' steps now."""
        self.reserved.pop(w.address, None)
        self.kept_for.pop(w.address, None)
        for key in w.inflight:
            info = self.tasks.get(key)
            if info is not None and info.gang is not None:
                g = self.gangs.get(info.gang[0])
                if g is not None:
                    self._fail_step(g, info)
        # A member waiting to run after its leader on this worker: the leader's result
        # went with it, so the step runs again.
        waiting = [(g, g.members[i]) for g in self.gangs.values()
                   for i, at in g.after.items() if at is w]
        waiting += [(self.gangs[info.gang[0]], info) for info, at in self.due  # type: ignore[index]
                    if at is w]
        for g, info in waiting:
            self._fail_step(g, info)

    def _not_ready(self, gid: int, g: _Members, index: int) -> None:
        g.ready.discard(index)
        if gid in self.waiting:
            del self.waiting[gid]
            self._unreserve(gid)

    def _fail_step(self, g: _Members, info: TaskInfo) -> None:
        """``info`` must run (again): every other member released or finished is taken
        back, so that the gang runs again together."""
        if self._failing:
            return              # (a member taken back below comes back here)
        assert info.gang is not None    # (a member of g)
        gid, member = info.gang[:2]
        # A lower degree's members not released yet wait with the others.
        if g.after or self.due:
            g.ready.update(g.after)
            g.ready.update(d.gang[1] for d, _ in self.due if d.gang[0] == gid)  # type: ignore[index]
            self.due = [(d, w) for d, w in self.due if d.gang[0] != gid]  # type: ignore[index]
            g.after.clear()
        self._failing = True
        try:
            withdrawn = 0
            for other in list(g.members.values()):
                if other is not info and _out(other):
                    withdrawn += 1
                    self.policy.withdraw(other, self.name,
                                         "member {} of gang {} must run again: the gang's "
                                         "step fails, and runs again together",
                                         member, gid)
            if withdrawn and g.placed:
                self.retried += 1
            elif withdrawn:
                self.failed.append(f"gang {gid}'s step failed: member {member} "
                                   f"({info.key!r}) must run again after the others ran")
        finally:
            self._failing = False

    # ---------------------------------------------------------------- the round

    def member_workers(self, g: _Members) -> list[WorkerInfo] | None:
        """The worker of each member (by index), or None when the pool is too small."""
        if g.trainers < g.size and self.options.pools:
            trainers = self.policy.pool_workers(TRAINER)
            rollout = self.policy.pool_workers(ROLLOUT)
            others = g.size - g.trainers
            if len(trainers) < g.trainers or len(rollout) < others:
                return None
            return trainers[:g.trainers] + rollout[:others]
        pool = self.policy.pool_workers(g.pool)
        return pool[:g.size] if len(pool) >= g.size else None

    def placement(self, gid: int, g: _Members, taken) -> list[WorkerInfo] | None:
        """A placed gang's worker of each member (by index), among its pool's workers
        not in ``taken`` (addresses kept for older gangs) and not kept for another
        chunk's next step (unless too few are, for a chunk under way: those kept for
        younger chunks too): the worker member ``i`` of the chunk's previous step ran on
        first, then the idle workers, then the least loaded; None when too few. With
        fewer workers in the pool than members for ``options.context_parallel_wait``
        seconds, the gang runs at the largest degree ``k`` dividing its size that they
        can serve (:meth:`degree`): member ``i`` goes to member ``i % k``'s worker, and
        members ``k`` and above run there after it."""
        first = next(iter(g.members.values()))
        chunk = (first.iteration, first.chunk)
        whole = self.policy.pool_workers(g.pool)
        size = self.degree(gid, g, len(whole))
        if not size:
            return None
        pool = [w for w in whole if w.address not in taken
                and self.kept_for.get(w.address, (0, *chunk))[1:] == chunk]
        if len(pool) < size and chunk in self.homes:
            # Too few for a chunk under way: it takes workers kept for younger chunks'
            # next steps too. Chunks whose next steps each keep a worker another needs
            # (after a loss, two chunks ran at a lower degree on workers of their own)
            # never wait for each other: the oldest chunk's step goes on.
            pool = [w for w in whole if w.address not in taken
                    and self.kept_for.get(w.address, (0, *chunk))[1:] >= chunk]
        if len(pool) < size:
            return None
        home = self.homes.get(chunk, (0, []))[1]
        holders: dict[str, int] = {}
        for held, a in enumerate(home[:size]):
            holders.setdefault(a, held)
        ranked = sorted(pool, key=lambda w: (bool(w.inflight), w.address not in holders,
                                             len(w.inflight), w.busy_until, w.rank))[:size]
        out: list[WorkerInfo | None] = [None] * size
        rest = []
        for w in ranked:
            index = holders.get(w.address)
            if index is not None and out[index] is None:
                out[index] = w
            else:
                rest.append(w)
        for index in range(size):
            if out[index] is None:
                out[index] = rest.pop(0)
        return [out[index % size] for index in range(g.size)]  # type: ignore[misc]

    def degree(self, gid: int, g: _Members, serving: int) -> int:
        """The degree placed gang ``gid`` runs at with ``serving`` workers in its pool:
        its size when they are enough; else none (0) for ``options.context_parallel_wait``
        seconds from the first time they were not, then the largest divisor of its size
        that they can serve."""
        if serving >= g.size:
            self.short.pop(gid, None)
            return g.size
        now = self.policy.clock()
        since = self.short.setdefault(gid, now)
        if now - since < self.options.context_parallel_wait:
            return 0
        return max((k for k in range(1, serving + 1) if g.size % k == 0), default=0)

    def whole_chunks_from(self) -> float:
        """The oldest iteration with a chunk computed on one worker (no gang) that has
        not started (infinity when none): a placed gang that starts a chunk of that
        iteration or a later one waits (:meth:`behind`), so the gangs take the
        iteration's tail. Computed once a round."""
        oldest = float("inf")
        tasks = self.tasks
        for (iteration, _), keys in self.facts.unstarted.items():
            if iteration < oldest:
                for key in keys:
                    info = tasks.get(key)
                    if info is not None and info.gang is None:
                        oldest = iteration
                        break
        return oldest

    @staticmethod
    def behind(g: _Members, whole_from: float) -> bool:
        """Whether placed gang ``g`` starts a chunk (its first step) of iteration
        ``whole_from`` (:meth:`whole_chunks_from`) or a later one."""
        first = next(iter(g.members.values()))
        return first.timestep == 0 and first.iteration >= whole_from

    def wake(self, candidates: set[str]) -> None:
        """Keep each complete placed gang's workers before any worker takes other work
        this round (the oldest gang first)."""
        if not self.waiting:
            return
        gangs = self.gangs
        taken = {a for a, gid in self.reserved.items()
                 if gid in gangs and not gangs[gid].placed}
        reserved = {a: gid for a, gid in self.reserved.items() if a in taken}
        whole_from = self.whole_chunks_from()
        for gid in self.waiting:
            g = self.gangs[gid]
            if not g.placed or self.behind(g, whole_from):
                continue
            workers = self.placement(gid, g, taken)
            if workers is None:
                continue
            for w in workers:
                taken.add(w.address)
                reserved[w.address] = gid
        self.reserved = reserved

    def ahead(self, w: WorkerInfo, pick: Pick) -> Pick | None:
        """A worker kept for a gang takes nothing else; one computing its part of a
        placed gang's step takes no other task that computes with its transformer
        (:data:`WITH_TRANSFORMER`: the step makes it context-parallel while it runs)."""
        gid = self.reserved.get(w.address)
        if gid is not None:
            if self.noting:
                self.policy.note(pick.info, KEPT, self.name, w,
                                 "the worker is kept for gang {}, released once its "
                                 "members' workers are all free", gid)
            return None
        kept = self.kept_for.get(w.address)
        if kept is not None and pick.info.kind in WITH_TRANSFORMER:
            if self.noting:
                self.policy.note(pick.info, KEPT, self.name, w,
                                 "the worker is kept for gang {}, its chunk's next "
                                 "context-parallel step", kept[0])
            return None
        if pick.info.kind in WITH_TRANSFORMER:
            for key in w.inflight:
                info = self.tasks.get(key)
                if info is not None and info.gang is not None and info.kind == DENOISE:
                    if self.noting:
                        self.policy.note(pick.info, KEPT, self.name, w,
                                         "the worker computes its part of gang {}, a "
                                         "context-parallel step, which holds its model: "
                                         "nothing else runs beside it", info.gang[0])
                    return None
        return pick

    def round_over(self, idle: list[WorkerInfo], now: float) -> Iterable[Decision]:
        """Release every complete gang whose members' workers have nothing in flight,
        and keep the workers of the others (the oldest gang first, each worker for one
        gang; kept again from scratch at every round, so an older gang always comes
        first and no two gangs wait for each other)."""
        out: list[Decision] = []
        reserved: dict[str, int] = {}
        self.reserved = reserved
        policy = self.policy
        due, self.due = self.due, []
        for info, w in due:
            if self.noting:
                assert info.gang is not None    # (a member)
                gid, index = info.gang[:2]
                degree = self.gangs[gid].degree
                policy.note(info, RELEASED_VERB, self.name, w,
                            "member {} of gang {} runs after member {} on its worker: the "
                            "gang's step runs at degree {}", index, gid, index % degree,
                            degree)
            out.append(policy.release(info, w, now))
        if not self.waiting:
            return out
        whole_from = self.whole_chunks_from()
        for gid in list(self.waiting):
            g = self.gangs[gid]
            if g.placed and self.behind(g, whole_from):
                continue
            workers = (self.placement(gid, g, reserved) if g.placed
                       else self.member_workers(g))
            if workers is None:
                if self.noting:
                    for info in g.members.values():
                        self._note_too_few(gid, g, info)
                continue
            if any(w.address in reserved for w in workers):
                continue            # an older gang keeps one of its workers
            if any(w.inflight for w in workers):
                for w in workers:   # the workers drain first
                    reserved[w.address] = gid
                continue
            del self.waiting[gid]
            g.ready.clear()
            if g.placed:
                first = g.members[0]
                addresses = [w.address for w in workers]
                self.homes[(first.iteration, first.chunk)] = (gid, addresses)
                g.released_after = self.retried
                if self.handing:
                    self.formed.append((gid, addresses, self.retried))
                self._unkeep(gid)
                g.degree = len(set(addresses))
                if g.degree < g.size:
                    self.lowered += 1
                    self.short.pop(gid, None)
            for index, w in enumerate(workers):
                info = g.members[index]
                if index >= g.degree:
                    g.after[index] = w      # (runs after its leader, on its worker)
                    continue
                if self.noting:
                    if g.degree < g.size:
                        policy.note(info, RELEASED_VERB, self.name, w,
                                    "gang {} of {} members waited for its pool to serve "
                                    "them and runs at degree {} on the {} workers it has: "
                                    "member {} to worker {}", gid, g.size, g.degree,
                                    len(policy.pool_workers(g.pool)), index, w.name)
                    else:
                        policy.note(info, RELEASED_VERB, self.name, w,
                                    "all {} members of gang {} can take their part: "
                                    "released together, member {} to worker {} of its "
                                    "pool", g.size, gid, index, index)
                out.append(policy.release(info, w, now))
        return out

    def deadline(self) -> float | None:
        """When the first placed gang short of workers has waited
        ``options.context_parallel_wait`` seconds (it runs at a lower degree then)."""
        if not self.short:
            return None
        return min(self.short.values()) + self.options.context_parallel_wait

    def _note_too_few(self, gid: int, g: _Members, info) -> None:
        policy = self.policy
        if g.trainers < g.size and self.options.pools:
            policy.note(info, WAITS, self.name, None,
                        "gang {} needs {} workers of the trainer pool and {} of the rollout "
                        "pool: {} and {} serve them", gid, g.trainers, g.size - g.trainers,
                        len(policy.pool_workers(TRAINER)), len(policy.pool_workers(ROLLOUT)))
        elif g.placed and len(policy.pool_workers(g.pool)) >= g.size:
            policy.note(info, WAITS, self.name, None, "gang {} needs {} workers of its "
                        "pool: of its {}, too many are kept for older gangs or for their "
                        "chunks' next steps", gid, g.size, len(policy.pool_workers(g.pool)))
        else:
            policy.note(info, WAITS, self.name, None, "gang {} needs {} workers of its "
                        "pool: {} serve it", gid, g.size, len(policy.pool_workers(g.pool)))

    def _unkeep(self, gid: int) -> None:
        for a in [a for a, kept in self.kept_for.items() if kept[0] == gid]:
            del self.kept_for[a]

    def _unreserve(self, gid: int) -> None:
        for a in [a for a, g in self.reserved.items() if g == gid]:
            del self.reserved[a]

    def rerun(self, gid: int, failed: int) -> bool:
        """A member of placed gang ``gid``, released after ``failed`` failed steps,
        says its group failed where Dask sees nothing lost (a rendezvous that timed out,
        a collective that erred): the step fails, and runs again together (the members
        are taken back). Once per release: the word of another member of the same
        release, or of an older one, changes nothing. Returns whether it failed the
        step."""
        g = self.gangs.get(gid)
        if g is None or not g.placed or g.released_after != failed:
            return False
        out = [m for m in g.members.values() if _out(m)]
        if not out:
            return False
        g.released_after = None
        # (Taking one back fails the step: the others are taken back with it.)
        self.policy.withdraw(out[0], self.name, "gang {}'s group failed on its workers, "
                             "with nothing lost: its step runs again", gid)
        return True

    def take_formations(self) -> tuple[list[tuple[int, list[str], int]], list[int]]:
        """The placed gangs released (:attr:`formed`) and ended (:attr:`ended`) since
        the last call, for the plugin to hand to their members."""
        formed, ended = self.formed, self.ended
        self.formed, self.ended = [], []
        return formed, ended

    def members_of(self, gid: int) -> dict[int, Key]:
        """The known members of gang ``gid``: index -> key (for tests and tools)."""
        g = self.gangs.get(gid)
        return {i: info.key for i, info in g.members.items()} if g is not None else {}

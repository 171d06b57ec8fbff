"""Collective groups among Dask workers: ``torch.distributed`` process groups formed and
used inside Dask tasks.

Dask stays the control plane: it decides where and when each task runs, and the
scheduler is the only place the members meet. Every call here runs in a task's thread on
a worker, never on the worker's event loop (each blocks: on the scheduler's metadata, on
a store, on the other members).

**Members and ranks.** A group is named (``"trainer"``), has a *generation* (an int) and
an ordered member list: worker names in the order the scheduling policy lists its pool
(by name), so that member ``i`` is the worker the gang rule
(``digenrl/schedulers/policy/rules/gang.py``) runs member ``i`` of a gang on. A member's
rank is its index in that list. Every member runs :func:`join` in a task of its own
(pinned to its worker), with the same name, members and generation.

**Rendezvous.** Through the scheduler's metadata (``Client.set_metadata`` /
``get_metadata`` from the task's thread), under ``(METADATA, name, generation)``:

1. each member other than rank 0 announces itself: ``arrived/<its name>`` = a token new
   to this join;
2. rank 0 starts a ``torch.distributed.TCPStore`` on a port the OS picks (nothing
   fixed: no port, no shared file), waits until every other member has announced, and
   publishes ``store`` = its ``host:port``, a token naming this formation and the token
   of every member it answers; it keeps reading the announcements, and answers a member
   that announced itself again (its task taken back and sent again meanwhile) anew, with
   the same store, so it never waits for an announcement its member gave up;
3. each member waits for a published store that names its own token (an address
   published for an earlier join of the same generation is never used), connects to it
   and says so in it with its token; once every member has, with its latest token, rank
   0 gives the go-ahead in the store (the tokens it answers), each member says there that
   it goes ahead, and once every member has, the default process group is created on
   the store (``init_process_group``) with each member's rank, the group's size and
   ``timeout``. Before its word a member still gives up when its task is taken back;
   after it, it no longer does: so rank 0 enters torch's own rendezvous, where nothing
   interrupts it, only once every member is bound to enter it too.

**Timeouts.** Each wait of the rendezvous gives up after ``timeout`` seconds
(:class:`RendezvousTimeout`, naming the members that did not come), or as soon as the
scheduler takes the waiting task back (:class:`TakenBack`: cancelled, or sent to its
worker again; :class:`Attempt`), so a member whose peer was lost does not hold its
worker's thread until the timeout; and the process
group is created with ``timeout=timedelta(seconds=timeout)``: a collective whose peer is
lost fails after that long instead of hanging. With gloo it raises in the task; with NCCL
torch's watchdog ends the worker process (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, torch's
default), which the nanny restarts. The gang rule then takes the step's other members
back; the step runs again on a group joined anew. The timeout is
``cluster.collective_timeout``.

**Generations.** The live group of a name is reused by every later task of its
generation (:func:`group`: no second rendezvous). A group is rebuilt (a member lost,
replaced, or any change of members) by joining a newer generation, which tears the old
group down first (joining the same generation again forms it anew too: each join is a
formation of its own). A task of an older generation than the live group never runs on it:
:func:`group` and :func:`join` raise :class:`StaleGeneration`. A collective that failed
leaves its group unusable; the members join a newer generation.

**One group per process.** ``torch.distributed`` has one default process group per
process at a time (``destroy_process_group`` then ``init_process_group`` rebuilds it),
and every other group is made from it with ``new_group``, by every member of the default
group, in the same order. So a worker is in one group at a time here: the group is the
default process group, and joining another name while one is live is refused (leave it
first, :func:`leave`). Groups that overlap are *subgroups* of one group: ``join(...,
subgroups={"trainer": [...]})`` makes each declared subgroup with ``new_group`` on every
member at the end of the formation, in name order, and :meth:`Group.subgroup` gives a
member its handle. A group spanning trainers and rollout workers, for a weight broadcast,
is made this way: one group over both pools (the trainers first, in their pool's order,
then the rollout workers in theirs) with the trainers' FSDP group as its subgroup
``"trainer"``; the broadcast runs on the whole group from rank 0, a trainer.

**Backends.** ``cluster.collective_backend``: ``gloo``, ``nccl``, or ``auto`` (NCCL on a
worker whose torch sees a CUDA device, gloo elsewhere). A backend the worker cannot run
is refused in one line naming that field before anything is announced
(:func:`resolve_backend`; the world check asks the same of the driver's torch when the
run starts its own cluster). A group's tensors live on :attr:`Group.device`: the
worker's GPU under NCCL, the CPU under gloo.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch
import torch.distributed as dist

from digenrl.checks import choice, finite, is_int, require
from digenrl.config import COLLECTIVE_BACKENDS
from digenrl.tasks.worker import current_worker

__all__ = ["Group", "join", "group", "leave", "live", "failed", "poll", "Attempt", "TakenBack",
           "resolve_backend",
           "CollectiveError",
           "StaleGeneration", "NotJoined", "RendezvousTimeout", "METADATA", "BACKEND_FIELD",
           "TIMEOUT_FIELD"]

logger = logging.getLogger(__name__)

#: The scheduler metadata key under which every group's rendezvous is kept.
METADATA = "digenrl-collective"
#: The config fields a group's backend and timeout come from (named in the errors).
BACKEND_FIELD = "cluster.collective_backend"
TIMEOUT_FIELD = "cluster.collective_timeout"

T = TypeVar("T")


class CollectiveError(RuntimeError):
    """A collective group cannot be joined or used; the message says why."""


class StaleGeneration(CollectiveError):
    """A task of an older generation than the live group of its name."""


class NotJoined(CollectiveError):
    """No live group of that name and generation in this process."""


class RendezvousTimeout(CollectiveError):
    """The members did not all meet within the timeout."""


class TakenBack(CollectiveError):
    """The scheduler took back the task waiting for its group (cancelled, or sent again
    while it still ran)."""


class Attempt:
    """The Dask task this thread runs, as it was when this object was made: the
    scheduler may take it back while it runs (``cancelled``: Dask drops its outcome) or
    send it to this worker again (``sent_again``: the worker resumes this execution for
    the new run, but the execution reports the run id it began with, which the scheduler
    refuses as stale, and the task is sent anew; ``tests/schedulers/test_dask_contract.py``
    test 12). Either way this execution's outcome is not used."""

    __slots__ = ("_task", "run_id", "_stale")

    def __init__(self, task: Any, stale: Callable[[], bool] | None = None) -> None:
        self._task = task           # (the worker's TaskState)
        self.run_id = task.run_id
        #: What the caller knows makes the wait pointless besides the scheduler's own
        #: take-back (a gang placed anew: its group's generation is no longer wanted).
        self._stale = stale

    @classmethod
    def current(cls, stale: Callable[[], bool] | None = None) -> "Attempt | None":
        """This thread's task on its worker (None outside a Dask task)."""
        worker = current_worker()
        if worker is None:
            return None
        key = worker.active_threads.get(threading.get_ident())
        task = worker.state.tasks.get(key) if key is not None else None
        return cls(task, stale) if task is not None else None

    @property
    def cancelled(self) -> bool:
        return self._task.state == "cancelled"

    @property
    def sent_again(self) -> bool:
        return not self.cancelled and self._task.run_id != self.run_id

    @property
    def taken_back(self) -> bool:
        """Cancelled, or sent again: this execution no longer serves the run it began; or
        stale, as the caller says."""
        return self.cancelled or self.sent_again or (self._stale is not None and self._stale())


@dataclass(eq=False)
class Group:
    """A live collective group, as one member holds it."""

    name: str
    generation: int
    members: tuple[str, ...]
    rank: int
    backend: str
    timeout: float
    #: The token rank 0 drew for this formation: the same on every member of it.
    formation: str
    #: The store's ``host:port`` (rank 0's worker host).
    address: str
    process_group: Any
    #: Each declared subgroup's process group, None where this member is not in it.
    subgroups: dict[str, Any] = field(default_factory=dict)
    #: How many tasks have used this group through :func:`group`.
    uses: int = 0
    _store: Any = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def device(self) -> torch.device:
        """Where this group's tensors must be: the worker's GPU under NCCL, else the CPU."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def subgroup(self, name: str) -> Any:
        """The process group of the declared subgroup ``name``, to which this member
        belongs."""
        if name not in self.subgroups:
            raise CollectiveError(f"collective group {self.name!r} generation "
                                  f"{self.generation} declares no subgroup {name!r} "
                                  f"(declared: {sorted(self.subgroups)})")
        pg = self.subgroups[name]
        if pg is None:
            raise CollectiveError(f"worker {self.members[self.rank]!r} is not a member of "
                                  f"subgroup {name!r} of collective group {self.name!r}")
        return pg


#: The live group of this process (at most one: torch's default process group).
_LIVE: dict[str, Group] = {}
#: Held while a group is formed, used up or torn down.
_LOCK = threading.RLock()


def resolve_backend(requested: str) -> str:
    """The backend ``requested`` (``cluster.collective_backend``) means in this process:
    ``auto`` is NCCL where torch sees a CUDA device and has NCCL, gloo elsewhere. Raises
    :class:`~digenrl.checks.ConfigError` naming the field for one this process cannot
    run."""
    choice(requested, BACKEND_FIELD, COLLECTIVE_BACKENDS)
    distributed = dist.is_available()
    cuda = torch.cuda.is_available()
    nccl = distributed and cuda and dist.is_nccl_available()
    if requested == "auto":
        requested = "nccl" if nccl else "gloo"
    if requested == "nccl":
        why = ("this torch has no torch.distributed" if not distributed
               else "this torch sees no CUDA device" if not cuda
               else "this torch has no NCCL")
        require(nccl, BACKEND_FIELD, f"a backend the workers can run ({why}: gloo or auto)",
                requested)
    else:
        require(distributed and dist.is_gloo_available(), BACKEND_FIELD,
                "a backend the workers can run (this torch has no gloo)", requested)
    return requested


def live() -> Group | None:
    """The group this process is in now, if any."""
    with _LOCK:
        return next(iter(_LIVE.values()), None)


def group(name: str, generation: int) -> Group:
    """The live group ``name`` of ``generation`` in this process, for a task that uses
    it (no rendezvous). Raises :class:`StaleGeneration` when the live group is newer,
    :class:`NotJoined` when there is none of that generation."""
    with _LOCK:
        g = _LIVE.get(name)
        if g is not None and g.generation > generation:
            raise _stale(g, generation)
        if g is None or g.generation != generation:
            have = (f"its live generation is {g.generation}" if g is not None else
                    f"this process is in {_describe(live())}")
            raise NotJoined(f"collective group {name!r} generation {generation} was not "
                            f"joined on worker {_worker_name()!r} ({have}): join it first")
        g.uses += 1
        return g


def leave(name: str | None = None, generation: int | None = None) -> str | None:
    """Tear down the live group ``name`` (any live group with None) in this process, if
    it is of ``generation`` (any with None). Returns the name of the group left, None
    when there was none."""
    with _LOCK:
        g = live()
        if g is None or (name is not None and g.name != name) or \
                (generation is not None and g.generation != generation):
            return None
        _tear_down(g)
        return g.name


def failed(e: BaseException) -> bool:
    """Whether ``e`` is a failure of a group: this module's, or torch.distributed's (a
    collective that failed: a peer lost, a timeout, as gloo and NCCL raise it)."""
    if isinstance(e, CollectiveError):
        return True
    if not isinstance(e, RuntimeError):
        return False
    text = str(e)
    return isinstance(e, dist.DistError) or any(w in text for w in ("gloo", "Gloo", "NCCL",
                                                                      "Connection closed"))


def join(name: str, members: Sequence[str], generation: int, *, backend: str,
         timeout: float, subgroups: Mapping[str, Sequence[str]] | None = None,
         stale: Callable[[], bool] | None = None) -> Group:
    """Form generation ``generation`` of the group ``name`` with ``members`` (worker
    names, in their pool's order) from inside a Dask task on each member, and keep it in
    this process for later tasks (:func:`group`). ``backend`` and ``timeout`` are the
    run's ``cluster.collective_backend`` and ``cluster.collective_timeout``;
    ``subgroups`` declares named subsets of the members to make process groups of (see
    the module's text). A live group of the same name and an older or the same
    generation is torn down first; one of a newer generation raises
    :class:`StaleGeneration`. Every wait of the formation ends with :class:`TakenBack`
    once the scheduler takes the task back, or once ``stale()`` says this generation is
    no longer wanted (its peers form another)."""
    worker = _worker()
    me = str(worker.name)
    members = _check_members(members)
    require(isinstance(name, str) and bool(name) and "/" not in name, "name",
            "a non-empty group name without '/'", name, CollectiveError)
    require(is_int(generation) and generation >= 0, "generation", "an integer >= 0",
            generation, CollectiveError)
    finite(timeout, TIMEOUT_FIELD, 0.0, lo_open=True)
    require(me in members, "members", f"a list naming this worker ({me!r})", list(members),
            CollectiveError)
    subs = _check_subgroups(subgroups or {}, members)
    backend = resolve_backend(backend)
    with _LOCK:
        current = live()
        if current is not None:
            if current.name != name:
                raise CollectiveError(
                    f"worker {me!r} is in {_describe(current)}: a process is in one "
                    f"collective group at a time (leave it first, or make one group "
                    f"spanning both with subgroups)")
            if current.generation > generation:
                raise _stale(current, generation)
            _tear_down(current)
        if dist.is_initialized():
            raise CollectiveError(
                f"torch.distributed's default process group of worker {me!r} was "
                f"initialised outside digenrl.tasks.collective: a collective group "
                f"cannot be formed beside it")
        g = _form(worker, name, members, generation, backend, float(timeout), subs, stale)
        _LIVE[name] = g
        logger.info("worker %s joined %s as rank %d (backend %s, store %s)", me,
                    _describe(g), g.rank, backend, g.address)
        return g


# ------------------------------------------------------------------------- formation


def _form(worker: Any, name: str, members: tuple[str, ...], generation: int, backend: str,
          timeout: float, subgroups: dict[str, tuple[str, ...]],
          stale: Callable[[], bool] | None = None) -> Group:
    from distributed import get_client
    from distributed.comm import get_address_host

    client = get_client()
    me = str(worker.name)
    rank = members.index(me)
    key = [METADATA, name, str(generation)]
    deadline = time.monotonic() + timeout
    what = f"collective group {name!r} generation {generation}"
    token = uuid.uuid4().hex
    attempt = Attempt.current(stale)
    store = None
    try:
        if rank == 0:
            store = master = dist.TCPStore(get_address_host(worker.address), 0,
                                           world_size=len(members), is_master=True,
                                           wait_for_workers=False,
                                           timeout=timedelta(seconds=timeout))
            address = f"{get_address_host(worker.address)}:{master.port}"
            formation = token
            rendezvous = _Rendezvous(client, key, master, members, token, address, backend)
            poll(rendezvous.formed, deadline, lambda: (
                f"{what}: members {rendezvous.missing()} did not {rendezvous.stage} "
                f"within {timeout:g} s ({TIMEOUT_FIELD})"), attempt)
        else:
            client.set_metadata(key + ["arrived", me], token)

            def answer() -> dict | None:
                got = client.get_metadata(key + ["store"], default=None)
                ok = isinstance(got, dict) and (got.get("tokens") or {}).get(me) == token
                return got if ok else None

            published = poll(answer, deadline, lambda: (
                f"{what}: rank 0 ({members[0]!r}) published no store for worker {me!r} "
                f"within {timeout:g} s ({TIMEOUT_FIELD})"), attempt)
            address, formation = published["address"], published["formation"]
            if published["backend"] != backend:
                raise CollectiveError(
                    f"{what}: rank 0 ({members[0]!r}) runs {published['backend']}, worker "
                    f"{me!r} {backend}: every member runs one backend (set {BACKEND_FIELD})")
            host, port = address.rsplit(":", 1)
            store = joined = _connect(host, int(port), len(members), deadline, attempt, what)
            joined.set(f"{_CONNECTED}/{me}", token)
            poll(lambda: True if token in _read(joined, _FORM).split() else None, deadline,
                 lambda: (f"{what}: rank 0 ({members[0]!r}) gave worker {me!r} no go-ahead "
                          f"within {timeout:g} s ({TIMEOUT_FIELD})"), attempt)
            # From here this member no longer looks back: rank 0 waits for every
            # member to say so before it enters torch's own rendezvous.
            joined.set(f"{_GOING}/{me}", token)
        device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                  else None)
        dist.init_process_group(backend, store=store, rank=rank, world_size=len(members),
                                timeout=timedelta(seconds=timeout), device_id=device)
        made = {}
        for sub, names in sorted(subgroups.items()):
            pg = dist.new_group([members.index(m) for m in names],
                                timeout=timedelta(seconds=timeout), backend=backend)
            made[sub] = None if pg is dist.GroupMember.NON_GROUP_MEMBER else pg
        return Group(name, generation, members, rank, backend, timeout, formation, address,
                     dist.group.WORLD, made, _store=store)
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    finally:
        if rank != 0:
            # The announcement is used (or given up): a later join draws a new token.
            with contextlib.suppress(OSError):   # (a lost scheduler: the error above stands)
                client.set_metadata(key + ["arrived", me], None)


def poll(read: Callable[[], T | None], deadline: float, message: Callable[[], str],
         attempt: Attempt | None = None) -> T:
    """``read()`` until it gives something, at growing intervals (5 ms to 100 ms), or
    :class:`RendezvousTimeout` with ``message()`` once ``deadline`` passes, or
    :class:`TakenBack` once the scheduler takes ``attempt`` back (its peers' step
    failed: waiting longer only holds the worker's thread)."""
    pause = 0.005
    while True:
        value = read()
        if value is not None:
            return value
        if attempt is not None and attempt.taken_back:
            raise TakenBack("this task was taken back while it waited (by the scheduler, "
                            "or its caller no longer wants it): " + message())
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousTimeout(message())
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.1)


#: Keys of a formation's store: each member's connection, rank 0's go-ahead (the
#: tokens it answers), each member's word that it goes ahead.
_CONNECTED, _FORM, _GOING = "digenrl/connected", "digenrl/form", "digenrl/going"


def _read(store: Any, key: str) -> str:
    """The value of ``key`` in ``store``, empty while it has none."""
    return store.get(key).decode() if store.check([key]) else ""


class _Rendezvous:
    """Rank 0's side of a formation (see the module's text), one look at a time
    (:meth:`formed`). It follows each member's latest announcement: a member that
    announced itself again (its task taken back and sent again while rank 0 waited) is
    answered anew, with the same store, so that rank 0 never waits for an announcement
    its member gave up."""

    #: What rank 0 waits for at each stage, and the store key that holds each member's
    #: word (None: the scheduler's metadata).
    ARRIVE, CONNECT, GO = "arrive", "connect to rank 0's store", "take rank 0's go-ahead"
    STAGES = {ARRIVE: None, CONNECT: _CONNECTED, GO: _GOING}

    def __init__(self, client: Any, key: list[str], master: Any, members: tuple[str, ...],
                 token: str, address: str, backend: str) -> None:
        self.client, self.key, self.master = client, key, master
        self.members, self.others = members, members[1:]
        self.token, self.address, self.backend = token, address, backend
        self.tokens: dict[str, str] = {}         # the announcements answered
        self.go = ""                             # the go-ahead given
        self.stage = self.ARRIVE

    def formed(self) -> bool | None:
        """True once every member announced itself, connected to the store with its
        latest announcement and goes ahead; None before."""
        got = self._announced()
        if not all(got.get(m) for m in self.others):
            self.stage = self.ARRIVE
            return None
        tokens = {m: str(got[m]) for m in self.others}
        if tokens != self.tokens:
            self.tokens = tokens
            self.client.set_metadata(self.key + ["store"], {
                "address": self.address, "formation": self.token, "backend": self.backend,
                "tokens": {**tokens, self.members[0]: self.token}})
        if self.missing(self.CONNECT):
            self.stage = self.CONNECT
            return None
        go = " ".join(tokens.values())
        if go != self.go:
            self.master.set(_FORM, go)
            self.go = go
        if self.missing(self.GO):
            self.stage = self.GO
            return None
        return True

    def _announced(self) -> dict[str, Any]:
        """Each member's latest announcement (the scheduler's metadata)."""
        return self.client.get_metadata(self.key + ["arrived"], default=None) or {}

    def missing(self, stage: str | None = None) -> list[str]:
        """The members that have not reached ``stage`` (the one waited for last)."""
        held = self.STAGES[stage or self.stage]
        if held is None:
            got = self._announced()
            return [m for m in self.others if not got.get(m)]
        return [m for m in self.others
                if _read(self.master, f"{held}/{m}") != self.tokens.get(m)]


#: Seconds of one attempt to connect to rank 0's store (tried again until the deadline).
_CONNECT_TRY = 2.0


def _connect(host: str, port: int, size: int, deadline: float, attempt: Attempt | None,
             what: str) -> Any:
    """A client of rank 0's store at ``host:port``, tried in short attempts until
    ``deadline`` (rank 0 lost after it published the store: no one answers), each
    followed by a look at whether the task was taken back."""
    while True:
        left = deadline - time.monotonic()
        try:
            store = dist.TCPStore(host, port, world_size=size, is_master=False,
                                  timeout=timedelta(seconds=max(min(_CONNECT_TRY, left), 0.1)))
        except dist.DistError:
            if attempt is not None and attempt.taken_back:
                raise TakenBack(f"this task was taken back while it connected to {what}'s "
                                f"store (by the scheduler, or its caller no longer wants "
                                f"it)") from None
            if time.monotonic() >= deadline:
                raise
            continue
        store.set_timeout(timedelta(seconds=max(deadline - time.monotonic(), 1.0)))
        return store


def _tear_down(g: Group) -> None:
    """Destroy ``g``'s process groups (its subgroups with it) and stop its store."""
    _LIVE.pop(g.name, None)
    if dist.is_initialized():
        dist.destroy_process_group()
    g.process_group, g.subgroups, g._store = None, {}, None
    if g.rank == 0:
        try:   # its store is gone: the scheduler forgets its address
            from distributed import get_client

            get_client().set_metadata([METADATA, g.name, str(g.generation), "store"], None)
        except (ValueError, OSError) as e:   # no scheduler to tell (outside a task)
            logger.debug("the rendezvous of %s stays on the scheduler (%s)", _describe(g), e)


# ---------------------------------------------------------------------------- checks


def _worker() -> Any:
    worker = current_worker()
    if worker is None:
        raise CollectiveError("a collective group is joined from inside a Dask task on "
                              "each member (no worker runs this call)")
    return worker


def _worker_name() -> str:
    try:
        return str(_worker().name)
    except CollectiveError:
        return "(not a worker)"


def _check_members(members: Any) -> tuple[str, ...]:
    ok = (isinstance(members, Sequence) and not isinstance(members, str) and len(members) > 0
          and all(isinstance(m, str) and m for m in members)
          and len(set(members)) == len(members))
    require(ok, "members", "a non-empty list of distinct worker names", members,
            CollectiveError)
    return tuple(members)


def _check_subgroups(subgroups: Any, members: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    require(isinstance(subgroups, Mapping), "subgroups",
            "a mapping of subgroup names to lists of members", subgroups, CollectiveError)
    out = {}
    for sub, names in subgroups.items():
        require(isinstance(sub, str) and bool(sub), "subgroups", "non-empty names", sub,
                CollectiveError)
        names = _check_members(names)
        require(set(names) <= set(members), f"subgroups.{sub}",
                f"members of the group ({list(members)})", list(names), CollectiveError)
        out[sub] = names
    return out


def _describe(g: Group | None) -> str:
    if g is None:
        return "no collective group"
    return f"collective group {g.name!r} generation {g.generation}"


def _stale(g: Group, generation: int) -> StaleGeneration:
    return StaleGeneration(f"collective group {g.name!r}: a task of generation "
                           f"{generation} cannot run on the live generation {g.generation} "
                           f"(the group was rebuilt since)")

"""One chunk's denoise step computed by ``d`` processes together: Ulysses context
parallelism through diffusers' own (``ContextParallelConfig(ulysses_degree=d)`` and the
family's plan, :meth:`~digenrl.models.base.ModelFamily.context_parallel_plan`).

Each of the ``d`` processes (the members of a collective group, :mod:`.collective`)
holds the whole transformer and the chunk's whole inputs. The plan's hooks split the
token sequence: each process runs every layer on ``1/d`` of the image's tokens (and of
the text's, where the plan splits them), and inside each attention an all-to-all swaps
the split from tokens to heads, so each process attends over every token with ``heads/d``
heads, and back. The transformer's last projection gathers the tokens, so every process
gets the whole velocity, computes the same sampler step from it and returns the same
:class:`~digenrl.tasks.types.StepOut` as :func:`digenrl.tasks.rollout.denoise` at degree 1
(equal up to floating-point summation order).

:func:`context_parallel` makes the family's transformer context-parallel for the
duration of a ``with`` block (:func:`digenrl.tasks.ulysses.parallel`, after the family's
checks: a plan, heads the degree divides; and with its attention processors able to
split where they are not: ``ModelFamily.parallel_attention``), and :func:`denoise` is
:func:`digenrl.tasks.rollout.denoise` run inside one, so the sampler step is one code.
Outside the block the resident module computes as before, so other tasks of the worker
use it between steps; during the block every call of it is a collective step of the
group.

In a run (``rollout.context_parallel`` above 1) each step of a chunk is a gang of ``d``
``denoise`` tasks (:func:`denoise_member`), which the scheduler places on any ``d``
rollout workers and releases together; it hands the members the workers it chose (the
scheduler's metadata, :data:`~digenrl.vocabulary.CONTEXT_METADATA`). The members form a
collective group of those workers (:mod:`.collective`) named by them, and keep it for the
chunk's next steps, which the scheduler places on the same workers; a worker placed with
others leaves its group and joins theirs. A step that failed (a member lost) runs again
on a group formed anew: its generation counts the failed steps before it.
"""

from __future__ import annotations

import contextlib
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from distributed import get_client

from digenrl.config import ModelConfig
from digenrl.models import family
from digenrl.tasks import collective, rollout
from digenrl.tasks.collective import CollectiveError, Group, RendezvousTimeout
from digenrl.tasks.resident import resident
from digenrl.tasks.rollout import RolloutSpec
from digenrl.tasks.slowdown import this_worker
from digenrl.tasks.types import Latents, PolicyWeights, StepOut
from digenrl.tasks.ulysses import degree, parallel
from digenrl.vocabulary import CONTEXT_METADATA

if TYPE_CHECKING:
    from diffusers import ModelMixin

__all__ = ["context_parallel", "denoise", "ContextSpec", "denoise_member", "leave",
           "GROUP_PREFIX"]

#: The name of every context-parallel group starts so (then its workers' names).
GROUP_PREFIX = "context-"


@dataclass(frozen=True)
class ContextSpec:
    """How a run's context-parallel steps form their groups."""

    backend: str            # cluster.collective_backend
    timeout: float          # cluster.collective_timeout
    #: The run's first generation of its groups: newer than any earlier run's on the
    #: same workers (a failed step's group is formed again one generation up).
    generation: int


@contextmanager
def context_parallel(transformer: "ModelMixin", cfg: ModelConfig,
                     over: Group | Any) -> Iterator["ModelMixin"]:
    """``transformer`` (of the family ``cfg`` names) computing context-parallel over
    ``over`` (a collective group, or a device mesh:
    :func:`~digenrl.tasks.ulysses.parallel_config`) inside the block, by the family's
    plan: every member calls it with the same inputs and receives the whole output. Raises
    :class:`~digenrl.config.ConfigError` naming ``rollout.context_parallel`` before
    anything is changed when the family has no plan or its heads do not divide among
    the members."""
    fam = family(cfg)
    fam.check_context_parallel(degree(over))
    plan = fam.context_parallel_plan()
    assert plan is not None     # (the check refuses a family without one)
    with fam.parallel_attention(transformer), parallel(transformer, plan, over):
        yield transformer


def denoise(spec: RolloutSpec, weights: PolicyWeights, prompts: tuple[str, ...],
            iteration: int, t: int, previous: Latents | StepOut, over: Group | Any) -> StepOut:
    """:func:`digenrl.tasks.rollout.denoise` with its velocity computed by every member
    of ``over`` together (each calls this with the same arguments, in a task of its own)
    and the same result on each."""
    models = resident(spec.model, spec.model_seed, spec.trainable)
    with context_parallel(models.policy(weights), spec.model, over):
        return rollout.denoise(spec, weights, prompts, iteration, t, previous)


def denoise_member(spec: RolloutSpec, context: ContextSpec, gang: int, member: int,
                   weights: PolicyWeights, prompts: tuple[str, ...], iteration: int, t: int,
                   previous: Latents | StepOut) -> StepOut | None:
    """Member ``member`` of gang ``gang``: its part of a chunk's denoise step computed
    with context parallelism (:func:`denoise`), on the group of the workers the
    scheduler placed the gang on (formed, or kept from the chunk's previous step). Every
    member gives the step's result, which its own part of the next step reads, but at
    the chunk's last step only member 0 does (its decoding reads every member, so that
    each runs, and needs the latents once).

    When the group fails under it (a peer lost, a rendezvous timed out), the member
    leaves the group, so its other peers fail at once too, tells the scheduler (which
    may see nothing lost) and waits for it to take the step back
    (:func:`_after_failure`): once this attempt is cancelled, or sent to this worker
    again (whose outcome Dask refuses: see :class:`~.collective.Attempt`), it raises, and
    the task's new run starts afresh; if the step was placed anew with this member on
    this worker while this attempt still serves it, it computes the step again on the
    new placement. After ``cluster.collective_timeout`` without either, it raises all
    the same.

    A gang the scheduler placed on fewer workers than members (its pool shrank: degree
    ``k``, member ``i`` on member ``i % k``'s worker) computes the step at degree ``k``
    (alone at 1): members ``k`` and above run after their leader on its worker and give
    the result it holds for them (:data:`_HELD`)."""
    attempt = collective.Attempt.current()
    placed = _placement(context, gang, attempt)
    last = t >= len(spec.sigmas) - 2
    while True:
        workers = _workers(placed)
        k = len(workers)
        if member >= k:
            return None if last else _from_leader(gang, placed, member, k)
        group = None
        try:
            if k == 1:
                out = rollout.denoise(spec, weights, prompts, iteration, t, previous)
            else:
                group = _group_of(context, gang, workers, placed["failed"], member)
                out = denoise(spec, weights, prompts, iteration, t, previous, group)
            break
        except BaseException as e:
            if group is not None:
                collective.leave(group.name, group.generation)
            if not collective.failed(e):    # (forming the group, or a collective of it)
                raise
            anew = _after_failure(context, gang, member, placed, attempt,
                                  known=isinstance(e, collective.TakenBack))
            if anew is None:
                raise
            placed = anew
    followers = {m for m in range(k, len(placed["workers"])) if m % k == member}
    if followers and not last:
        _HELD.clear()       # (a step's, whose followers never ran: it ran again)
        _HELD[gang, placed["failed"]] = (out, followers)
    return out if member == 0 or not last else None


#: (gang, failed steps before it) -> the result of this process's member of a gang
#: placed at a lower degree, and the members still to give it (run after it here).
_HELD: dict[tuple[int, int], tuple[StepOut, set[int]]] = {}


def _workers(placed: dict) -> list[str]:
    """The distinct workers of a placement, in member order (member ``i`` of a gang at
    degree ``k`` runs on the ``i % k``-th)."""
    return list(dict.fromkeys(placed["workers"]))


def _from_leader(gang: int, placed: dict, member: int, k: int) -> StepOut:
    """Member ``member`` of gang ``gang`` placed at degree ``k`` on its leader's worker:
    the step's result its leader (member ``member % k``) computed and holds here."""
    held = _HELD.get((gang, placed["failed"]))
    if held is None or member not in held[1]:
        raise CollectiveError(f"context-parallel gang {gang}: member {member} runs on "
                              f"member {member % k}'s worker, which holds no result of "
                              f"the step for it")
    out, followers = held
    followers.discard(member)
    if not followers:
        del _HELD[gang, placed["failed"]]
    return out


def _placement(context: ContextSpec, gang: int, attempt: collective.Attempt | None) -> dict:
    """The scheduler's placement of gang ``gang`` (set as it releases the gang)."""
    return collective.poll(
        lambda: _placed_now(gang), time.monotonic() + context.timeout,
        lambda: (f"context-parallel gang {gang}: no placement of its members within "
                 f"{context.timeout:g} s ({collective.TIMEOUT_FIELD})"), attempt)


def _placed_now(gang: int) -> dict | None:
    """The scheduler's latest placement of gang ``gang`` (None before the first)."""
    return get_client().get_metadata([CONTEXT_METADATA, str(gang)], default=None)


def _placed_anew(gang: int, failed: int) -> dict | None:
    """The scheduler's placement of gang ``gang`` when it is newer than the one made
    after ``failed`` failed steps (the step was placed anew), else None."""
    now = _placed_now(gang)
    return now if isinstance(now, dict) and now["failed"] != failed else None


def _after_failure(context: ContextSpec, gang: int, member: int, placed: dict,
                   attempt: collective.Attempt | None, known: bool) -> dict | None:
    """After this member's group failed (member ``member`` of the step ``placed``):
    unless the scheduler already took the step back (``known``), tell it the group
    failed (its rendezvous timed out, or a collective erred: it may see nothing lost),
    so that it runs the step again now (:meth:`Gang.rerun
    <digenrl.schedulers.policy.rules.gang.Gang.rerun>`); then wait until it takes the
    step back, at most ``context.timeout`` seconds.
    None once this attempt is cancelled or sent again (the member raises: Dask drops
    or refuses its outcome, and a sent-again task's new run starts afresh), or the time
    is up; the new placement when the step was placed anew with this member on this
    worker while this execution still serves it (as when its peer's step failed while
    this member formed the group)."""
    if attempt is None:
        return None
    me = this_worker()
    if not known:
        client = get_client()
        with contextlib.suppress(OSError):   # (a lost scheduler: the error stands)
            client.sync(client.scheduler.digenrl_gang_rerun, gang=gang,
                        failed=placed["failed"])

    def taken_back() -> tuple[dict | None] | None:
        if attempt.cancelled or attempt.sent_again:
            return (None,)
        # (The scheduler writes a placement before it sends the members.)
        now = _placed_anew(gang, placed["failed"])
        return (now,) if now is not None and now["workers"][member] == me else None

    with contextlib.suppress(RendezvousTimeout):    # (the step's own error is raised)
        return collective.poll(taken_back, time.monotonic() + context.timeout, lambda: "")[0]
    return None


def _group_of(context: ContextSpec, gang: int, workers: list[str], failed: int,
              member: int) -> Group:
    """This member's group over the distinct ``workers`` of gang ``gang``'s placement
    after ``failed`` failed steps: the live one where it is theirs, else joined. Its
    formation gives up once the gang is placed anew (a peer that read the newer
    placement forms another generation)."""
    name = GROUP_PREFIX + "+".join(workers)
    generation = context.generation + int(failed)
    live = collective.live()
    if live is not None and live.name == name and live.generation == generation:
        group = collective.group(name, generation)
    else:
        if live is not None and live.name != name:
            if not live.name.startswith(GROUP_PREFIX):
                raise CollectiveError(
                    f"rollout.context_parallel: worker {workers[member]!r} is in "
                    f"collective group {live.name!r}, and a process is in one group at a "
                    f"time: its context-parallel steps cannot form their own")
            collective.leave(live.name)
        group = collective.join(name, tuple(workers), generation, backend=context.backend,
                                timeout=context.timeout,
                                stale=lambda: _placed_anew(gang, failed) is not None)
    if group.rank != member:
        raise CollectiveError(f"context-parallel group {name!r}: member {member} joined "
                              f"as rank {group.rank}")
    return group


def leave() -> str | None:
    """Leave this process's context-parallel group, if it is in one (the run is over).
    Returns its name."""
    _HELD.clear()
    live = collective.live()
    if live is None or not live.name.startswith(GROUP_PREFIX):
        return None
    return collective.leave(live.name)

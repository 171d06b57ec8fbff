"""Context-parallel degree: how many rollout workers compute one chunk's denoise steps
together, chosen from step times. A pure decision, no Dask.

A chunk's steps at degree ``d`` run as a gang on ``d`` rollout workers (Ulysses context
parallelism: each holds ``1/d`` of the tokens), so ``workers // d`` chunks advance at
once, each faster than on one GPU by less than ``d`` (its efficiency and the attention's
all-to-alls). Many chunks per worker: degree 1 keeps every GPU busy at full
efficiency. Few chunks (a long video's iteration, a small pool): degree 1 leaves GPUs
idle while the chunks finish, and a higher degree ends the generation sooner.

:func:`choose_parallelism` takes, per degree, the seconds one sample's chain of steps
takes (measured where a degree has run, the cost model's prediction elsewhere: such a
degree is *probed*, named in the choice), the samples, the free rollout workers and the
memory a sample's activations need, and picks the degree and chunk size whose
generation ends first. The scheduler releases a chunk's steps one at a time, each to
the gang (or worker) free next, so the gangs share the chunks' steps rather than
taking whole chunks in waves: the generation lasts one chain, or the chains' work over
the gangs where there are more chunks than gangs (:func:`generation_seconds`).

:func:`degree_plan` gives every chunk of an iteration that degree, and where its gangs
leave workers idle (fewer chunks than gangs) widens some of them onto the idle ones
(:func:`widen`): the generation ends as before and the widened chunks sooner, and no
worker is left beside the gangs for the next iteration's gangs to start on and share
their workers step by step (which, in a design that overlaps iterations, slows both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

__all__ = ["ParallelChoice", "generation_seconds", "choose_parallelism", "degree_plan",
           "widen", "DEGREES", "CP_EFFICIENCY", "speedup", "DegreePlan", "plan_degrees",
           "memory_bound"]

#: The degrees ``auto`` considers: powers of two, as attention heads divide by them.
DEGREES = (1, 2, 4, 8)


@dataclass(frozen=True)
class ParallelChoice:
    """A degree and chunk size, the generation's predicted seconds with them, and the
    degrees whose seconds were predicted rather than measured (probed when used)."""

    degree: int
    chunk_size: int
    seconds: float
    probes: tuple[int, ...] = ()
    #: Each degree it could take (within the workers and a sample's memory), lowest
    #: first, with one sample's chain seconds at it (measured where known).
    chains: tuple[tuple[int, float], ...] = ()


def generation_seconds(sample_seconds: float, samples: int, workers: int, degree: int,
                       chunk_size: int) -> float:
    """Seconds to generate ``samples`` in chunks of ``chunk_size`` on ``workers`` GPUs at
    ``degree`` (``sample_seconds``: one sample's chain at that degree; a chunk of ``b``
    takes ``b`` times it): one chain, or, with more chunks than gangs, the chains' work
    shared by the gangs step by step."""
    gangs = workers // degree
    if gangs < 1:
        return math.inf
    chunks = math.ceil(samples / chunk_size)
    return max(1.0, chunks / gangs) * chunk_size * sample_seconds


def choose_parallelism(samples: int, workers: int, *, predicted: Mapping[int, float],
                       measured: Mapping[int, float] | None = None,
                       sizes: Sequence[int] = (1,), sample_gb: float = 0.0,
                       free_gb: float = math.inf) -> ParallelChoice:
    """The degree and chunk size that generate ``samples`` soonest on ``workers`` free
    rollout GPUs. ``predicted`` / ``measured``: per degree, seconds of one sample's
    chain (the measured value wins); ``sizes``: the chunk sizes allowed;
    ``sample_gb``: one sample's activations at degree 1, of which each of ``d`` GPUs
    holds ``1/d``, within ``free_gb`` per GPU. Ties go to the lower degree, then the
    larger chunk."""
    if samples < 1 or workers < 1:
        raise ValueError(f"samples, workers: expected at least 1 each, got {samples}, "
                         f"{workers}")
    measured = measured or {}
    best: tuple[float, int, int] | None = None
    chains: list[tuple[int, float]] = []
    for d in sorted(set(predicted) | set(measured)):
        if d > workers:
            continue
        t = measured.get(d, predicted.get(d))
        if t is None or not t > 0:
            continue
        fits = [b for b in sizes if b * sample_gb / d <= free_gb]
        if fits:
            chains.append((d, t))
        for b in fits:
            s = generation_seconds(t, samples, workers, d, b)
            key = (s, d, -b)
            if best is None or key < (best[0], best[1], -best[2]):
                best = (s, d, b)
    if best is None:
        raise ValueError(f"free_gb: expected room for one sample's activations "
                         f"({sample_gb:g} GB / degree) at a degree of at most {workers}, "
                         f"got {free_gb:g}")
    s, d, b = best
    return ParallelChoice(d, b, s, () if d in measured else (d,), tuple(chains))


def degree_plan(chunks: int, workers: int, choice: ParallelChoice) -> list[int]:
    """The degree of each of an iteration's ``chunks`` (in order) on ``workers``: the
    ``choice``'s degree for every chunk, widened onto the workers its gangs leave idle
    (:func:`widen`, the last chunks widest) where it is above 1. A degree-1 plan leaves
    its idle workers to whole chunks of the next iteration, at full efficiency."""
    d = choice.degree
    out = [d] * chunks
    if d > 1 and chunks * d < workers:
        out = widen(out, workers, dict(choice.chains))
    return out


def widen(degrees: Sequence[int], workers: int, chains: Mapping[int, float]) -> list[int]:
    """``degrees`` (chunks' gangs at once on ``workers``) with the workers they leave
    idle given to them, sorted (the widest last): the narrowest gang doubles while the
    idle workers hold the doubling and ``chains`` (one sample's chain seconds per degree
    allowed) says the wider gang ends its chunk sooner. The generation still ends with
    its narrowest gangs; the widened chunks end sooner."""
    out = sorted(degrees)
    idle = workers - sum(out)
    while out:
        d = out[0]
        wider = chains.get(2 * d)
        if d > idle or wider is None or not wider < chains.get(d, math.inf):
            break
        idle -= d
        out[0] = 2 * d
        out.sort()
    return out


#: How much faster a step runs per doubling of its degree, before any degree above 1 is
#: measured: ``d`` processes compute it ``d x CP_EFFICIENCY ** log2(d)`` times faster
#: than one (xDiT's Ulysses timings of HunyuanVideo on H100s: docs/sources.md).
CP_EFFICIENCY = 0.9


def speedup(degree: int, efficiency: float = CP_EFFICIENCY) -> float:
    """How much faster ``degree`` processes compute a step than one, by the prior."""
    return degree * efficiency ** math.log2(degree) if degree > 1 else 1.0


@dataclass(frozen=True)
class DegreePlan:
    """A run's iteration: each chunk's degree, the degrees used without a measurement
    (probes, predicted from the lowest measured degree by :func:`speedup`), the
    predicted seconds of its generation (NaN with nothing measured), and the memory
    that bounded it: one sample's activations at degree 1 and what a rollout GPU has
    free for a chunk's (0 and infinite while unmeasured or undeclared)."""

    degrees: tuple[int, ...]
    probes: tuple[int, ...]
    seconds: float
    sample_gb: float = 0.0
    free_gb: float = math.inf

    def describe(self) -> str:
        counts = {d: self.degrees.count(d) for d in sorted(set(self.degrees))}
        text = ", ".join(f"{n} chunk{'s' * (n != 1)} at {d}" for d, n in counts.items())
        if self.probes:
            text += f" (probing {', '.join(map(str, self.probes))}: not measured yet)"
        if self.sample_gb and math.isfinite(self.free_gb):
            text += "; " + memory_bound(self.sample_gb, self.free_gb)
        return text


def memory_bound(sample_gb: float, free_gb: float) -> str:
    """The memory a run's chunks were kept within, as the log and the report say it."""
    return (f"a sample's activations {sample_gb:.3g} GB / degree within {free_gb:.3g} GB "
            f"free per rollout GPU")


def plan_degrees(chunks: int, chunk_size: int, workers: int, allowed: Sequence[int],
                 measured: Mapping[int, float], *, sample_gb: float = 0.0,
                 free_gb: float = math.inf) -> DegreePlan:
    """Each of an iteration's ``chunks`` (of ``chunk_size`` samples) degree, from the
    ``allowed`` degrees that ``workers`` free rollout workers hold, by
    :func:`choose_parallelism` and :func:`degree_plan` over ``measured`` (per degree,
    seconds of one sample's step) and, for the degrees not measured, their prediction
    from the lowest measured one; a chunk's ``chunk_size x sample_gb / degree`` within
    ``free_gb``. With nothing measured every chunk is at the lowest degree whose chunk
    fits (1 unless its memory says otherwise), which measures it. Raises ValueError
    when no allowed degree fits a chunk."""
    usable = sorted(d for d in set(allowed) | {1} if d <= max(workers, 1))
    fitting = [d for d in usable if chunk_size * sample_gb / d <= free_gb]
    if not fitting:
        raise ValueError(
            f"rollout.chunk_size: expected a chunk whose activations fit a rollout GPU at "
            f"a degree of at most {usable[-1]} ({chunk_size} x {sample_gb:.3g} GB / degree "
            f"within the {free_gb:.3g} GB free), got {chunk_size} samples")
    memory = {"sample_gb": sample_gb, "free_gb": free_gb}
    if not measured or chunks < 1:
        first = fitting[0]
        return DegreePlan((first,) * chunks, (first,) if first > 1 else (), math.nan,
                          **memory)
    lowest = min(measured)
    base = measured[lowest] * speedup(lowest)
    predicted = {d: base / speedup(d) for d in usable}
    known = {d: s for d, s in measured.items() if d in predicted}

    choice = choose_parallelism(chunks * chunk_size, max(workers, 1), predicted=predicted,
                                measured=known, sizes=(chunk_size,), sample_gb=sample_gb,
                                free_gb=free_gb)
    degrees = degree_plan(chunks, max(workers, 1), choice)
    probes = tuple(sorted({d for d in degrees if d not in known}))
    return DegreePlan(tuple(degrees), probes, choice.seconds, **memory)

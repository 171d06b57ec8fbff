"""Context-parallel degree: how many rollout workers compute one chunk's denoise steps
together, chosen from step times. A pure decision, no Dask.

A chunk's steps at degree ``d`` run as a gang on ``d`` rollout workers (Ulysses context
parallelism: each holds ``1/d`` of the tokens), so ``workers // d`` chunks advance at
once, each faster than on one GPU by less than ``d`` (its efficiency and the attention's
all-to-alls). Many chunks per worker: degree 1 keeps every GPU busy at full
efficiency. Few chunks left (a long video's tail, a small pool): degree 1 leaves GPUs
idle while the last chunks finish, and a higher degree ends the generation sooner.

:func:`choose_parallelism` takes, per degree, the seconds one sample's chain of steps
takes (measured where a degree has run, the cost model's prediction elsewhere: such a
degree is *probed*, named in the choice), the samples left, the free rollout workers
and the memory a sample's activations need, and picks the degree and chunk size whose
generation ends first, by waves: ``ceil(chunks / (workers // d))`` rounds of one chunk
per gang.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

__all__ = ["ParallelChoice", "generation_seconds", "choose_parallelism", "degree_plan",
           "DEGREES", "CP_EFFICIENCY", "speedup", "DegreePlan", "plan_degrees"]

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


def generation_seconds(sample_seconds: float, samples: int, workers: int, degree: int,
                       chunk_size: int) -> float:
    """Seconds to generate ``samples`` in chunks of ``chunk_size`` on ``workers`` GPUs at
    ``degree`` (``sample_seconds``: one sample's chain at that degree; a chunk of ``b``
    takes ``b`` times it): one chunk per gang per wave."""
    gangs = workers // degree
    if gangs < 1:
        return math.inf
    chunks = math.ceil(samples / chunk_size)
    return math.ceil(chunks / gangs) * chunk_size * sample_seconds


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
    for d in sorted(set(predicted) | set(measured)):
        if d > workers:
            continue
        t = measured.get(d, predicted.get(d))
        if t is None or not t > 0:
            continue
        for b in sizes:
            if b * sample_gb / d > free_gb:
                continue
            s = generation_seconds(t, samples, workers, d, b)
            key = (s, d, -b)
            if best is None or key < (best[0], best[1], -best[2]):
                best = (s, d, b)
    if best is None:
        raise ValueError(f"free_gb: expected room for one sample's activations "
                         f"({sample_gb:g} GB / degree) at a degree of at most {workers}, "
                         f"got {free_gb:g}")
    s, d, b = best
    return ParallelChoice(d, b, s, () if d in measured else (d,))


def degree_plan(chunks: int, workers: int, choose) -> list[int]:
    """The degree of each of an iteration's ``chunks`` (in order), as waves: each wave
    takes ``choose(chunks_left)``'s degree (a :class:`ParallelChoice`) on every gang the
    ``workers`` form. The waves' order does not change their sum, so the lower degrees
    come first and the last chunks (the tail) get the higher ones."""
    out: list[int] = []
    while len(out) < chunks:
        left = chunks - len(out)
        d = choose(left).degree
        out.extend([d] * min(left, max(1, workers // d)))
    return sorted(out)


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
    (probes, predicted from the lowest measured degree by :func:`speedup`), and the
    predicted seconds of its generation (NaN with nothing measured)."""

    degrees: tuple[int, ...]
    probes: tuple[int, ...]
    seconds: float

    def describe(self) -> str:
        counts = {d: self.degrees.count(d) for d in sorted(set(self.degrees))}
        text = ", ".join(f"{n} chunk{'s' * (n != 1)} at {d}" for d, n in counts.items())
        if self.probes:
            text += f" (probing {', '.join(map(str, self.probes))}: not measured yet)"
        return text


def plan_degrees(chunks: int, chunk_size: int, workers: int, allowed: Sequence[int],
                 measured: Mapping[int, float]) -> DegreePlan:
    """Each of an iteration's ``chunks`` (of ``chunk_size`` samples) degree, from the
    ``allowed`` degrees that ``workers`` free rollout workers hold, by
    :func:`degree_plan` and :func:`choose_parallelism` over ``measured`` (per degree,
    seconds of one sample's step) and, for the degrees not measured, their prediction
    from the lowest measured one. With nothing measured every chunk is at degree 1,
    which measures it."""
    usable = sorted(d for d in set(allowed) | {1} if d <= max(workers, 1))
    if not measured or chunks < 1:
        return DegreePlan((1,) * chunks, (), math.nan)
    lowest = min(measured)
    base = measured[lowest] * speedup(lowest)
    predicted = {d: base / speedup(d) for d in usable}
    known = {d: s for d, s in measured.items() if d in predicted}

    def choose(left: int) -> ParallelChoice:
        return choose_parallelism(left * chunk_size, max(workers, 1), predicted=predicted,
                                  measured=known, sizes=(chunk_size,))

    degrees = degree_plan(chunks, max(workers, 1), choose)
    probes = tuple(sorted({d for d in degrees if d not in known}))
    waves = _waves(degrees, max(workers, 1))
    seconds = sum(max(known.get(d, predicted[d]) for d in wave) * chunk_size
                  for wave in waves)
    return DegreePlan(tuple(degrees), probes, seconds)


def _waves(degrees: Sequence[int], workers: int) -> list[list[int]]:
    """``degrees`` (sorted) in waves of gangs that fit ``workers`` at once."""
    waves: list[list[int]] = [[]]
    used = 0
    for d in degrees:
        if used + d > workers and waves[-1]:
            waves.append([])
            used = 0
        waves[-1].append(d)
        used += d
    return waves

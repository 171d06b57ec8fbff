"""Adaptive chunking: how many samples one denoise task advances, chosen per iteration
from what the previous iterations measured. Pure decisions, no Dask.

Two forces set the chunk size. Every slot that can generate should hold a chain of its
own, or workers idle while a few long chains finish: so there should be at least
``slots x capacity`` chunks (capacity: the generating workers' summed speeds). And each
task pays a fixed cost -- the scheduler's hand-over, a kernel launch -- that a bigger
chunk spreads over more samples: so a task should compute at least ``1 / overhead_share``
times that cost. The chunk size is the largest valid size that keeps every slot fed; if
that leaves the fixed cost above its share, the smallest size that brings it under.

Chunking never changes what is computed: every draw is keyed by sample and timestep, and
the loss is normalised per iteration, so only a batch's floating-point summation order
changes (see docs/scheduling.md).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from digenrl.vocabulary import DENOISE

__all__ = ["ChunkingSpec", "ChunkMeasurement", "valid_chunk_sizes", "choose_chunk_size",
           "fitting_chunk", "measure_chunks"]


@dataclass(frozen=True)
class ChunkingSpec:
    """A workload's adaptive chunking: group size, the chunk size until something is
    measured, and the largest chunk one denoise task may hold (its memory bound)."""

    samples_per_prompt: int
    start: int
    largest: int


@dataclass(frozen=True)
class ChunkMeasurement:
    """What finished rollout work showed: speed-1 seconds per sample-step, and the
    fixed seconds between one task on a worker and the next one queued behind it."""

    step_per_sample: float
    overhead: float
    tasks: int


def valid_chunk_sizes(samples: int, samples_per_prompt: int, largest: int) -> list[int]:
    """Sizes that tile an iteration of ``samples`` and divide, or are a multiple of, a
    prompt group; at most ``largest``."""
    return [b for b in range(1, min(largest, samples) + 1)
            if samples % b == 0 and (samples_per_prompt % b == 0 or b % samples_per_prompt == 0)]


def choose_chunk_size(samples: int, samples_per_prompt: int, largest: int, *,
                      capacity: float, slots: int, measured: ChunkMeasurement | None,
                      fallback: int, overhead_share: float = 0.05) -> int:
    """The chunk size of the next iteration (``fallback`` until something is measured)."""
    sizes = valid_chunk_sizes(samples, samples_per_prompt, largest)
    if not sizes:
        raise ValueError(f"largest: expected room for a chunk size that tiles {samples} "
                         f"samples in groups of {samples_per_prompt}, got {largest}")
    if measured is None or measured.tasks == 0 or measured.step_per_sample <= 0:
        return fallback
    chains = max(1.0, slots * capacity)
    fed = [b for b in sizes if samples / b >= chains]
    pick = fed[-1] if fed else sizes[0]
    cost = measured.overhead
    if cost > overhead_share * pick * measured.step_per_sample:
        amortised = [b for b in sizes if cost <= overhead_share * b * measured.step_per_sample]
        pick = amortised[0] if amortised else sizes[-1]
    return pick


def fitting_chunk(largest: int, sample_gb: float, free_gb: float) -> int:
    """``largest`` (``rollout.max_chunk_size``), lowered to the samples whose activations
    fit the memory a generating GPU has free (``sample_gb`` each: one sample's in a
    degree-1 step, 0 while unmeasured), at least 1: a sample that fits no GPU alone is
    context parallelism's to split."""
    if sample_gb <= 0 or free_gb == float("inf"):
        return largest
    return max(1, min(largest, int(free_gb // sample_gb)))


def measure_chunks(records: Iterable[Mapping[str, Any]],
                   chunk_samples: Mapping[tuple[int, int], int],
                   speeds: Mapping[str, float]) -> ChunkMeasurement | None:
    """Per-sample step seconds (at speed 1) and the per-task fixed cost, as medians over
    finished denoise tasks; ``chunk_samples`` maps (iteration, chunk) to its size."""
    per_sample, gaps = [], []
    by_worker: dict[str, list] = {}
    for r in records:
        if r.get("kind") != DENOISE or r.get("start") is None or r.get("stop") is None:
            continue
        n = chunk_samples.get((int(r["iteration"]), int(r["chunk"])))
        if not n:
            continue
        name = str(r.get("worker_name") or r.get("worker"))
        per_sample.append((r["stop"] - r["start"]) / n * speeds.get(name, 1.0))
        by_worker.setdefault(name, []).append(r)
    if not per_sample:
        return None
    for rs in by_worker.values():
        rs.sort(key=lambda r: r["start"])
        for prev, nxt in zip(rs, rs[1:]):
            # Queued behind the previous task: the gap is the hand-over alone.
            if nxt.get("released", 0.0) and nxt["released"] <= prev["stop"]:
                gaps.append(max(0.0, nxt["start"] - prev["stop"]))
    return ChunkMeasurement(statistics.median(per_sample),
                            statistics.median(gaps) if gaps else 0.0, len(per_sample))

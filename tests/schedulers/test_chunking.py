"""Adaptive chunking decisions, without any cluster."""

from __future__ import annotations

import pytest

from digenrl.schedulers.chunking import (ChunkMeasurement, choose_chunk_size, measure_chunks,
                                         valid_chunk_sizes)


def m(step=0.1, overhead=0.002, tasks=10):
    return ChunkMeasurement(step, overhead, tasks)


def test_valid_sizes_tile_the_iteration_and_respect_groups():
    assert valid_chunk_sizes(48, 12, 16) == [1, 2, 3, 4, 6, 12]
    assert valid_chunk_sizes(48, 4, 48) == [1, 2, 4, 8, 12, 16, 24, 48]
    assert valid_chunk_sizes(48, 12, 5) == [1, 2, 3, 4]


def test_the_configured_size_is_kept_until_something_is_measured():
    assert choose_chunk_size(288, 12, 16, capacity=6, slots=2, measured=None, fallback=4) == 4
    assert choose_chunk_size(288, 12, 16, capacity=6, slots=2, measured=m(tasks=0),
                             fallback=4) == 4


def test_every_generating_slot_gets_a_chain():
    # 288 samples, 6 workers x 2 slots: at most 24 samples per chunk, capped at 16 ...
    assert choose_chunk_size(288, 12, 16, capacity=6, slots=2, measured=m(), fallback=4) == 12
    # ... and smaller chunks as the rollout capacity grows.
    assert choose_chunk_size(288, 12, 16, capacity=24, slots=2, measured=m(), fallback=4) == 6
    assert choose_chunk_size(288, 12, 16, capacity=200, slots=2, measured=m(), fallback=4) == 1


def test_a_costly_hand_over_makes_chunks_bigger():
    # 0.1 s per sample-step; the fixed cost must stay under 5% of a task: 20 ms per task
    # needs 4 samples, 50 ms needs 10 (so 12, the next valid size) ...
    def pick(overhead):
        return choose_chunk_size(288, 12, 24, capacity=200, slots=2,
                                 measured=m(step=0.1, overhead=overhead), fallback=4)
    assert pick(0.001) == 1
    assert pick(0.02) == 4
    assert pick(0.05) == 12
    # ... and when no size brings it under, the largest allowed.
    assert pick(1.0) == 24


def test_no_valid_size_is_a_clear_error():
    with pytest.raises(ValueError, match="largest"):
        choose_chunk_size(7, 7, 0, capacity=1, slots=1, measured=None, fallback=1)


def test_measurements_are_medians_at_speed_one():
    records = [
        # rollout-0 (speed 1): two 4-sample steps of 0.4 s, the second queued behind the first.
        dict(kind="denoise", iteration=0, chunk=0, worker_name="r0", start=0.0, stop=0.4, released=0.0),
        dict(kind="denoise", iteration=0, chunk=1, worker_name="r0", start=0.403, stop=0.803, released=0.1),
        # r1 at speed 0.5: 0.8 s for 4 samples is 0.1 s per sample at speed 1.
        dict(kind="denoise", iteration=0, chunk=2, worker_name="r1", start=0.0, stop=0.8, released=0.0),
        # released after the previous step ended: an idle gap, not a hand-over.
        dict(kind="denoise", iteration=0, chunk=3, worker_name="r1", start=1.5, stop=2.3, released=1.4),
        dict(kind="grad", iteration=0, chunk=0, worker_name="t0", start=0.0, stop=9.0, released=0.0),
    ]
    sizes = {(0, c): 4 for c in range(4)}
    got = measure_chunks(records, sizes, {"r1": 0.5})
    assert got.tasks == 4
    assert got.step_per_sample == pytest.approx(0.1)
    assert got.overhead == pytest.approx(0.003)
    assert measure_chunks(records[-1:], sizes, {}) is None


def test_the_largest_chunk_is_what_a_gpu_has_room_for():
    """Adaptive chunking's largest chunk, once a sample's memory is measured: 7 samples
    of 3 GB fit 22 GB free; never above rollout.max_chunk_size, never below 1 (a sample
    too big for one GPU is split by context parallelism); unbounded while unmeasured."""
    from digenrl.schedulers.chunking import fitting_chunk

    assert fitting_chunk(16, 3.0, 22.0) == 7
    assert fitting_chunk(4, 3.0, 22.0) == 4
    assert fitting_chunk(16, 30.0, 22.0) == 1
    assert fitting_chunk(16, 0.0, 22.0) == 16
    assert fitting_chunk(16, 3.0, float("inf")) == 16

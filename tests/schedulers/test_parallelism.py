"""The context-parallel degree chosen from step times: pure decisions, no cluster."""

import math

import pytest

from digenrl.schedulers.parallelism import (choose_parallelism, degree_plan,
                                            generation_seconds)
from digenrl.sim.costs import choose_degree, sample_chain_seconds
from digenrl.sim.profile import load_profile

#: A long video's chain at each degree: 0.9 efficiency per doubling (1 / (d x 0.9^log2 d)).
VIDEO = {1: 100.0, 2: 100.0 / 1.8, 4: 100.0 / 3.24, 8: 100.0 / 5.832}


def test_a_long_video_tail_takes_a_degree_above_one():
    """4 videos left on 10 free workers: at degree 1 six workers idle while four videos
    take the whole chain; at 2 they finish 1.8x sooner."""
    choice = choose_parallelism(4, 10, predicted=VIDEO)
    assert choice.degree == 2
    assert choice.seconds == pytest.approx(100 / 1.8)
    assert choice.seconds < generation_seconds(VIDEO[1], 4, 10, 1, 1)


def test_many_chunks_per_worker_keep_degree_one():
    """64 videos on 10 workers: degree 1 keeps every GPU at full efficiency."""
    assert choose_parallelism(64, 10, predicted=VIDEO).degree == 1


def test_small_images_take_degree_one():
    """A small image's step barely shrinks at a higher degree (the all-to-alls' latency
    and the kernels' fixed cost weigh on a short sequence), and there are many."""
    images = {1: 0.6, 2: 0.45, 4: 0.4}
    assert choose_parallelism(288, 5, predicted=images).degree == 1
    assert choose_parallelism(5, 5, predicted=images).degree == 1


def test_a_shrinking_pool_lowers_the_degree():
    """The same 4 videos left: 10 free workers take degree 2, 4 free workers degree 1
    (two gangs of two would need two rounds)."""
    degrees = [choose_parallelism(4, w, predicted=VIDEO).degree for w in (16, 10, 4)]
    assert degrees == [4, 2, 1]
    assert degrees == sorted(degrees, reverse=True)


def test_a_measured_step_wins_over_the_prediction_and_unmeasured_degrees_are_probes():
    slow = choose_parallelism(4, 10, predicted=VIDEO, measured={1: 100.0, 2: 90.0})
    assert slow.degree == 4 and slow.probes == (4,)   # 2 measured slower than predicted
    fast = choose_parallelism(4, 10, predicted=VIDEO, measured={2: 50.0})
    assert fast.degree == 2 and fast.probes == ()


def test_memory_per_sample_bounds_the_degree_and_the_chunk():
    """A sample's activations of 30 GB in 20 GB free: at least degree 2; a chunk of 2
    needs degree 4."""
    choice = choose_parallelism(64, 10, predicted=VIDEO, sample_gb=30.0, free_gb=20.0)
    assert choice.degree == 2
    two = choose_parallelism(64, 16, predicted=VIDEO, sizes=(2,), sample_gb=30.0, free_gb=20.0)
    assert two.degree == 4 and two.chunk_size == 2
    with pytest.raises(ValueError, match="free_gb: expected room"):
        choose_parallelism(4, 1, predicted=VIDEO, sample_gb=30.0, free_gb=20.0)


def test_the_chunk_size_is_chosen_with_the_degree():
    """With a per-sample cost, smaller chunks balance the waves better; of equal
    times the larger chunk is taken."""
    assert choose_parallelism(20, 10, predicted={1: 10.0}, sizes=(1, 2, 4)).chunk_size == 2
    assert choose_parallelism(24, 10, predicted={1: 10.0}, sizes=(1, 2, 4)).chunk_size == 1


def test_the_degree_plan_gives_the_tail_its_degree():
    plan = degree_plan(64, 10, lambda left: choose_parallelism(left, 10, predicted=VIDEO))
    assert len(plan) == 64 and plan == sorted(plan)
    assert plan.count(1) >= 50 and plan[-1] == 2 and set(plan) == {1, 2}


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="samples, workers"):
        choose_parallelism(0, 10, predicted=VIDEO)
    assert math.isinf(generation_seconds(1.0, 4, 2, 4, 1))


def test_the_profiles_prediction_picks_per_length():
    """On the shipped profiles' predicted chains: Wan2.1-14B at 720p's last 4 videos on
    10 rollout workers take degree 2; a full iteration of FLUX images stays at 1."""
    wan = load_profile("wan14b-720p-32gpu")
    assert choose_degree(wan, 4, 10).degree == 2
    assert choose_degree(wan, 64, 10).degree == 1
    assert sample_chain_seconds(wan, 2) < sample_chain_seconds(wan, 1)
    flux = load_profile("flux12b-16gpu")
    assert choose_degree(flux, flux.images_per_iteration, flux.rollout_workers).degree == 1


def test_a_run_plans_degree_one_until_measured_then_probes_and_follows_its_measurements():
    """``rollout.context_parallel: auto`` in a run (plan_degrees): nothing measured,
    every chunk at 1 (which measures it); one chunk on two workers, degree 2 predicted
    1.8x faster, probed; measured slower than predicted but still faster, kept; measured
    slower than degree 1, dropped."""
    from digenrl.schedulers.parallelism import plan_degrees, speedup

    assert plan_degrees(3, 4, 2, (1, 2), {}).degrees == (1, 1, 1)
    first = plan_degrees(1, 4, 2, (1, 2), {1: 1.0})
    assert first.degrees == (2,) and first.probes == (2,)
    assert first.seconds == pytest.approx(4 / speedup(2))
    assert "1 chunk at 2 (probing 2" in first.describe()
    assert plan_degrees(1, 4, 2, (1, 2), {1: 1.0, 2: 0.9}).degrees == (2,)
    kept = plan_degrees(1, 4, 2, (1, 2), {1: 1.0, 2: 1.2})
    assert kept.degrees == (1,) and kept.probes == ()
    # Many chunks per worker stay at 1; the tail of a wave takes the free workers.
    assert plan_degrees(8, 1, 4, (1, 2, 4), {1: 1.0}).degrees == (1,) * 8
    assert plan_degrees(5, 1, 4, (1, 2, 4), {1: 1.0}).degrees[-1] > 1


def test_a_pool_that_shrinks_lowers_the_degree():
    """One chunk: degree 4 on four workers, 2 on two or three, 1 on one; a degree the
    family cannot take is never chosen."""
    from digenrl.schedulers.parallelism import plan_degrees

    measured = {1: 1.0}
    assert [plan_degrees(1, 2, w, (1, 2, 4), measured).degrees for w in (4, 3, 2, 1)] == [
        (4,), (2,), (2,), (1,)]
    assert plan_degrees(1, 2, 4, (1,), measured).degrees == (1,)

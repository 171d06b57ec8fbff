"""The context-parallel degree chosen from step times: pure decisions, no cluster."""

import math

import pytest

from digenrl.schedulers.parallelism import (choose_parallelism, degree_plan,
                                            generation_seconds, widen)
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
    """A chunk's samples share its chain: fewer chunks than workers take chunks of one
    sample (each worker one chain); with more chunks than workers the workers share the
    chunks' steps and the sizes tie, and the larger chunk is taken."""
    sizes = (1, 2, 4)
    assert choose_parallelism(6, 10, predicted={1: 10.0}, sizes=sizes).chunk_size == 1
    assert choose_parallelism(20, 10, predicted={1: 10.0}, sizes=sizes).chunk_size == 2
    assert choose_parallelism(24, 10, predicted={1: 10.0}, sizes=sizes).chunk_size == 2


def test_more_chunks_than_gangs_share_the_steps():
    """The scheduler gives each free gang the next step of any chunk, so 6 videos on 5
    gangs of 2 take 6/5 of a chain, not two chains: degree 2 (and not 1) for them."""
    assert generation_seconds(VIDEO[2], 6, 10, 2, 1) == pytest.approx(1.2 * VIDEO[2])
    assert generation_seconds(VIDEO[2], 4, 10, 2, 1) == pytest.approx(VIDEO[2])
    assert choose_parallelism(6, 10, predicted=VIDEO).degree == 2
    assert choose_parallelism(9, 10, predicted=VIDEO).degree == 1


def test_the_workers_a_plans_gangs_leave_idle_widen_them():
    """4 videos at degree 2 on 10 workers leave 2 idle: one chunk takes degree 4 there
    (the generation still ends with the degree-2 chains, that chunk sooner); a degree-1
    plan leaves its idle workers to whole chunks; many chunks keep one degree."""
    choose = lambda n, w=10: choose_parallelism(n, w, predicted=VIDEO)  # noqa: E731
    assert choose(4).chains == tuple(sorted(VIDEO.items()))
    assert degree_plan(4, 10, choose(4)) == [2, 2, 2, 4]
    assert degree_plan(3, 10, choose(3)) == [4] * 3   # (3/2 of a chain at 4 < one at 2)
    assert degree_plan(9, 10, choose(9)) == [1] * 9
    assert degree_plan(64, 10, choose(64)) == [1] * 64
    assert degree_plan(5, 10, choose(5)) == [2] * 5          # (no worker idle)
    # The idle workers widen the narrowest gangs first, one doubling at a time, and only
    # to a degree allowed (within memory) whose chain is shorter.
    assert widen([2, 2], 10, VIDEO) == [4, 4]
    assert widen([2, 2], 10, {2: 50.0, 4: 30.0}) == [4, 4]
    assert widen([2, 2], 10, {2: 50.0}) == [2, 2]
    assert widen([2, 2], 10, {2: 50.0, 4: 60.0}) == [2, 2]
    assert widen([4, 2, 2], 9, VIDEO) == [2, 2, 4]
    # A sample's memory that rules out degree 1 leaves it out of the choice's chains.
    assert choose_parallelism(4, 10, predicted=VIDEO, sample_gb=30.0,
                              free_gb=20.0).chains == tuple(sorted(VIDEO.items()))[1:]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="samples, workers"):
        choose_parallelism(0, 10, predicted=VIDEO)
    assert math.isinf(generation_seconds(1.0, 4, 2, 4, 1))


def test_the_profiles_prediction_picks_per_length():
    """On the shipped profiles' predicted chains: Wan2.1-14B at 720p's 4 videos on 10
    rollout workers take degree 2, 7 of them too (7/5 of a chain at 2 against one at
    1), 64 degree 1; a full iteration of FLUX images stays at 1."""
    wan = load_profile("wan14b-720p-32gpu")
    assert choose_degree(wan, 4, 10).degree == 2
    assert choose_degree(wan, 7, 10).degree == 2
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
    # Chunks outnumbering the workers stay at 1; fewer take their free workers.
    assert plan_degrees(8, 1, 4, (1, 2, 4), {1: 1.0}).degrees == (1,) * 8
    assert plan_degrees(3, 1, 4, (1, 2, 4), {1: 1.0}).degrees == (2, 2, 2)


def test_a_pool_that_shrinks_lowers_the_degree():
    """One chunk: degree 4 on four workers, 2 on two or three, 1 on one; a degree the
    family cannot take is never chosen."""
    from digenrl.schedulers.parallelism import plan_degrees

    measured = {1: 1.0}
    assert [plan_degrees(1, 2, w, (1, 2, 4), measured).degrees for w in (4, 3, 2, 1)] == [
        (4,), (2,), (2,), (1,)]
    assert plan_degrees(1, 2, 4, (1,), measured).degrees == (1,)


def test_a_chunk_that_does_not_fit_one_gpu_takes_the_degree_that_fits():
    """A run's measured memory (plan_degrees): 8 chunks of 4 samples on 4 workers stay
    at degree 1 by time, but 4 x 10 GB does not fit the 25 GB a GPU has free; 4 x 10 / 2
    does. Before any step time is measured the lowest fitting degree is probed; a chunk
    no allowed degree fits is refused, naming rollout.chunk_size."""
    from digenrl.schedulers.parallelism import plan_degrees

    measured = {1: 1.0}
    assert plan_degrees(8, 4, 4, (1, 2, 4), measured).degrees == (1,) * 8
    bounded = plan_degrees(8, 4, 4, (1, 2, 4), measured, sample_gb=10.0, free_gb=25.0)
    assert bounded.degrees == (2,) * 8 and bounded.probes == (2,)
    assert "a sample's activations 10 GB / degree within 25 GB free" in bounded.describe()
    first = plan_degrees(8, 4, 4, (1, 2, 4), {}, sample_gb=10.0, free_gb=15.0)
    assert first.degrees == (4,) * 8 and first.probes == (4,)
    with pytest.raises(ValueError, match=r"^rollout\.chunk_size: expected a chunk whose "
                       r"activations fit a rollout GPU at a degree of at most 2 "):
        plan_degrees(8, 4, 2, (1, 2, 4), measured, sample_gb=10.0, free_gb=15.0)

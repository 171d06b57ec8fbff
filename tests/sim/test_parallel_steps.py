"""Context-parallel steps in the cost model and the simulator: a chunk's step at degree d
costs the degree-1 step over d x efficiency plus Ulysses' all-to-alls, and runs as a gang
of d members, each on its own rollout worker, all held for the step."""

import dataclasses
from collections import defaultdict

import pytest

from digenrl.graph.structure import iteration_nodes
from digenrl.schedulers.options import MODES, ScheduleOptions
from digenrl.sim.costs import ULYSSES_ALL_TO_ALLS, chunk_degrees, cp_step_seconds, planned
from digenrl.sim.emulate import EmulatedWorkload
from digenrl.sim.memory import Model
from digenrl.sim.network import MESSAGE_LATENCY, NVLINK_BANDWIDTH
from digenrl.sim.profile import ProfileError, load_profile
from digenrl.sim.simulate import simulate
from digenrl.vocabulary import DENOISE


def opts(mode):
    return ScheduleOptions(mode=mode, **MODES[mode])


@pytest.fixture(scope="module")
def wan():
    """Wan2.1-14B at 480p with 4 videos an iteration on its 10 rollout workers: a whole
    iteration is a tail."""
    p = load_profile("wan14b-32gpu")
    return dataclasses.replace(p, prompts_per_iteration=1, samples_per_prompt=4)


def test_a_step_at_degree_d_is_the_step_over_d_times_efficiency_plus_the_all_to_alls(wan):
    one, none = cp_step_seconds(wan, 1, 1)
    assert (one, none) == (wan.task_seconds(DENOISE, 1), 0.0)
    compute, network = cp_step_seconds(wan, 1, 4)
    assert compute == pytest.approx(one / (4 * 0.9 ** 2))
    c = wan.costs
    local = c.tokens_per_sample / 4 * c.hidden_size * 2 * c.cfg_factor
    moved = ULYSSES_ALL_TO_ALLS * c.attention_layers * 3 / 4 * local
    assert network == pytest.approx(moved / NVLINK_BANDWIDTH
                                    + ULYSSES_ALL_TO_ALLS * c.attention_layers * 3
                                    * MESSAGE_LATENCY)
    assert 0 < network < 0.05 * compute     # within a node the exchange is small
    # A chunk of two samples moves twice the bytes.
    assert cp_step_seconds(wan, 2, 4)[1] > network


def test_a_samples_activations_are_split_by_the_degree():
    m = Model(params=14, sample_activations_gb=18.0, rollout_activations_gb=2.0,
              gpu_memory_gb=80)
    assert m.rollout_gb(1, 1) == pytest.approx(28 + 2 + 18)
    assert m.rollout_gb(2, 4) == pytest.approx(28 + 2 + 9)
    assert m.free_for_samples_gb() == pytest.approx(80 - 30)


def test_bad_degrees_are_refused_in_one_line(wan):
    for bad in (3, "two", 16, True):
        with pytest.raises(ProfileError, match=r"^context_parallel: expected 'auto' or one "
                                               r"of \[1, 2, 4, 8\] \(at most the 10 rollout "
                                               f"workers\\), got {bad!r}$"):
            wan.with_context_parallel(bad)
    small = wan.with_pools(3, 29)
    with pytest.raises(ProfileError, match=r"one of \[1, 2\] \(at most the 3 rollout"):
        small.with_context_parallel(4)
    qwen = load_profile("qwenimage20b-32gpu")     # (no all-to-all sizes)
    with pytest.raises(ProfileError, match="profile.costs.tokens_per_sample: expected a "
                                           "number > 0 with context_parallel 2"):
        qwen.with_context_parallel(2)


def test_the_profiles_plans_carry_each_chunks_degree_and_the_graph_makes_the_gangs(wan):
    """The simulator and the emulator read the plans the cost model plans
    (``planned``): at degree 2 every step of every chunk is a gang of two in the graph a
    run builds; at degree 1 the plans are the profile's own."""
    assert planned(wan, 2) == wan.plans(2)
    plans = planned(wan.with_context_parallel(2), 2)
    assert [p.context_parallel for p in plans] == [(2, 2, 2, 2)] * 2
    steps = [n for n in iteration_nodes(wan.layout(), plans[1]) if n.op == DENOISE]
    assert len(steps) == 2 * 4 * wan.num_steps
    assert all(n.meta["gang"][2] == 2 for n in steps)


def test_a_gangs_members_run_together_each_on_its_own_worker_and_stay_there(wan):
    p = wan.with_context_parallel(2)
    r = simulate(p, opts("disaggregated"), 4).result
    assert r is not None
    steps = defaultdict(list)
    for t in r.records:
        if t.kind == DENOISE:
            steps[(t.iteration, t.chunk, t.timestep)].append(t)
    assert steps and all(len(ms) == 2 for ms in steps.values())
    for members in steps.values():
        assert len({m.worker for m in members}) == 2
        # Released together; a member whose input is on another worker starts once it
        # has arrived (a chunk's latent over the network).
        assert len({m.released for m in members}) == 1
        fetch = p.network.latency + p.costs.latent_bytes_per_sample / p.network.bandwidth
        assert max(m.start for m in members) - min(m.start for m in members) <= fetch + 1e-9
    # No other GPU task runs on a member's worker during the step.
    by_worker = defaultdict(list)
    for t in r.records:
        if t.gpu:
            by_worker[t.worker].append(t)
    for members in steps.values():
        for m in members:
            assert not [t for t in by_worker[m.worker]
                        if t is not m and t.start < m.stop and m.start < t.stop]
    # A chunk's steps stay on the workers of its first.
    chains = defaultdict(set)
    for (it, chunk, _), members in steps.items():
        chains[(it, chunk)].add(frozenset(m.worker for m in members))
    assert all(len(w) == 1 for w in chains.values())


def test_auto_speeds_up_a_tail_of_long_videos_and_leaves_images_alone(wan):
    """4 videos on 10 rollout workers: auto takes degree 2, one chunk 4 on the two
    workers the others leave idle, and the synchronous iteration ends sooner than at
    degree 1; FLUX's images stay at degree 1."""
    assert chunk_degrees(wan.with_context_parallel("auto"), 4) == [2, 2, 2, 4]
    one = simulate(wan, opts("disaggregated"), 4)
    auto = simulate(wan.with_context_parallel("auto"), opts("disaggregated"), 4)
    assert auto.degrees == (2, 2, 2, 4) and one.degrees == (1, 1, 1, 1)
    assert auto.iteration_s < 0.9 * one.iteration_s
    images = load_profile("flux12b-16gpu").with_context_parallel("auto")
    degrees = chunk_degrees(images, images.images_per_iteration // images.chunk_size)
    assert set(degrees) == {1}


def test_auto_keeps_up_with_every_fixed_degree_where_iterations_overlap(wan):
    """In the digenrl design the next iteration's chunks take the rollout workers this
    one's gangs leave idle. A worker whose part of a chunk's step is done is kept for the
    chunk's next step, so the chunks' gangs keep their workers and the two iterations'
    chunks do not take turns step by step: degree 2 ends the tail soonest, and auto is
    within 5% of every fixed degree and ahead of degree 1."""
    fixed = {d: simulate(wan.with_context_parallel(d), opts("digenrl"), 6).iteration_s
             for d in (1, 2, 4, 8)}
    auto = simulate(wan.with_context_parallel("auto"), opts("digenrl"), 6)
    assert min(fixed, key=fixed.__getitem__) == 2
    assert auto.iteration_s <= 1.05 * min(fixed.values())
    assert auto.iteration_s < 0.9 * fixed[1]


def test_the_emulator_makes_each_member_wait_for_its_step_at_its_degree(wan):
    """An emulated member of a step at degree 2 waits for the step's compute at that
    degree and its all-to-alls; a step at degree 1 for the profile's own seconds."""
    two = EmulatedWorkload(wan.with_context_parallel(2), opts("digenrl"), 1)
    nodes = iteration_nodes(two.layout, two.plan(0))
    member = next(n for n in nodes if n.op == DENOISE)
    task = two._task(member)
    assert (task.seconds, task.network) == cp_step_seconds(wan, member.meta["samples"], 2)
    one = EmulatedWorkload(wan, opts("digenrl"), 1)
    step = next(n for n in iteration_nodes(one.layout, one.plan(0)) if n.op == DENOISE)
    assert one._task(step).network == 0.0 and one._task(step).seconds > task.seconds

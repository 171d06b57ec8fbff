"""The cost model the emulator and the simulator share."""

import dataclasses

from digenrl.graph.keys import restore_key
from digenrl.graph.structure import tail_nodes, train_nodes
from digenrl.schedulers.options import MODES, ScheduleOptions
from digenrl.sim.costs import Extras, TaskCosts, WorkerHeld, phase_of, reduction_root
from digenrl.sim.emulate import EmulatedWorkload
from digenrl.sim.profile import load_profile
from digenrl.vocabulary import (ADVANTAGE, DECODE, DENOISE, GRAD, NOISE, PUBLISH, REDUCE,
                                REWARD, STATS)


def opts(mode):
    return ScheduleOptions(mode=mode, **MODES[mode])


def emulated_seconds(workload, nodes):
    """Key -> the seconds each emulated task of ``nodes`` sleeps for (speed 1)."""
    graph = workload.bind(nodes, {"out": []})
    return {key: task.args[0].seconds for key, task in graph.tasks.items()}


def test_the_reduction_root_carries_the_allreduce_in_the_piece_the_driver_submits():
    """The driver submits an iteration's gradients and reduction tree apart from its
    optimizer step: the root is found from the plan, not from the optimize node."""
    profile = load_profile("flux12b-16gpu")
    w = EmulatedWorkload(profile, opts("digenrl"), 2)
    plan = w.plan(1)
    root = reduction_root(w.layout, plan)
    seconds = emulated_seconds(w, train_nodes(w.layout, plan))
    reduces = {k: s for k, s in seconds.items() if k[0] == REDUCE}
    assert seconds[root] == profile.allreduce_seconds() > 0
    assert len(reduces) > 1 and sum(reduces.values()) == seconds[root]
    tail = emulated_seconds(w, tail_nodes(w.layout, plan, restore_key(1), checkpoint=True))
    assert root not in tail and not any(k[0] == REDUCE for k in tail)
    # The simulator's costs are the same object's.
    costs = TaskCosts(profile, w.layout, [plan], colocated=False)
    assert costs.seconds(REDUCE, 0, root, 1) == seconds[root]
    assert costs.seconds(REDUCE, 0, root, 0) == 0.0   # not the root of iteration 0


def test_a_remote_reward_takes_no_gpu_time():
    profile = load_profile("flux12b-16gpu")
    remote = dataclasses.replace(profile, costs=dataclasses.replace(profile.costs,
                                                                    reward_on="remote"))
    layout, plans = profile.layout(), profile.plans(1)
    on_gpu = TaskCosts(profile, layout, plans, colocated=False)
    assert on_gpu.seconds(REWARD, 4, (REWARD, 0, 0), 0) == profile.task_seconds(REWARD, 4) > 0
    assert TaskCosts(remote, layout, plans, colocated=False).seconds(
        REWARD, 4, (REWARD, 0, 0), 0) == 0.0


def test_a_rollout_worker_pays_for_each_version_once_and_trainers_never():
    profile = load_profile("flux12b-16gpu")
    extras = Extras.of(profile, colocated=False)
    assert extras.weight_sync == profile.weight_sync_seconds() > 0 and not extras.phase_switch
    rollout, trainer = WorkerHeld(), WorkerHeld()
    reads = [(NOISE, 0), (DENOISE, 0), (DENOISE, 1), (DECODE, 1), (DENOISE, 0)]
    paid = [extras.pay(rollout, kind, version, True) for kind, version in reads]
    assert paid == [extras.weight_sync, 0.0, extras.weight_sync, 0.0, 0.0]
    assert rollout.versions == {0, 1} and rollout.synced == 2 * extras.weight_sync
    assert extras.pay(trainer, DENOISE, 5, False) == 0.0 and not trainer.versions


def test_a_colocated_worker_pays_each_phase_switch():
    profile = load_profile("flux12b-16gpu")
    extras = Extras.of(profile, colocated=True)
    assert extras.phase_switch == profile.colocated.phase_switch > 0 and not extras.weight_sync
    held = WorkerHeld()
    kinds = [DENOISE, DECODE, PUBLISH, ADVANTAGE, GRAD, STATS, GRAD, NOISE, DENOISE]
    paid = [extras.pay(held, kind, 0, True) for kind in kinds]
    # Into training at the advantage, back to rollout at the noise; the bookkeeping kinds
    # belong to neither phase.
    assert paid == [0, 0, 0, extras.phase_switch, 0, 0, 0, extras.phase_switch, 0]
    assert phase_of(PUBLISH) is None and phase_of(STATS) is None
    assert not held.versions

"""Straggler rebalancing on a real local cluster: a rollout worker made slow loses its
timesteps to the others at timestep boundaries (``digenrl why`` tells why each moved),
and the results stay bit-identical (the chunks keep their shapes; every draw is keyed by
sample and timestep)."""

from __future__ import annotations

from conftest import REFERENCE_ITERATIONS, assert_same_results, small_config

from digenrl.tasks.slowdown import set_slowdown, slowdown


def _address(client, name):
    workers = client.scheduler_info(n_workers=-1)["workers"]
    return next(a for a, w in workers.items() if str(w.get("name")) == name)


def test_a_slow_rollout_worker_loses_its_timesteps_and_nothing_changes(
        cluster_2x2, reference_run, tmp_path):
    from digenrl.run.runner import Runner
    from digenrl.store import open_run
    from digenrl.commands.why import why

    client = cluster_2x2.client
    slow = _address(client, "rollout-1")
    path = tmp_path / "run.zarr"
    client.run(set_slowdown, 8.0, workers=[slow])
    try:
        assert client.run(lambda dask_worker: slowdown(str(dask_worker.name)),
                          workers=[slow]) == {slow: 8.0}
        result = Runner(small_config(iterations=REFERENCE_ITERATIONS), str(path),
                        cluster=cluster_2x2).run()
    finally:
        client.run(set_slowdown, 1.0, workers=[slow])

    ds = open_run(path)
    tasks = ds["tasks"].to_dataframe()
    steps = tasks[tasks.kind == "denoise"].sort_values(["iteration", "chunk", "timestep"])
    per_worker = steps.worker_name.value_counts()
    # The slowed worker ran fewer steps than its full-speed peer ...
    assert per_worker.get("rollout-1", 0) < per_worker["rollout-0"], per_worker.to_dict()
    # ... because chunks left it at timestep boundaries: a step ran on rollout-1 and the
    # chunk's next step elsewhere, taken from it by the policy (its latents moved).
    moved = []
    for (_, _), chain in steps.groupby(["iteration", "chunk"]):
        names = chain.worker_name.tolist()
        stolen = chain.stolen.tolist()
        moved += [t for t in range(1, len(names))
                  if names[t - 1] == "rollout-1" and names[t] != "rollout-1" and stolen[t]]
    assert moved, steps[["iteration", "chunk", "timestep", "worker_name", "stolen"]]
    # digenrl why tells each stolen step's move: the rebalancing rule and its reason.
    for step in steps[steps.stolen].itertuples():
        text = why(str(path), step.key)
        assert f"stolen by {step.worker_name}: rebalance -- from " in text, text
    assert_same_results(ds, result.final_weights.tensors, reference_run)

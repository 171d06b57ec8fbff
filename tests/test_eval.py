"""Held-out evaluation on a real local cluster: the ``eval`` group, the priority of
evaluation tasks (from the ``tasks`` group), training left as it is, and the report's
curve and grids."""

import json

import numpy as np
import pytest
from PIL import Image

from digenrl.config import ConfigError
from digenrl.commands.report import write_report
from digenrl.vocabulary import GRAD, ROLLOUT, ROLLOUT_KINDS

from conftest import REFERENCE_ITERATIONS, assert_same_results, checked_config, small_config
from invariants import assert_schedule_invariants

#: Held-out prompts (one with metadata): fewer than a chunk's worth in the last chunk.
HELD_OUT = [{"prompt": "a red square", "colour": "red"}, {"prompt": "a blue circle"},
            {"prompt": "a green triangle seen from far away on a grey afternoon"}]


@pytest.fixture(scope="session")
def eval_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("held-out") / "held_out.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in HELD_OUT))
    return str(path)


def eval_config(eval_file, **kw):
    # The reference run's work, evaluated before the first iteration and every 2, with
    # fewer ODE steps than the sampler's 4.
    return small_config(**{"iterations": REFERENCE_ITERATIONS, "eval.every": 2,
                           "eval.before_first": True, "eval.num_steps": 3,
                           "data.eval_prompt_file": eval_file, **kw})


@pytest.fixture(scope="module")
def evaluated(cluster_1x1, shared_runs, eval_file):
    return shared_runs(cluster_1x1, eval_config(eval_file))


def test_every_evaluated_version_has_a_row_per_held_out_prompt(evaluated):
    e = evaluated.ds["eval"]
    n = len(HELD_OUT)
    # Versions 0 (before the first iteration), 2 and 4 (the final policy).
    assert e.version.values.tolist() == [0] * n + [2] * n + [4] * n
    assert e.prompt_index.values.tolist() == list(range(n)) * 3
    assert e.prompt.values.tolist() == [r["prompt"] for r in HELD_OUT] * 3
    assert e.valid.values.all() and np.isfinite(e.reward.values).all()
    # The one configured reward, weight 1: the total is that component.
    np.testing.assert_array_equal(e.reward.values, e.reward_jpeg_compressibility.values)
    assert e.image.dtype == np.uint8 and e.image.shape == (3 * n, 32, 32, 3)
    # Each version is sampled from the same noise per prompt, by a changing policy.
    images = e.image.values.reshape(3, n, -1).astype(int)
    assert not np.array_equal(images[0], images[2])
    # The metrics hold the mean of the evaluation stored with each iteration (versions
    # 0, 2 and 4 are stored with iterations 0, 1 and 3), NaN without one.
    m = evaluated.ds["metrics"].eval_reward_mean.values
    means = e.reward.values.reshape(3, n).mean(axis=1)
    np.testing.assert_allclose(m[[0, 1, 3]], means)
    assert np.isnan(m[2])


def test_evaluation_leaves_training_as_it_is(evaluated, reference_run):
    assert_same_results(evaluated.ds, evaluated.result.final_weights.tensors, reference_run)
    # A run without evaluation has no evaluation tasks and no rows.
    _, ref = reference_run
    assert not set(ref["tasks"].kind.values) & {"eval", "eval_reward"}
    assert ref["eval"].sizes.get("entry", 0) == 0


def test_evaluation_ran_only_in_slots_nothing_else_wanted(evaluated, eval_file):
    t = evaluated.ds["tasks"].to_dataframe()
    # The schedule keeps every rule of the mode, evaluation or not.
    assert_schedule_invariants(t, eval_config(eval_file).schedule.options())
    evals = t[t.kind == "eval"]
    assert len(evals) == 3 * 2 and evals.gpu.all()  # 2 chunks per evaluation
    assert (evals.pool == ROLLOUT).all()
    # No evaluation was released while a GPU step a rollout worker could take -- a
    # rollout step, or a grad it might be lent -- waited: ready, not yet released.
    could = t[t.gpu & (t.kind.isin(ROLLOUT_KINDS) | (t.kind == GRAD))]
    for released in evals.released:
        waiting = could[(could.eligible < released) & (could.released > released)]
        assert waiting.empty, waiting[["kind", "iteration", "eligible", "released"]]
    # Nor while anything else was running on its worker.
    gpu = t[t.gpu]
    for _, e in evals.iterrows():
        mine = gpu[(gpu.worker == e.worker) & (gpu.kind != "eval")]
        assert not ((mine.start < e.start) & (mine.stop > e.stop)).any()


def test_report_writes_the_curve_and_a_grid_per_version(evaluated, tmp_path):
    written, text = write_report(evaluated.result.store, tmp_path)
    names = {p.name for p in written}
    assert {"eval.png", "eval-v0.png", "eval-v2.png", "eval-v4.png"} <= names
    assert "held-out evaluation" in text
    curve = Image.open(tmp_path / "eval.png")
    grids = [Image.open(tmp_path / f"eval-v{v}.png") for v in (0, 2, 4)]
    assert curve.size[0] > 300 and curve.size[1] > 200
    # Three held-out samples in a row: wider than tall, the same layout for each version.
    assert len({g.size for g in grids}) == 1 and grids[0].size[0] > grids[0].size[1] > 100


def test_evaluation_without_held_out_prompts_is_refused(tmp_path, capsys):
    from digenrl.commands.cli import main

    with pytest.raises(ConfigError) as e:
        checked_config(**{"eval.every": 2, "data.prompts": ["a cat", "a dog"]})
    assert str(e.value).startswith("eval.every: expected 0 when there are no held-out "
                                   "prompts") and "\n" not in str(e.value)
    # The command line says so in one line, before any work (no scheduler listens).
    out = tmp_path / "run.zarr"
    code = main(["run", "--out", str(out), "--scheduler", "tcp://127.0.0.1:1",
                 "--set", "data.prompts=[a cat, a dog]", "--set", "eval.every=2"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "eval.every: expected 0" in err[0]
    assert not out.exists()


def test_a_resumed_run_stores_each_evaluation_once(cluster_1x1, evaluated, eval_file,
                                                    tmp_path):
    from digenrl.run.runner import Runner
    from digenrl.store import open_run

    out = str(tmp_path / "resumed.zarr")
    Runner(eval_config(eval_file, iterations=2), out, cluster=cluster_1x1).run()
    assert open_run(out)["eval"].version.values.tolist() == [0] * 3 + [2] * 3
    Runner(eval_config(eval_file), out, resume=True, cluster=cluster_1x1).run()
    e, ref = open_run(out)["eval"], evaluated.ds["eval"]
    # The same rows, bit for bit, as the run that was never stopped.
    for name in ("version", "prompt_index", "prompt", "reward", "image"):
        assert np.array_equal(e[name].values, ref[name].values), name


def test_a_video_is_kept_as_a_strip_of_frames():
    from digenrl.store import frame_strip

    videos = np.arange(2 * 9 * 4 * 5 * 3, dtype=np.uint8).reshape(2, 9, 4, 5, 3)
    strip = frame_strip(videos)
    assert strip.shape == (2, 4, 4 * 5, 3)
    # The first, the last and two evenly spaced frames between, side by side.
    for k, f in enumerate([0, 3, 5, 8]):
        np.testing.assert_array_equal(strip[:, :, 5 * k:5 * (k + 1)], videos[:, f])
    images = videos[:, 0]
    assert frame_strip(images) is images

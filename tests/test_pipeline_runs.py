"""``digenrl run`` on a tiny saved pipeline of each family, in the digenrl and the
disaggregated mode: rewards are finite, the first micro-step reproduces the rollout's
log-probs (ratio_dev), and only the workers that ran encode tasks build text encoders."""

import numpy as np
import pytest

from digenrl.run.runner import Runner
from digenrl.store import open_run

from conftest import pipeline_config
from digenrl.testing.pipelines import FRAMES, SIZE


def _text_encoders_built(dask_worker):
    """(this worker's pool, whether it built text encoders)."""
    from digenrl.tasks.resident import PLUGIN_NAME

    models = dask_worker.plugins[PLUGIN_NAME].models
    pool = "trainer" if "trainer" in dask_worker.state.total_resources else "rollout"
    return pool, models is not None and models.has_encoder


VIDEO = ("wan", "hunyuanvideo")


@pytest.mark.parametrize("mode", ["digenrl", "disaggregated"])
@pytest.mark.parametrize("name", ["sd3", "flux", "wan", "qwenimage", "hunyuanvideo"])
def test_a_run_on_each_family_trains(name, mode, tiny_pipelines, cluster_1x1, tmp_path):
    cfg = pipeline_config(tiny_pipelines[name], name, **{
        "iterations": 3, "schedule.mode": mode, "sampler.guidance_scale": 2.0,
        "store.save_videos": name in VIDEO})
    out = tmp_path / "run.zarr"
    result = Runner(cfg, str(out), cluster=cluster_1x1).run()
    assert result.final_weights.version == 3
    ds = open_run(out)
    s, m = ds["samples"], ds["metrics"]
    assert np.isfinite(s.reward.values).all() and bool(s.valid.all())
    # ratio_dev is measured on on-policy samples: every iteration in disaggregated
    # mode; with digenrl's bounded staleness, the iterations that have some.
    measured = m.ratio_dev.values[np.isfinite(m.ratio_dev.values)]
    assert len(measured) >= (3 if mode == "disaggregated" else 1), m.ratio_dev.values
    assert (measured < 1e-6).all(), m.ratio_dev.values
    assert s.image.shape[-3:] == (SIZE, SIZE, 3)
    if name in VIDEO:  # videos: the middle frame in samples.image, the whole in .video
        assert s.video.shape[-4:] == (FRAMES, SIZE, SIZE, 3)
        assert np.array_equal(s.image.values, s.video.values[:, :, FRAMES // 2])
    # Text encoders are built where encode tasks ran: rollout workers, and a trainer
    # only when it was lent to generation (TAG) for one.
    t = ds["tasks"].to_dataframe()
    encoded = set(t[t.kind == "encode"].worker)
    built = cluster_1x1.client.run(_text_encoders_built)
    assert ("rollout", True) in built.values(), built
    assert {w for w, (_, has) in built.items() if has} == encoded, (built, encoded)

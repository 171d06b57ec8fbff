"""Encoding is a task: a prompt group's ``encode`` task on a real cluster, the per-worker
prompt cache, and the text encoders' dtype and offloading (``model.text_encoder_dtype``,
``model.text_encoder_offload``)."""

import ast

import numpy as np
import pytest

from digenrl.config import ConfigError, apply_overrides, config_from_dict, config_to_dict
from digenrl.commands.report import summarise
from digenrl.run.runner import Runner
from digenrl.store import open_run

from conftest import pipeline_config, small_config

#: Two prompts, both drawn every iteration: each is seen again in every later iteration.
PROMPTS = ["a photo of a cat", "a dog running in the park"]


def _encoder_state(dask_worker):
    """(prompts this worker's encoder encoded, its modules' dtypes and devices), or None
    when it built no encoder in this run."""
    from digenrl.tasks.resident import PLUGIN_NAME

    models = dask_worker.plugins[PLUGIN_NAME].models
    if models is None or not models.has_encoder:
        return None
    encoder = models.encoder
    params = [p for m in encoder.modules() for p in m.parameters()]
    return (models.prompts_encoded(), sorted({str(p.dtype) for p in params}),
            sorted({p.device.type for p in params}), encoder.offload)


@pytest.fixture(scope="module")
def encoded_run(tiny_pipelines, cluster_1x1, tmp_path_factory):
    """A Qwen-Image run (its text encoder a Qwen2.5-VL language model) with the
    encoders in bfloat16, offloaded between encode tasks, over two prompts that every
    iteration draws again."""
    cfg = pipeline_config(tiny_pipelines["qwenimage"], "qwenimage", **{
        "iterations": 3, "data.prompts": PROMPTS, "model.text_encoder_dtype": "bfloat16",
        "model.text_encoder_offload": True})
    out = tmp_path_factory.mktemp("encode") / "run.zarr"
    result = Runner(cfg, str(out), cluster=cluster_1x1).run()
    state = cluster_1x1.client.run(_encoder_state)
    return result, open_run(out), state


def test_encode_tasks_are_recorded_holding_a_gpu_slot_before_their_groups_noise(encoded_run):
    result, ds, _ = encoded_run
    assert result.final_weights.version == 3
    assert np.isfinite(ds["samples"].reward.values).all()
    t = ds["tasks"].to_dataframe()
    enc = t[t.kind == "encode"]
    # One per prompt group and iteration: 2 groups x 3 iterations.
    assert sorted(enc.key) == sorted(str(("encode", i, g)) for i in range(3) for g in range(2))
    assert enc.gpu.all() and (enc.pool.eq("rollout") | enc.tag).all()
    noise = t[t.kind == "noise"].set_index("key")
    spp, chunk = 2, 2     # (small_config: a chunk is a group's two samples)
    for _, e in enc.iterrows():
        i, g = ast.literal_eval(e.key)[1:]
        for c in range(g * spp // chunk, (g + 1) * spp // chunk):
            assert noise.loc[str(("noise", i, c)), "ready"] >= e.finished
    # Their share of the rollout pool's GPU-busy time, in the report.
    [line] = [x for x in summarise(ds).splitlines() if x.startswith("rollout pool's GPU-busy")]
    shares = dict(part.split() for part in line.split(": ", 1)[1].split(", "))
    assert 0 < float(shares["encode"]) < 1 and "denoise" in shares


def test_a_prompt_seen_again_is_encoded_once_per_worker(encoded_run):
    """Each worker's encoder encodes exactly the distinct prompts of the encode tasks it
    ran; the repeats (every later iteration's) cost it nothing."""
    _, ds, state = encoded_run
    t = ds["tasks"].to_dataframe()
    enc = t[t.kind == "encode"]
    prompts = ds["samples"].prompt.values   # (iteration, sample); group = sample // 2
    seen: dict[str, set] = {}
    for _, e in enc.iterrows():
        i, g = ast.literal_eval(e.key)[1:]
        seen.setdefault(e.worker, set()).add(str(prompts[i, 2 * g]))
    for worker, s in state.items():
        encoded = s[0] if s is not None else 0
        assert encoded == len(seen.get(worker, ())), (worker, s, seen)
    assert sum(len(v) for v in seen.values()) < len(enc) == 6


def test_the_encoders_dtype_and_offloading_are_as_configured(encoded_run):
    _, _, state = encoded_run
    built = [s for s in state.values() if s is not None]
    assert built
    for _, dtypes, devices, offload in built:
        # Offloaded: kept on the CPU between encode tasks (this run's are all done).
        assert dtypes == ["torch.bfloat16"] and devices == ["cpu"] and offload


def test_the_encoders_dtype_defaults_to_the_models():
    cfg = small_config(**{"model.dtype": "bfloat16"})
    assert cfg.model.text_encoder_dtype is None and cfg.model.encoder_dtype == "bfloat16"
    cfg = small_config(**{"model.text_encoder_dtype": "float16"})
    assert cfg.model.encoder_dtype == "float16"


@pytest.mark.parametrize("field, value, expected", [
    ("text_encoder_dtype", "float64", "model.text_encoder_dtype: expected one of "
                                      "['bfloat16', 'float16', 'float32'], got 'float64'"),
    ("text_encoder_offload", "yes", "model.text_encoder_offload: expected true or false, "
                                    "got 'yes'"),
])
def test_bad_encoder_settings_are_refused_in_one_line(field, value, expected):
    data = apply_overrides(config_to_dict(small_config()), {f"model.{field}": value})
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert str(e.value) == expected

"""Runs with LoRA adapters on a real cluster: what travels per version, resuming bit for
bit, and a tiny pipeline of each family training its adapters (in bfloat16 for one)."""

import dataclasses

import diffusers
import numpy as np
import pytest
import torch
from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

from digenrl.commands.cli import main
from digenrl.config import load_config
from digenrl.commands.export import LORA_WEIGHTS
from digenrl.models.lora import trainable_spec
from digenrl.models import build_transformer, family, latent_shape, model_seed, predict_velocity
from digenrl.tasks.resident import resident
from digenrl.run.runner import Runner
from digenrl.store import committed_iterations, open_run, read_attrs

from conftest import (REFERENCE_ITERATIONS, assert_same_results, pipeline_config,
                      small_config)
from test_driver_loss import DriverStopped, resume, stored_weights
from test_worker_loss import run_killing

LORA = {"train.lora_rank": 4, "train.learning_rate": 1e-2}


def test_a_version_ships_only_the_adapters(cluster_1x1, shared_runs):
    cfg = small_config(iterations=REFERENCE_ITERATIONS, **LORA)
    result, ds, *_ = shared_runs(cluster_1x1, cfg)
    adapters = result.final_weights.tensors
    assert all(".lora_A." in n or ".lora_B." in n for n in adapters)
    adapter_bytes = 4 * sum(t.numel() for t in adapters.values())  # float32
    full_bytes = 4 * sum(p.numel() for p in build_transformer(cfg.model, cfg.seed).parameters())
    sent = ds["metrics"].weight_sync_bytes.values
    assert (sent == adapter_bytes).all(), (sent, adapter_bytes)
    assert adapter_bytes < full_bytes / 10, (adapter_bytes, full_bytes)
    # Dask sizes a published version by the tensors it carries (the scheduler plugin's
    # locality and transfer estimates read those sizes).
    t = ds["tasks"]
    published = t["nbytes"].values[t.kind.values == "publish"]
    assert published.size and (published == adapter_bytes).all(), (published, adapter_bytes)
    # Every worker received each version it computed with from the trainer that
    # published it, and the time that took was measured.
    kind, worker, version = t.kind.values, t.worker.values, t.policy_version.values
    publisher = {v: w for k, w, v in zip(kind, worker, version) if k == "publish"}
    reads = {(w, v) for k, w, v in zip(kind, worker, version)
             if k in ("denoise", "grad") and w != publisher[v]}
    received = ds["metrics"].weight_sync_transfers.values
    assert reads and received.sum() >= len(reads), (received, sorted(reads))
    assert ds["metrics"].weight_sync_seconds.values.sum() > 0
    # The adapters trained: every B moved from zero, except where nothing reaches the
    # output: the last block (context_pre_only) drops its text queries' attention.
    last = cfg.model.transformer_layers - 1
    unused = f"transformer_blocks.{last}.attn.add_q_proj.lora_B.default.weight"
    still = [n for n, t in adapters.items() if ".lora_B." in n and not t.any()]
    assert still == [unused], still


def test_a_resumed_lora_run_ends_bit_identical(cluster_1x1, shared_runs, tmp_path):
    reference = shared_runs(cluster_1x1, small_config(iterations=REFERENCE_ITERATIONS, **LORA))
    out = tmp_path / "run.zarr"
    Runner(small_config(iterations=REFERENCE_ITERATIONS - 1, **LORA), str(out),
           cluster=cluster_1x1).run()

    def stop_after_the_last(summary):
        if summary.iteration == REFERENCE_ITERATIONS - 1:
            raise DriverStopped

    with pytest.raises(DriverStopped):
        Runner(small_config(iterations=REFERENCE_ITERATIONS, **LORA), str(out), resume=True,
               cluster=cluster_1x1, on_iteration=stop_after_the_last).run()
    assert committed_iterations(out) == REFERENCE_ITERATIONS
    # Finishing it reads the adapters and their AdamW moments from the last checkpoint.
    assert resume(out, cluster_1x1) == 0
    assert_same_results(open_run(out), stored_weights(out), reference[:2])
    assert read_attrs(out)["finished"] == REFERENCE_ITERATIONS


#: One LoRA run of a tiny pipeline of each family (bfloat16 for two), shared by the tests
#: below that train it and export it. (A run on FLUX.1 Kontext whose prompt lines name no
#: source images samples from the prompt alone.)
PIPELINE_RUNS = [("sd3", "float32"), ("flux", "bfloat16"), ("wan", "float32"),
                 ("qwenimage", "float32"), ("hunyuanvideo", "bfloat16"),
                 ("kontext", "float32")]


def pipeline_run(shared_runs, cluster, folder, name, dtype="float32", lora=True):
    cfg = pipeline_config(folder, name, **{
        "iterations": 2 if lora else 1, "schedule.mode": "disaggregated",
        "model.dtype": dtype, **(LORA if lora else {})})
    return cfg, shared_runs(cluster, cfg)


@pytest.mark.slow
def test_lora_learns_the_reward_of_the_default_config(cluster_1x1, tmp_path):
    """The short default run with LoRA adapters (r=8, scale alpha/r = 4) instead of every
    weight: the JPEG reward rises as clearly as the full-weight run's does
    (tests/test_end_to_end.py, the same threshold)."""
    cfg = load_config("workflows/configs/tiny.yaml", {
        "iterations": 12, "train.lora_rank": 8, "train.lora_alpha": 32,
        "train.learning_rate": 2e-2})
    Runner(cfg, str(tmp_path / "run.zarr"), cluster=cluster_1x1).run()
    r = open_run(tmp_path / "run.zarr")["samples"].reward.values  # (iteration, sample)
    first, last = r[:3].ravel(), r[-3:].ravel()
    gain = last.mean() - first.mean()
    stderr = np.sqrt(first.var() / first.size + last.var() / last.size)
    assert gain > 0.1 and gain > 5 * stderr, (gain, stderr)


@pytest.mark.slow
def test_a_killed_trainer_of_a_lora_run_loses_nothing(cluster_1x1, shared_runs, tmp_path):
    cfg = small_config(iterations=REFERENCE_ITERATIONS, **LORA)
    reference = shared_runs(cluster_1x1, cfg)
    path = tmp_path / "r.zarr"
    # Its successor restores the adapters and their AdamW moments from a checkpoint.
    dead, keys = run_killing(cluster_1x1, path, "trainer", "grad", 1, cfg)
    assert keys
    ds = open_run(path)
    assert_same_results(ds, stored_weights(path), reference[:2])
    assert (ds["tasks"].worker.values == dead).any()


@pytest.mark.parametrize("name,dtype", PIPELINE_RUNS)
def test_a_tiny_pipeline_trains_its_adapters(name, dtype, tiny_pipelines, cluster_1x1,
                                             shared_runs):
    _, (result, ds, *_) = pipeline_run(shared_runs, cluster_1x1, tiny_pipelines[name],
                                       name, dtype)
    assert np.isfinite(ds["samples"].reward.values).all()
    m = ds["metrics"]
    # The first micro-step recomputes the rollout's log-probs in the same dtype and
    # batch shape: the ratio is 1 (docs/algorithm.md, precision).
    assert (m.ratio_dev.values < 1e-6).all(), m.ratio_dev.values
    weights = result.final_weights.tensors
    assert weights and all(".lora_" in n and t.dtype == torch.float32
                           for n, t in weights.items())
    assert any(t.abs().sum() > 0 for n, t in weights.items() if ".lora_B." in n)
    assert (m.weight_sync_bytes.values == 4 * sum(t.numel() for t in weights.values())).all()


def velocity(cfg, module, cond, x):
    """The velocity of ``module`` (float32) for fixed inputs, as digenrl calls it."""
    with torch.no_grad():
        return predict_velocity(dataclasses.replace(cfg.model, dtype="float32"), module, x,
                                0.6, cond, 1.0)


def digenrl_policy(cfg, weights):
    """The transformer a worker computes version ``weights`` with, in float32."""
    model = dataclasses.replace(cfg.model, dtype="float32")
    trainable = trainable_spec(model, cfg.train)
    return resident(model, model_seed(model, cfg.seed), trainable).policy(weights)


def inputs(cfg):
    model = dataclasses.replace(cfg.model, dtype="float32")
    cond = resident(model, model_seed(model, cfg.seed)).conditioning(("a cat", "a dog"), 1.0)
    x = torch.randn((2,) + latent_shape(cfg.model), generator=torch.Generator().manual_seed(0))
    return cond, x


@pytest.mark.parametrize("name,dtype", PIPELINE_RUNS)
def test_exported_adapters_load_into_the_diffusers_pipeline(name, dtype, tiny_pipelines,
                                                            cluster_1x1, shared_runs, tmp_path):
    folder = tiny_pipelines[name]
    cfg, (result, *_) = pipeline_run(shared_runs, cluster_1x1, folder, name, dtype)
    out = tmp_path / "export"
    assert main(["export", result.store, str(out)]) == 0
    assert (out / LORA_WEIGHTS).is_file()
    pipe = getattr(diffusers, family(cfg.model).pipeline_class).from_pretrained(folder)
    cond, x = inputs(cfg)
    base = velocity(cfg, pipe.transformer, cond, x)
    pipe.load_lora_weights(out)
    exported = velocity(cfg, pipe.transformer, cond, x)
    ours = velocity(cfg, digenrl_policy(cfg, result.final_weights), cond, x)
    assert not torch.allclose(exported, base, rtol=0, atol=1e-6)  # the adapters apply
    torch.testing.assert_close(exported, ours, rtol=1e-5, atol=1e-6)


def test_an_exported_full_transformer_loads_with_from_pretrained(tiny_pipelines, cluster_1x1,
                                                                 shared_runs, tmp_path):
    folder = tiny_pipelines["sd3"]
    cfg, (result, *_) = pipeline_run(shared_runs, cluster_1x1, folder, "sd3", lora=False)
    out = tmp_path / "export"
    assert main(["export", result.store, str(out), "--version", "1"]) == 0
    loaded = SD3Transformer2DModel.from_pretrained(out, subfolder="transformer")
    pipe = StableDiffusion3Pipeline.from_pretrained(folder, transformer=loaded)
    cond, x = inputs(cfg)
    ours = velocity(cfg, digenrl_policy(cfg, result.final_weights), cond, x)
    base = velocity(cfg, StableDiffusion3Pipeline.from_pretrained(folder).transformer, cond, x)
    assert not torch.equal(ours, base)
    torch.testing.assert_close(velocity(cfg, pipe.transformer, cond, x), ours,
                               rtol=1e-5, atol=1e-6)


def test_export_refuses_a_version_the_store_lacks(tiny_pipelines, cluster_1x1, shared_runs,
                                                  tmp_path, capsys):
    _, (result, *_) = pipeline_run(shared_runs, cluster_1x1, tiny_pipelines["sd3"], "sd3",
                                   lora=False)
    assert main(["export", result.store, str(tmp_path / "x"), "--version", "99"]) == 2
    err = capsys.readouterr().err
    assert "--version: expected one of the versions" in err and "got 99" in err

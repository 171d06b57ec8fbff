"""Models: built from configs, and the real from_pretrained path on a saved tiny pipeline."""

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

from digenrl.config import ConfigError, ModelConfig, RunConfig, SamplerConfig
from digenrl.models import PromptEncoder, build_transformer, build_vae, flow_sigmas
from digenrl.run.world import check_world
from digenrl.run.runner import Runner
from digenrl.store import open_run

from conftest import small_config


def test_built_models_are_seeded_and_deterministic():
    cfg = ModelConfig(transformer_layers=1, image_size=32)
    a, b, c = build_transformer(cfg, 1), build_transformer(cfg, 1), build_transformer(cfg, 2)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not all(torch.equal(pa[n], pc[n]) for n in pa)
    assert build_vae(cfg, 1).config.latent_channels == 4


def test_prompt_encoder_is_deterministic_and_prompt_dependent():
    enc = PromptEncoder(tokens=4, embed_dim=8, pooled_dim=3)
    e1, p1 = enc.encode(["a red fox", "dog"])
    e2, p2 = PromptEncoder(4, 8, 3).encode(["a red fox", "dog"])
    assert torch.equal(e1, e2) and torch.equal(p1, p2)
    assert e1.shape == (2, 4, 8) and p1.shape == (2, 3)
    assert not torch.equal(e1[0], e1[1])
    assert (e1[1, 1:] == 0).all()  # padding
    ue, up = enc.encode([""])
    assert (ue == 0).all() and (up == 0).all()


def test_sigmas_come_from_diffusers_with_shift():
    sig = flow_sigmas(SamplerConfig(num_steps=4, shift=3.0), ModelConfig())
    ref = FlowMatchEulerDiscreteScheduler(shift=3.0)
    ref.set_timesteps(4)
    np.testing.assert_allclose(sig, ref.sigmas.numpy())
    assert sig[0] == 1.0 and sig[-1] == 0.0 and len(sig) == 5


def save_tiny_pipeline(folder):
    torch.manual_seed(11)
    SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4,
                          num_layers=1, attention_head_dim=8, num_attention_heads=2,
                          joint_attention_dim=16, caption_projection_dim=16,
                          pooled_projection_dim=8, pos_embed_max_size=8
                          ).save_pretrained(folder / "transformer")
    AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
                  up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(8, 8, 8),
                  layers_per_block=1, latent_channels=4, norm_num_groups=8,
                  sample_size=32).save_pretrained(folder / "vae")
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=500, shift=2.0
                                    ).save_pretrained(folder / "scheduler")


def test_a_local_pipeline_folder_is_loaded_and_trained(tmp_path, cluster_1x1):
    folder = tmp_path / "pipeline"
    save_tiny_pipeline(folder)
    saved = SD3Transformer2DModel.from_pretrained(folder / "transformer")
    cfg = small_config(**{"model.path": str(folder), "iterations": 2,
                          "schedule.mode": "disaggregated"})
    loaded = build_transformer(cfg.model, seed=0)
    for name, p in saved.named_parameters():
        assert torch.equal(p, dict(loaded.named_parameters())[name])
    # The folder's scheduler config sets the training timesteps of the sigma schedule.
    assert flow_sigmas(cfg.sampler, cfg.model) != flow_sigmas(cfg.sampler, ModelConfig())
    result = Runner(cfg, str(tmp_path / "run.zarr"), cluster=cluster_1x1).run()
    images = open_run(tmp_path / "run.zarr")["samples"].image
    assert images.shape[-3:] == (32, 32, 3)  # 8x8 latents through the folder's 3-block VAE
    assert result.final_weights.version == 2
    changed = [n for n, p in saved.named_parameters()
               if not torch.equal(p, result.final_weights.tensors[n])]
    assert changed  # training moved the loaded weights


def test_an_incomplete_folder_is_refused(tmp_path):
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="model.path: expected a diffusers pipeline folder "
                                          "with vae/config.json"):
        check_world(RunConfig(model=ModelConfig(path=str(tmp_path))))

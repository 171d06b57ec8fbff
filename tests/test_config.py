"""Configuration: defaults, YAML, overrides and the errors bad input gets."""

from pathlib import Path

import pytest
import torch

from digenrl.algorithms import ALGORITHMS
from digenrl.config import ConfigError, RunConfig, config_from_dict, config_to_dict, load_config
from digenrl.run.world import check_world

TINY = Path(__file__).parent.parent / "workflows" / "configs" / "tiny.yaml"


def test_tiny_yaml_is_the_built_in_default():
    assert load_config(TINY) == RunConfig()


def test_each_algorithm_fills_the_settings_a_config_leaves_unset():
    """Its ``defaults``, where the config sets nothing; a value the config sets stays."""
    for name, alg in ALGORITHMS.items():
        cfg = load_config(TINY, {"algorithm.name": name})
        for dotted, value in alg.defaults.items():
            section, field = dotted.split(".")
            assert getattr(getattr(cfg, section), field) == value, (name, dotted)
        assert config_from_dict(config_to_dict(cfg)) == cfg
    cfg = load_config(TINY, {"algorithm.name": "dpo", "train.learning_rate": 0.5})
    assert cfg.train.learning_rate == 0.5 and cfg.algorithm.dpo_beta == 100.0
    assert ALGORITHMS["dpo"].defaults["train.learning_rate"] != 0.5


def test_a_default_may_depend_on_the_dynamics_the_config_names():
    """Flow-GRPO's rate: 2.5e-3 with the cps and dance dynamics, 1.5e-3 with its own flow
    dynamics, named or not; a rate the config sets wins over each."""
    def rate(**overrides):
        return load_config(TINY, overrides).train.learning_rate

    assert rate() == rate(**{"algorithm.dynamics": "flow"}) == 1.5e-3
    assert rate(**{"algorithm.dynamics": "cps"}) == rate(**{"algorithm.dynamics": "dance"}) \
        == 2.5e-3
    assert rate(**{"algorithm.dynamics": "cps", "train.learning_rate": 1.5e-3}) == 1.5e-3
    cfg = load_config(TINY, {"algorithm.dynamics": "dance"})
    assert config_from_dict(config_to_dict(cfg)) == cfg
    # Every algorithm's per-dynamics defaults name dynamics it has, and the settings a
    # config has (each one applied to a config, and read back from it).
    for name, alg in ALGORITHMS.items():
        assert set(alg.dynamics_defaults) <= set(alg.dynamics_choices[1:]), name
        assert alg.defaults_for(None) == alg.defaults, name
        for dynamics in alg.dynamics_defaults:
            cfg = load_config(TINY, {"algorithm.name": name, "algorithm.dynamics": dynamics})
            for dotted, value in alg.defaults_for(dynamics).items():
                section, field = dotted.split(".")
                assert getattr(getattr(cfg, section), field) == value, (name, dynamics)


def test_round_trip_through_plain_data():
    cfg = load_config(TINY, {"schedule.mode": "colocated", "train.learning_rate": "3e-4"})
    assert cfg.train.learning_rate == 3e-4  # YAML 1.1 reads 3e-4 as a string
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_derived_totals():
    cfg = RunConfig()
    assert cfg.derived() == {"images_per_iteration": 16, "chunks_per_iteration": 4,
                             "denoise_tasks_per_iteration": 32,
                             "micro_steps_per_iteration": 16, "trained_steps": 4}


@pytest.mark.parametrize("overrides,message", [
    ({"reward.components": {"aesthetic": 1.0}},
     r"reward.components: expected one of \[.*'jpeg_compressibility'.*\], got 'aesthetic'"),
    ({"schedule.mode": "async"},
     r"schedule.mode: expected one of \['colocated', 'digenrl', 'disaggregated'\], got 'async'"),
    ({"data.samples_per_prompt": 1}, r"data.samples_per_prompt: expected an integer >= 2, got 1"),
    ({"sampler.num_steps": 1}, r"sampler.num_steps: expected an integer from 2 to 1000 .*, got 1"),
    ({"rollout.chunk_size": 3},
     r"rollout.chunk_size: expected a divisor or a multiple of data.samples_per_prompt \(4\), got 3"),
    ({"rollout.chunk_size": 8, "data.prompts_per_iteration": 3},
     r"rollout.chunk_size: expected a divisor of the samples per iteration .* = 12\), got 8"),
    ({"cluster.trainer_workers": 0}, r"cluster.trainer_workers: expected an integer >= 1, got 0"),
    ({"model.path": "/nonexistent/model"},
     r"model.path: expected an existing folder, got '/nonexistent/model'"),
    ({"sampler.timestep_fraction": 1.0},
     r"sampler.timestep_fraction: expected a fraction leaving 1..7 trained steps"),
    ({"train.learning_rate": "fast"}, r"train.learning_rate: expected a number, got 'fast'"),
    ({"train.lr": 0.1}, r"train.lr: unknown field; valid fields of train are \[.*'learning_rate'"),
    ({"schedule.mode": "colocated", "schedule.tag": True},
     r"schedule.tag: expected false or null in colocated mode"),
    ({"schedule.max_staleness": -1}, r"schedule.max_staleness: expected an integer from 0 to 8"),
    ({"cluster.scheduler": "nowhere"}, r"cluster.scheduler: expected a scheduler address"),
    ({"cluster.collective_timeout": 0},
     r"cluster.collective_timeout: expected a finite number > 0.0, got 0"),
    ({"cluster.gpu_memory_gb": -1},
     r"cluster.gpu_memory_gb: expected a finite number >= 0.0, got -1"),
    ({"cluster.collective_backend": "mpi"},
     r"cluster.collective_backend: expected one of \['auto', 'gloo', 'nccl'\], got 'mpi'"),
    # A cluster started here runs this process's torch: refused before it starts.
    pytest.param({"cluster.collective_backend": "nccl"},
                 r"cluster.collective_backend: expected a backend the workers can run \(this "
                 r"torch sees no CUDA device: gloo or auto\), got 'nccl'",
                 marks=pytest.mark.skipif(torch.cuda.is_available(),
                                          reason="this machine's torch sees a CUDA device")),
    # Combinations an algorithm cannot run (docs/algorithm.md).
    ({"algorithm.name": "ppo"},
     r"algorithm.name: expected one of \['awm', 'diffusion_nft', 'dpo', 'flow_grpo'\], got 'ppo'"),
    ({"algorithm.name": "diffusion_nft", "algorithm.dynamics": "cps"},
     r"algorithm.dynamics: expected one of \['ode'\] or null with algorithm.name "
     r"'diffusion_nft' \(it samples with the ODE and needs no log-probabilities\), got 'cps'"),
    ({"algorithm.dynamics": "ode"},
     r"algorithm.dynamics: expected one of \['flow', 'dance', 'cps'\] or null with "
     r"algorithm.name 'flow_grpo'"),
    ({"algorithm.sde_steps": [0, 1, 7]},
     r"algorithm.sde_steps: expected steps from 0 to 6 \(sampler.num_steps = 8; .*got \[0, 1, 7\]"),
    ({"algorithm.sde_steps": [0, 1], "algorithm.num_sde_steps": 3},
     r"algorithm.num_sde_steps: expected at most the 2 candidate steps of algorithm.sde_steps, got 3"),
    ({"algorithm.num_sde_steps": 1}, r"algorithm.num_sde_steps: expected null without algorithm.sde_steps"),
    ({"algorithm.name": "awm", "algorithm.sde_steps": [1]},
     r"algorithm.sde_steps: expected an empty list with algorithm.name 'awm'"),
    ({"algorithm.name": "awm", "algorithm.guard": True},
     r"algorithm.guard: expected false with algorithm.name 'awm'"),
    ({"algorithm.name": "dpo", "algorithm.kl_space": "latent"},
     r"algorithm.kl_space: expected velocity or null with algorithm.name 'dpo'"),
    ({"algorithm.name": "dpo", "data.samples_per_prompt": 1},
     r"data.samples_per_prompt: expected an integer >= 2, got 1"),
    ({"algorithm.train_timesteps": 2},
     r"algorithm.train_timesteps: expected null with algorithm.name 'flow_grpo'"),
    ({"algorithm.name": "diffusion_nft", "store.save_latents": True},
     r"store.save_latents: expected false with algorithm.name 'diffusion_nft'"),
    ({"algorithm.name": "diffusion_nft", "algorithm.ema_max": 1.0},
     r"algorithm.ema_max: expected .*got 1.0"),
])
def test_bad_values_name_the_field_the_value_and_what_is_allowed(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_world(load_config(TINY, overrides))  # what a run checks before it starts


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="expected an existing YAML file"):
        load_config(tmp_path / "missing.yaml")
    f = tmp_path / "list.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="config: expected a YAML mapping at the top, got 'list'"):
        load_config(f)
    f.write_text("sampler: [1, 2]\n")
    with pytest.raises(ConfigError, match="sampler: expected a mapping"):
        load_config(f)


def test_every_field_is_documented_and_the_reference_is_current():
    import dataclasses

    from digenrl.config import _SECTIONS, field_docs, reference_markdown

    docs = field_docs()
    for cls in [RunConfig, *_SECTIONS.values()]:
        for f in dataclasses.fields(cls):
            if cls is RunConfig and f.name in _SECTIONS:
                continue
            assert docs.get(cls.__name__, {}).get(f.name), f"{cls.__name__}.{f.name}"
    committed = (TINY.parent.parent.parent / "docs" / "configuration.md").read_text()
    assert committed.strip() == reference_markdown().strip(), \
        "docs/configuration.md is stale: regenerate it (see its first lines)"

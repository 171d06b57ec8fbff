"""A chunk's denoise step computed by two gloo processes together (Ulysses context
parallelism, :mod:`digenrl.tasks.context_parallel`) against the same step in one
process, for tiny FLUX, Wan, Qwen-Image and SD3 folders, the built-in model and the
editing families (FLUX.1 Kontext, Qwen-Image-Edit, with source images), with
classifier-free guidance where the family has it and prompts of different lengths; the
same step by two Dask workers over a collective group they joined; and
``rollout.context_parallel``'s checks, each one line naming the field before any work."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from digenrl.config import ConfigError, config_to_dict
from digenrl.models import family
from digenrl.tasks import collective
from digenrl.testing.pipelines import MODEL_SETTINGS

import sharded_ranks as sr
from conftest import pipeline_config, small_config, source_picture
from test_collective import TIMEOUT, group_name, on_each, trainers  # noqa: F401

#: The families whose step is computed at degree 2: diffusers' own plans (the editing
#: families with a source image per prompt, of two sizes), and the SD3 plan of
#: digenrl.models.sd3 for an SD3 folder and the built-in model ("tiny").
FAMILIES = ("flux", "wan", "qwenimage", "sd3", "tiny", "kontext", "qwenimage_edit")
EDITING = {"kontext", "qwenimage_edit"}
#: Each editing prompt's source image (height, width): two sizes, so the chunk's velocity
#: is computed by source size, one transformer call each.
SOURCES = ((48, 64), (64, 48))
#: How long the two ranks may take (about 20 s on 2 cores).
TIMEOUT_S = 240


def case(folders, name: str):
    # FLUX and Kontext are guidance-distilled (an embedding); the others guide with a
    # negative prompt.
    guidance = {"sampler.guidance_scale": 1.0 if name in ("flux", "kontext") else 2.0}
    if name == "tiny":
        return small_config(**guidance)
    if name in EDITING:  # (small sources: about 48 x 48 pixels; no prompt file to check)
        settings = {f"model.{k}": v for k, v in MODEL_SETTINGS[name].items()}
        return small_config(**{"model.path": str(folders[name]), **settings, **guidance,
                               "model.source_area": 48 * 48})
    return pipeline_config(folders[name], name, **guidance)


def sources(folder: Path, name: str) -> list[list[str]]:
    """Each prompt's source image, written to ``folder``: ``[path, sha256]``."""
    if name not in EDITING:
        return []
    out = []
    for k, (height, width) in enumerate(SOURCES):
        path = folder / f"source-{k}.png"
        Image.fromarray(source_picture(height, width, k)).save(path)
        out.append([str(path), hashlib.sha256(path.read_bytes()).hexdigest()])
    return out


@pytest.fixture(scope="module")
def steps(tiny_pipelines, tmp_path_factory):
    """``{family: [rank 0's, rank 1's]}``, each ``{"alone", "together", "after":
    StepOut, "tokens", "own_tokens": int}`` (context_parallel_ranks.py): one launch of
    two ranks computing every case."""
    folder = tmp_path_factory.mktemp("context-parallel")
    cases = folder / "cases.json"
    cases.write_text(json.dumps({n: {"config": config_to_dict(case(tiny_pipelines, n)),
                                     "sources": sources(folder, n)} for n in FAMILIES}))
    out = folder / "step"
    script = str(Path(__file__).with_name("context_parallel_ranks.py"))
    sr.finish(sr.start(2, out, str(cases), script=script), TIMEOUT_S)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in (0, 1)]
    return {n: [got[n] for got in ranks] for n in FAMILIES}


@pytest.mark.parametrize("name", FAMILIES)
def test_degree_two_computes_the_step_of_degree_one(steps, name):
    for got in steps[name]:
        alone, together = got["alone"], got["together"]
        assert together.sample_ids == alone.sample_ids and together.timestep == alone.timestep
        assert together.latent.shape == alone.latent.shape
        assert (together.latent - alone.latent).abs().max().item() < 1e-5
        # (An SDE step: the log-prob of the step, a sum over the latent's elements.)
        assert alone.log_prob is not None and together.log_prob is not None
        assert torch.allclose(together.log_prob, alone.log_prob, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_each_rank_computes_its_share_of_the_tokens(steps, name):
    ranks = steps[name]
    assert all(got["tokens"] == ranks[0]["tokens"] for got in ranks)
    assert [got["own_tokens"] for got in ranks] == [ranks[0]["tokens"] // 2] * 2


@pytest.mark.parametrize("name", FAMILIES)
def test_the_module_computes_alone_again_after_the_step(steps, name):
    for got in steps[name]:
        assert torch.equal(got["after"].latent, got["alone"].latent)
        assert torch.equal(got["after"].log_prob, got["alone"].log_prob)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_rank_returns_the_same_step(steps, name):
    first, second = (got["together"] for got in steps[name])
    assert torch.equal(first.latent, second.latent)
    assert torch.equal(first.log_prob, second.log_prob)


def _steps_as_member(name: str, members: list[str], generation: int, case: dict):
    """On a worker: the chunk's step alone, then with the other members in the
    collective group ``name`` joined here, as a task of a run's gang would compute it."""
    from context_parallel_ranks import step_of

    alone, _ = step_of(case, None)
    group = collective.join(name, members, generation, backend="gloo", timeout=TIMEOUT)
    together, tokens = step_of(case, group)
    return alone, together, tokens, group.formation


def test_two_dask_workers_compute_a_step_together_in_a_group_they_joined(
        trainers):  # noqa: F811 (test_collective's fixture)
    """The built-in model's step at degree 2 by the trainers of a local cluster, each in
    a task pinned to it, over a group joined through the scheduler (the mesh built on the
    group's formation)."""
    client, members, addresses = trainers
    case = {"config": config_to_dict(small_config(**{"sampler.guidance_scale": 2.0})),
            "sources": []}
    got = on_each(client, addresses, members, _steps_as_member, group_name(), members, 1,
                  case)
    (alone, first, tokens, formation), (_, second, other_tokens, formation_1) = got
    assert formation == formation_1 and tokens == other_tokens == 8   # (16 image tokens)
    assert (first.latent - alone.latent).abs().max().item() < 1e-5
    assert torch.equal(first.latent, second.latent)
    assert torch.equal(first.log_prob, second.log_prob)


def test_a_degree_the_heads_do_not_divide_is_refused(tiny_pipelines):
    fam = family(case(tiny_pipelines, "flux").model)
    fam.check_context_parallel(2)
    with pytest.raises(ConfigError) as e:
        fam.check_context_parallel(3)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("rollout.context_parallel: expected a divisor of the "
                          "transformer's 2 attention heads") and msg.endswith("got 3")


def test_a_step_over_a_group_the_heads_do_not_divide_is_refused_before_any_work():
    """The entry point checks before it changes the module or forms a mesh: a group of 3
    members (its process group never used) for the built-in model's 2 heads."""
    from digenrl.models import build_transformer
    from digenrl.tasks.collective import Group
    from digenrl.tasks.context_parallel import context_parallel

    cfg = small_config().model
    module = build_transformer(cfg, 0)
    processors = dict(module.attn_processors)
    three = Group("rollout", 0, ("a", "b", "c"), 0, "gloo", 1.0, "never-formed", "-", None)
    with pytest.raises(ConfigError, match=r"^rollout\.context_parallel: expected a divisor "
                       r"of the transformer's 2 attention heads for the built-in model "
                       r"\(Ulysses gives each process heads / degree of them\), got 3$"):
        with context_parallel(module, cfg, three):
            pass
    assert module._parallel_config is None and module.attn_processors == processors
    assert not any(hasattr(m, "_diffusers_hook") for m in module.modules())


def test_a_family_without_a_plan_refuses_a_degree_above_one(tiny_pipelines):
    fam = family(pipeline_config(tiny_pipelines["hunyuanvideo"], "hunyuanvideo").model)
    fam.check_context_parallel(1)
    with pytest.raises(ConfigError, match=r"^rollout\.context_parallel: expected 1 for this "
                       r"HunyuanVideoPipeline folder \(HunyuanVideoTransformer3DModel has no "
                       r"context-parallel plan\), got 2$"):
        fam.check_context_parallel(2)


@pytest.mark.parametrize("changes, message", [
    ({"rollout.context_parallel": 0},
     "rollout.context_parallel: expected an integer >= 1 or 'auto', got 0"),
    ({"rollout.context_parallel": "most"},
     "rollout.context_parallel: expected an integer >= 1 or 'auto', got 'most'"),
    ({"rollout.context_parallel": 2},
     "rollout.context_parallel: expected at most 1, the workers that generate in the "
     "cluster the run starts (cluster.rollout_workers), got 2"),
    ({"rollout.context_parallel": 3, "schedule.mode": "colocated"},
     "rollout.context_parallel: expected at most 2, the workers that generate in the "
     "cluster the run starts (cluster.rollout_workers + cluster.trainer_workers), got 3"),
    ({"rollout.context_parallel": 2, "cluster.rollout_workers": 2,
      "cluster.trainer_workers": 2, "train.sharding": "fsdp"},
     "rollout.context_parallel: expected 1 when versions are published by collective "
     "broadcast (train.weight_sync 'auto' with train.sharding 'fsdp': its group spans the "
     "rollout workers; set train.weight_sync: dask), got 2"),
    ({"train.context_parallel": 2},
     "train.context_parallel: expected 1 (micro-steps are computed whole on each trainer: "
     "a context-parallel axis of the trainers' mesh is not offered; "
     "rollout.context_parallel splits generation), got 2"),
])
def test_bad_context_parallel_fails_naming_the_field(changes, message):
    with pytest.raises(ConfigError) as e:
        small_config(**changes)
    assert str(e.value) == message

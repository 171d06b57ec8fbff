"""Cost profiles: the shipped ones load, costs add up, mistakes are named."""

import pytest

from digenrl.schedulers.options import MODES, ScheduleOptions
from digenrl.sim.profile import ProfileError, list_profiles, load_profile, profile_from_dict
from digenrl.sim.simulate import simulate

#: The DigenRL paper's four models, each on the testbed size its profile names.
PAPER_MODELS = ("flux12b-16gpu", "wan14b-32gpu", "qwenimage20b-32gpu", "hunyuanvideo13b-32gpu")


def test_shipped_profiles_load_with_their_sources():
    names = list_profiles()
    assert {"flux12b-16gpu", "wan14b-32gpu", "flux12b-hetero-16gpu"} <= set(names)
    for name in names:
        p = load_profile(name)
        assert p.sources and p.description
        assert p.images_per_iteration % p.chunk_size == 0
    hetero = load_profile("flux12b-hetero-16gpu")
    assert hetero.rollout_speed == 0.5 and hetero.trainer_speed == 1.0


def test_costs_follow_the_profile():
    p = load_profile("flux12b-16gpu")
    fwd = 0.32 * 4  # per sample x chunk of 4, no guidance
    assert p.task_seconds("denoise", 4) == pytest.approx(fwd)
    assert p.task_seconds("grad", 4) == pytest.approx(4 * fwd)
    assert p.task_seconds("grad", 4, colocated=True) == pytest.approx(5 * fwd)  # recompute
    assert p.weight_sync_seconds() == pytest.approx(24e9 / 50e9 + 5e-6)
    chunks = 288 // 4
    work = chunks * (16 * fwd + 9 * 4 * fwd + 0.05 * 4 + 0.02 * 4) + 0.5
    assert p.gpu_seconds_per_iteration() == pytest.approx(work)
    assert p.ideal_images_per_s() == pytest.approx(288 / (work / 16))
    wan = load_profile("wan14b-32gpu")
    assert wan.task_seconds("denoise", 1) == pytest.approx(4.6 * 2)  # guidance doubles it


def test_the_paper_models_cost_what_their_sources_derive():
    qwen = load_profile("qwenimage20b-32gpu")
    # True classifier-free guidance: two forwards per sample-step, in sampling and training.
    assert qwen.task_seconds("denoise", 4) == pytest.approx(0.47 * 2 * 4)
    assert qwen.task_seconds("grad", 4) == pytest.approx(4 * 0.47 * 2 * 4)
    assert qwen.weight_sync_seconds() == pytest.approx(40.9e9 / 50e9 + 5e-6)
    hunyuan = load_profile("hunyuanvideo13b-32gpu")
    # Guidance-distilled: one forward per sample-step; one video per task.
    assert hunyuan.task_seconds("denoise", 1) == pytest.approx(1.14)
    assert hunyuan.chunk_size == 1 and hunyuan.images_per_iteration == 8 * 24
    for name in PAPER_MODELS:
        p = load_profile(name)
        assert p.gpus in (16, 32) and p.trained_steps < p.num_steps


@pytest.mark.parametrize("name", ["qwenimage20b-32gpu", "hunyuanvideo13b-32gpu"])
def test_every_mode_runs_on_the_new_paper_models_at_16_gpus(name):
    p = load_profile(name).scaled(16)
    reports = {mode: simulate(p, ScheduleOptions(mode=mode, **MODES[mode]), 3)
               for mode in ("colocated", "disaggregated", "digenrl")}
    for r in reports.values():
        assert 0 < r.ideal_fraction <= 1.0
        assert r.tasks == len(r.result.records)
    # The synchronous disaggregated design idles each pool while the other works; the
    # co-located one pays phase switches and recomputed log-probs; digenrl neither.
    ips = {mode: r.images_per_s for mode, r in reports.items()}
    assert ips["digenrl"] > ips["colocated"] > ips["disaggregated"]


def test_scaling_keeps_the_work_per_gpu():
    p = load_profile("flux12b-16gpu")
    big = p.scaled(1024)
    assert big.gpus == 1024 and big.rollout_workers == 320
    assert big.prompts_per_iteration == 24 * 64
    assert big.ideal_images_per_s() == pytest.approx(64 * p.ideal_images_per_s(), rel=0.01)


@pytest.mark.parametrize("patch,message", [
    ({"chunk_size": 5}, "profile.chunk_size: expected a divisor of the samples per iteration (288)"),
    ({"trained_steps": 16}, "profile.trained_steps: expected fewer than num_steps (16)"),
    ({"costs": {"denoise_per_sample": -1}}, "profile.costs.denoise_per_sample: expected a number >= 0"),
    ({"costs": {"denoise_per_sample": 1, "reward_on": "cloud"}}, "profile.costs.reward_on: expected 'gpu' or 'remote'"),
    ({"gpus_per_node": 8}, "profile.gpus_per_node: expected a profile field"),
])
def test_profile_mistakes_are_named(patch, message):
    data = {"name": "x", "rollout_workers": 2, "trainer_workers": 2,
            "prompts_per_iteration": 24, "samples_per_prompt": 12, "chunk_size": 4,
            "num_steps": 16, "trained_steps": 9, "costs": {"denoise_per_sample": 1.0}}
    data.update(patch)
    with pytest.raises(ProfileError) as e:
        profile_from_dict(data)
    assert message in str(e.value)


def test_unknown_profile_lists_the_shipped_ones():
    with pytest.raises(ProfileError, match="flux12b-16gpu"):
        load_profile("sdxl-8gpu")

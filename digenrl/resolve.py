"""A configuration checked against the world it names, before any cluster starts.

:mod:`digenrl.config` checks a config by itself: types, ranges, rules between fields.
What it names elsewhere is checked here, each in one line naming the field as the
config's own checks do: the model folder's family, its size (what the transformer's
patch grid and rotary or positional tables take) and what its tokenizers make of every
prompt; the built-in prompt set and the prompt files; the reward names (registered, or
under ``reward.remote`` / ``reward.models`` / ``reward.group``, a group reward's ranked
reward, and the prompt groups a group reward needs); the held-out prompts an evaluation needs;
the LoRA target modules of the transformer; settings that ask images of a video model
or videos of an image model; the libraries of the experiment trackers and their folder
(:func:`check_trackers`; whether a tracker starts is known only once the runner starts
it, still before any cluster).

:func:`check_world` is what every entry point calls before it starts a cluster:
``digenrl run`` (with ``--check`` too) and the runner through the workload's
:meth:`GraphContext.from_config <digenrl.graph.build.GraphContext.from_config>`, which
starts with it; ``digenrl bench`` and ``workflows/flow_grpo.py`` before their cluster.
"""

from __future__ import annotations

# The config's own message helpers: a check here reads like one in digenrl.config.
from digenrl.config import ConfigError, RewardConfig, RunConfig, _choice, _require, _sub_path
from digenrl.lora import check_targets
from digenrl.models.registry import family
from digenrl.prompts import (PROMPT_SETS, has_held_out_prompts, held_out_prompts,
                             load_prompt_file)
from digenrl.tasks.rewards import REWARDS
from digenrl.tracking import check_trackers

__all__ = ["check_world", "check_rewards"]


def check_world(config: RunConfig) -> None:
    """Everything ``config`` names outside itself exists and fits; raises
    :class:`~digenrl.config.ConfigError` naming the first field that does not."""
    model, data = config.model, config.data
    if model.path is not None:
        family(model).check_folder()
        if family(model).needs_images:
            raise ConfigError(f"model.path: expected a folder of a pipeline that samples "
                              f"from the prompt alone (a run's prompts carry no source "
                              f"images yet), got a {family(model).pipeline_class} folder "
                              f"({model.path!r}), which edits source images")
        family(model).check_size()
    if not data.prompts:
        _choice(data.prompt_set, "data.prompt_set", PROMPT_SETS)
    for name in ("prompt_file", "eval_prompt_file"):
        path = getattr(data, name)
        if path is not None:
            load_prompt_file(path, f"data.{name}")
    check_rewards(config.reward)
    _check_group_rewards(config)
    check_trackers(config.tracking)
    if config.eval.on:
        _require(has_held_out_prompts(data), "eval.every",
                 "0 when there are no held-out prompts (set data.eval_prompt_file: the "
                 "built-in held-out prompts go with a built-in data.prompt_set only)",
                 config.eval.every)
    check_targets(model, config.train)
    if model.path is not None:
        _check_prompts(config)
    _check_sample_kind(config)


def _check_sample_kind(config: RunConfig) -> None:
    """What asks for images of a video model, or for videos of an image model."""
    model = config.model
    video = family(model).video
    kind = "a video model" if video else "an image model"
    if video:
        _require(not config.store.save_latents, "store.save_latents",
                 "false for a video model (steps.latent holds image latents)",
                 config.store.save_latents)
    else:
        name = family(model).pipeline_class or "the built-in model"
        _require(model.num_frames is None, "model.num_frames", f"null for {kind} ({name})",
                 model.num_frames)
        _require(not config.store.save_videos, "store.save_videos",
                 f"false for {kind} (samples.video holds whole videos)",
                 config.store.save_videos)
        for name in config.reward.components:
            spec = REWARDS.get(name)
            if spec is not None and spec.scores == "video":
                raise ConfigError(f"reward.components: expected rewards that score images "
                                  f"for {kind}, got {name!r} (it scores videos)")


def check_rewards(reward: RewardConfig) -> None:
    """Every name in ``reward.components`` is a registered reward or one of
    ``reward.remote`` / ``reward.models`` / ``reward.group``, those three name no
    registered reward, and each group reward ranks a reward that scores samples alone."""
    for group in ("remote", "models", "group"):
        for name in getattr(reward, group):
            _require(name not in REWARDS, _sub_path(f"reward.{group}", name),
                     "a name that is not a registered reward's", name)
    alone = ({name for name, spec in REWARDS.items() if not spec.group}
             | set(reward.remote) | set(reward.models))
    for name, settings in reward.group.items():
        _choice(settings.of, f"{_sub_path('reward.group', name)}.of", alone)
    known = set(REWARDS) | set(reward.remote) | set(reward.models) | set(reward.group)
    for name in reward.components:
        _choice(name, "reward.components", known)


def _check_group_rewards(config: RunConfig) -> None:
    """A group reward ranks the samples of a prompt group: a group needs two."""
    grouped = [name for name in config.reward.components
               if name in config.reward.group or (name in REWARDS and REWARDS[name].group)]
    if grouped:
        _require(config.data.samples_per_prompt >= 2, "data.samples_per_prompt",
                 f"at least 2 with the group reward {grouped[0]!r} (it ranks the samples "
                 f"of each prompt group)", config.data.samples_per_prompt)


def _check_prompts(config: RunConfig) -> None:
    """Every prompt (and the negative one) is text the model's tokenizers encode."""
    d = config.data
    if d.prompts:
        named = [(f"data.prompts[{i}]", p) for i, p in enumerate(d.prompts)]
    else:
        named = [(f"data.prompt_set ({d.prompt_set!r}, prompt {i})", p)
                 for i, p in enumerate(PROMPT_SETS[d.prompt_set])]
    if config.eval.on:
        named += [(f"held-out prompt {i}", p)
                  for i, p in enumerate(held_out_prompts(d).prompts)]
    guidance = max(config.sampler.guidance_scale,
                   config.eval.sampler(config.sampler).guidance_scale)
    if guidance > 1.0:
        named.append(("model.negative_prompt", config.model.negative_prompt))
    family(config.model).check_prompts(named)

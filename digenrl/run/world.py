"""A configuration checked against the world it names, before any cluster starts.

:mod:`digenrl.config` checks a config by itself: types, ranges, rules between fields.
What it names elsewhere is checked here, each in one line naming the field as the
config's own checks do: the model folder's family, its size (what the transformer's
patch grid and rotary or positional tables take) and what its tokenizers make of every
prompt; the built-in prompt set and the prompt files; the reward names (registered, or
under ``reward.remote`` / ``reward.models`` / ``reward.group``, a group reward's ranked
reward, the prompt groups a group reward needs, an OCR reward's libraries and the text
each prompt it scores names); the held-out prompts an evaluation needs;
the LoRA target modules of the transformer; settings that ask images of a video model
or videos of an image model; a collective backend this process's torch cannot run, when
the run starts its own cluster (whose workers run the same torch); the libraries of the
experiment trackers and their folder (:func:`check_trackers`; whether a tracker starts
is known only once the runner starts it, still before any cluster).

:func:`check_world` is what every entry point calls before it starts a cluster:
``digenrl run`` (with ``--check`` too), the runner's workload before it builds a graph
(the graph layer checks nothing of the world and imports no part of this one),
``digenrl bench`` and ``workflows/train.py`` before their cluster.
"""

from __future__ import annotations

from typing import Any, Mapping

from digenrl.checks import ConfigError, choice, require, sub_path
from digenrl.config import AUTO, RewardConfig, RunConfig
from digenrl.models.lora import check_targets
from digenrl.models.base import SourceImage
from digenrl.models.registry import family
from digenrl.prompts import (PROMPT_SETS, has_held_out_prompts, held_out_prompts,
                             load_prompt_file, read_source)
from digenrl.tasks.collective import resolve_backend
from digenrl.tasks.ocr import check_installed as check_ocr_installed
from digenrl.tasks.ocr import target_problem
from digenrl.tasks.rewards import REWARDS
from digenrl.run.tracking import check_trackers

__all__ = ["check_world", "check_rewards", "check_prompt_inputs"]


def check_world(config: RunConfig) -> None:
    """Everything ``config`` names outside itself exists and fits; raises
    :class:`~digenrl.config.ConfigError` naming the first field that does not."""
    model, data = config.model, config.data
    if model.path is not None:
        family(model).check_folder()
        family(model).check_size()
    if not data.prompts:
        choice(data.prompt_set, "data.prompt_set", PROMPT_SETS)
    for name in ("prompt_file", "eval_prompt_file"):
        path = getattr(data, name)
        if path is not None:
            load_prompt_file(path, f"data.{name}")
    check_prompt_inputs(config)
    check_rewards(config.reward)
    _check_group_rewards(config)
    _check_ocr_targets(config)
    check_trackers(config.tracking)
    if config.eval.on:
        require(has_held_out_prompts(data), "eval.every",
                 "0 when there are no held-out prompts (set data.eval_prompt_file: the "
                 "built-in held-out prompts go with a built-in data.prompt_set only)",
                 config.eval.every)
    check_targets(model, config.train)
    if model.path is not None:
        _check_prompts(config)
    _check_sample_kind(config)
    if config.rollout.context_parallel != AUTO:
        family(model).check_context_parallel(int(config.rollout.context_parallel))
    if config.cluster.scheduler is None:
        # The workers of a cluster started here run this process's torch.
        resolve_backend(config.cluster.collective_backend)


def _check_sample_kind(config: RunConfig) -> None:
    """What asks for images of a video model, or for videos of an image model."""
    model = config.model
    video = family(model).video
    kind = "a video model" if video else "an image model"
    if video:
        require(not config.store.save_latents, "store.save_latents",
                 "false for a video model (steps.latent holds image latents)",
                 config.store.save_latents)
    else:
        name = family(model).pipeline_class or "the built-in model"
        require(model.num_frames is None, "model.num_frames", f"null for {kind} ({name})",
                 model.num_frames)
        require(not config.store.save_videos, "store.save_videos",
                 f"false for {kind} (samples.video holds whole videos)",
                 config.store.save_videos)
        for name in config.reward.components:
            spec = REWARDS.get(name)
            if spec is not None and spec.scores == "video":
                raise ConfigError(f"reward.components: expected rewards that score images "
                                  f"for {kind}, got {name!r} (it scores videos)")


def check_prompt_inputs(config: RunConfig) -> None:
    """The source images and negative prompts of the prompt files' lines fit the model:
    an editing family's prompts all name source images (as many as it takes; FLUX.1
    Kontext's may all name none: it then samples from the prompt alone, as its pipeline
    does without an image), another family's name none; a line's negative prompt needs
    classifier-free guidance (a family that uses a negative prompt, and a guidance scale
    above 1 where the line is sampled). ``model.source_area`` is set for an editing
    family alone."""
    fam = family(config.model)
    what = f"a {fam.pipeline_class} folder" if fam.pipeline_class else "the built-in model"
    if config.model.source_area is not None and not fam.takes_images:
        raise ConfigError(f"model.source_area: expected null for {what} (it does not edit "
                          f"images), got {config.model.source_area}")
    d = config.data
    files = [("data.prompt_file", d.prompt_file, config.sampler.guidance_scale)]
    if config.eval.on:
        files.append(("data.eval_prompt_file", d.eval_prompt_file,
                      config.eval.sampler(config.sampler).guidance_scale))
    for field, path, guidance in files:
        if path is None:
            if fam.needs_images and field == "data.prompt_file":
                raise ConfigError(f"{field}: expected a .jsonl prompt file whose lines name "
                                  f"source images (\"image\") for {what}, which edits "
                                  f"images, got none (prompts without images)")
            continue
        f = load_prompt_file(path, field)
        where = f"{field}: line {{}} of {f.path}: expected"
        if fam.takes_images:
            bare = f.lines_with(lambda i: not i.images)
            if len(bare) == len(f) and fam.needs_images:
                raise ConfigError(f"{field}: expected lines that name source images "
                                  f"(\"image\") for {what}, which edits images, got "
                                  f"{f.path} without any")
            if bare and len(bare) < len(f):
                raise ConfigError(f"{where.format(bare[0])} a source image (\"image\") "
                                  f"for {what}, which edits images, got none")
        many = f.lines_with(lambda i: len(i.images) > fam.max_source_images)
        if many:
            got = len(f.inputs_of(many[0] - 1).images)
            if fam.max_source_images == 0:
                raise ConfigError(f"{where.format(many[0])} no source image for {what} (it "
                                  f"does not edit images), got {got}")
            raise ConfigError(f"{where.format(many[0])} at most {fam.max_source_images} "
                              f"source image(s) for {what}, got {got}")
        if fam.takes_images:
            fam.check_sources(field, [(f"line {n + 1} of {f.path}", prompt,
                                SourceImage.of(read_source(image)))
                               for n, prompt in enumerate(f.prompts)
                               for image in f.inputs_of(n).images])
        negative = f.lines_with(lambda i: i.negative is not None)
        if negative and not fam.uses_negative_prompt:
            raise ConfigError(f"{where.format(negative[0])} no \"negative_prompt\" for "
                              f"{what} (its guidance is an embedding, without a negative "
                              f"prompt), got "
                              f"{f.inputs_of(negative[0] - 1).negative!r}")
        if negative and guidance <= 1.0:
            scale = "sampler.guidance_scale" if field == "data.prompt_file" else \
                "eval.guidance_scale"
            raise ConfigError(f"{where.format(negative[0])} no \"negative_prompt\" while "
                              f"{scale} is {guidance} (no classifier-free guidance), got "
                              f"{f.inputs_of(negative[0] - 1).negative!r}")


def check_rewards(reward: RewardConfig) -> None:
    """Every name in ``reward.components`` is a registered reward or one of
    ``reward.remote`` / ``reward.models`` / ``reward.group``, those three name no
    registered reward, and each group reward ranks a reward that scores samples alone."""
    for group in ("remote", "models", "group"):
        for name in getattr(reward, group):
            require(name not in REWARDS, sub_path(f"reward.{group}", name),
                     "a name that is not a registered reward's", name)
    alone = ({name for name, spec in REWARDS.items() if not spec.group}
             | set(reward.remote) | set(reward.models))
    for name, settings in reward.group.items():
        choice(settings.of, f"{sub_path('reward.group', name)}.of", alone)
    known = set(REWARDS) | set(reward.remote) | set(reward.models) | set(reward.group)
    for name in reward.components:
        choice(name, "reward.components", known)
    for name in _ocr_rewards(reward):
        check_ocr_installed(f"{sub_path('reward.models', name)}.kind")


def _ocr_rewards(reward: RewardConfig) -> list[str]:
    """The OCR rewards ``reward`` scores with: those of ``reward.components``, and those a
    group reward of the components ranks."""
    scored = set(reward.components) | {reward.group[n].of for n in reward.components
                                       if n in reward.group}
    return [name for name, m in reward.models.items() if m.kind == "ocr" and name in scored]


def _check_ocr_targets(config: RunConfig) -> None:
    """Every prompt an OCR reward scores (the training prompts and, with an evaluation,
    the held-out ones) names the text to render: quoted, or its line's ``text`` key."""
    ocr = _ocr_rewards(config.reward)
    if not ocr:
        return
    d = config.data
    named: list[tuple[str, str, Mapping[str, Any] | None]] = []  # (where, prompt, a .jsonl line's keys)

    def from_file(field: str, path: str) -> None:
        f = load_prompt_file(path, field)
        jsonl = f.path.lower().endswith(".jsonl")
        named.extend((f"{field}: line {n} of {f.path}", prompt, meta if jsonl else None)
                     for n, (prompt, meta) in enumerate(zip(f.prompts, f.metadata), 1))

    if d.prompt_file is not None:
        from_file("data.prompt_file", d.prompt_file)
    elif d.prompts:
        named.extend((f"data.prompts[{i}]", p, None) for i, p in enumerate(d.prompts))
    else:
        named.extend((f"data.prompt_set ({d.prompt_set!r}, prompt {i})", p, None)
                     for i, p in enumerate(PROMPT_SETS[d.prompt_set]))
    if config.eval.on:
        if d.eval_prompt_file is not None:
            from_file("data.eval_prompt_file", d.eval_prompt_file)
        else:
            named.extend((f"held-out prompt {i} of data.prompt_set {d.prompt_set!r}", p, None)
                         for i, p in enumerate(held_out_prompts(d).prompts))
    for where, prompt, meta in named:
        problem = target_problem(prompt, meta, keyed=meta is not None)
        if problem is not None:
            expected, got = problem
            raise ConfigError(f"{where}: expected {expected} for the OCR reward "
                              f"{ocr[0]!r}, got {got}")


def _check_group_rewards(config: RunConfig) -> None:
    """A group reward ranks the samples of a prompt group: a group needs two."""
    grouped = [name for name in config.reward.components
               if name in config.reward.group or (name in REWARDS and REWARDS[name].group)]
    if grouped:
        require(config.data.samples_per_prompt >= 2, "data.samples_per_prompt",
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

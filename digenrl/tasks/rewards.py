"""Rewards, in a registry keyed by name.

A reward maps a batch of images (uint8, ``(n, height, width, 3)``) and their prompts to
one float per image: ``fn(images, prompts)``. A function with a third parameter named
``metadata`` also receives each sample's prompt metadata (a dict per sample: the other
keys of its line of a ``.jsonl`` prompt file, empty otherwise), and one with a parameter
named ``sources`` (by keyword) each sample's source image: the uint8 ``(height, width,
3)`` image its prompt-file line names for an editing model to edit (the first, where a
line names several), or None for a sample without one. The built-in ones need no
model weights. A reward's ``device`` says what its task needs on the worker that runs it:
``"cpu"`` (the default) a thread of the worker's, ``"gpu"`` a GPU slot (it runs a torch
module), and ``"wait"`` neither: it waits for something outside the worker (a reward
server, a judge), so its task leaves the worker's thread pool for as long as it waits
(Dask's ``secede``) and the waiting rewards of an iteration all wait at once, beside the
GPU work and the other tasks of the worker. A reward named under ``reward.remote`` is scored by a
reward server (:mod:`digenrl.serving.remote`), one named under ``reward.models`` by a model
resident on the worker (:mod:`digenrl.tasks.reward_models`);
:func:`~digenrl.tasks.reward_sources.resolve_rewards` makes their specs, and from there
on they are rewards like the others (a remote reward is a ``wait`` one, a model reward a
``gpu`` one).

A reward declares what it scores: ``scores="image"`` (the default) or ``"video"``
(batches ``(n, frames, height, width, 3)``). An image reward applied to videos scores
every frame and, by default, takes the mean over frames (``on_video="mean"``); it may
say otherwise: ``"first"``, ``"middle"`` or ``"last"`` scores that frame alone.

A reward may score a whole prompt group at once (``group=True``: a ranking or a pairwise
preference within the group): ``fn(samples, prompts[, metadata])`` then receives the
samples of one group -- images or videos, as the model makes them, all of one prompt --
and returns one float per sample; :meth:`RewardSpec.score_group` is its call. Its task
is the group's ``group_reward``, after the group's images exist; its weighted score is
added to each sample's weighted sum of the other rewards. :func:`ranked_reward` makes one
from any reward that scores samples alone: each sample's normalised rank within its
group (:func:`group_rank`) or its mean preference probability against the others of its
group (:func:`group_win_rate`, Bradley-Terry on the score, as PickScore's preference
is).
"""

from __future__ import annotations

import inspect
import io
import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from PIL import Image

__all__ = ["RewardSpec", "REWARDS", "register_reward", "get_reward", "RewardError",
           "evaluate_rewards", "rewards_need_gpu", "rewards_wait", "decode_metadata",
           "DEVICES", "split_group_rewards", "group_rank", "group_win_rate", "ranked_reward",
           "GROUP_METHODS"]

RewardFn = Callable[..., np.ndarray]

#: What a reward's task needs on its worker (the module's docstring says what each means).
DEVICES = ("cpu", "gpu", "wait")


@dataclass(frozen=True)
class RewardSpec:
    name: str
    fn: RewardFn
    device: str = "cpu"
    description: str = ""
    scores: str = "image"    # what fn takes: "image" or "video" batches
    on_video: str = "mean"   # an image reward on videos: mean over frames, or one frame
    #: ``fn`` takes ``metadata`` (one dict per sample) after the prompts.
    takes_metadata: bool = False
    #: ``fn`` scores a whole prompt group at once (:meth:`score_group`).
    group: bool = False
    #: ``fn`` takes ``sources`` (each sample's source image, or None) by keyword.
    takes_sources: bool = False

    def _score(self, samples: np.ndarray, prompts: list, metadata: list, sources: list):
        args = (samples, prompts, metadata) if self.takes_metadata else (samples, prompts)
        if self.takes_sources:
            return self.fn(*args, sources=sources)
        return self.fn(*args)

    def __call__(self, samples: np.ndarray, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any]] = (),
                 sources: Sequence[np.ndarray | None] = ()) -> np.ndarray:
        """The reward of each sample: images, or videos (``samples.ndim == 5``)."""
        prompts = list(prompts)
        metadata = list(metadata) or [{} for _ in prompts]
        sources = list(sources) or [None for _ in prompts]
        video = samples.ndim == 5
        if self.scores == "video":
            if not video:
                raise RewardError(f"reward {self.name!r} scores videos, got images "
                                  f"of shape {samples.shape}")
            return self._score(samples, prompts, metadata, sources)
        if not video:
            return self._score(samples, prompts, metadata, sources)
        n, f = samples.shape[:2]
        if self.on_video != "mean":
            frame = {"first": 0, "middle": f // 2, "last": f - 1}[self.on_video]
            return self._score(np.ascontiguousarray(samples[:, frame]), prompts, metadata,
                               sources)
        frames = samples.reshape((n * f,) + samples.shape[2:])
        values = np.asarray(self._score(frames, [p for p in prompts for _ in range(f)],
                                        [m for m in metadata for _ in range(f)],
                                        [x for x in sources for _ in range(f)]),
                            dtype=np.float64)
        if values.shape != (n * f,):
            return values  # the caller reports the wrong shape
        return values.reshape(n, f).mean(axis=1)

    def score_group(self, samples: np.ndarray, prompts: Sequence[str],
                    metadata: Sequence[Mapping[str, Any]] = (),
                    sources: Sequence[np.ndarray | None] = ()) -> np.ndarray:
        """The reward of each sample of one prompt group, scored together (a reward
        declared with ``group=True``)."""
        if not self.group:
            raise RewardError(f"reward {self.name!r} scores each sample alone, not a group")
        prompts = list(prompts)
        return self._score(samples, prompts, list(metadata) or [{} for _ in prompts],
                           list(sources) or [None for _ in prompts])


REWARDS: dict[str, RewardSpec] = {}


class RewardError(ValueError):
    """A reward failed or returned unusable values for some samples."""


def register_reward(name: str, *, device: str = "cpu", description: str = "",
                    scores: str = "image", on_video: str = "mean", group: bool = False):
    """Decorator registering ``fn(images, prompts) -> rewards`` under ``name``
    (``fn(videos, prompts)`` with ``scores="video"``; with ``group=True`` ``fn`` scores
    the samples of one prompt group together, whatever they are)."""
    if device not in DEVICES:
        raise ValueError(f"device: expected one of {list(DEVICES)}, got {device!r}")
    if scores not in ("image", "video"):
        raise ValueError(f"scores: expected 'image' or 'video', got {scores!r}")
    if on_video not in ("mean", "first", "middle", "last"):
        raise ValueError(f"on_video: expected 'mean', 'first', 'middle' or 'last', "
                         f"got {on_video!r}")

    def wrap(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered; "
                             f"registered rewards: {sorted(REWARDS)}")
        REWARDS[name] = RewardSpec(name, fn, device, description or (fn.__doc__ or "").strip(),
                                   scores, on_video, takes_metadata=_takes(fn, "metadata"),
                                   takes_sources=_takes(fn, "sources"), group=group)
        return fn

    return wrap


def _takes(fn: RewardFn, parameter: str) -> bool:
    """Whether ``fn`` has a parameter named ``parameter``."""
    try:
        return parameter in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a readable signature
        return False


def get_reward(name: str) -> RewardSpec:
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"reward: expected one of {sorted(REWARDS)}, got {name!r}") from None


def rewards_need_gpu(rewards: Sequence[tuple[RewardSpec, float]]) -> bool:
    """Whether the reward task of these
    :func:`~digenrl.tasks.reward_sources.resolve_rewards` pairs needs a GPU slot."""
    return any(spec.device == "gpu" for spec, _ in rewards)


def rewards_wait(rewards: Sequence[tuple["RewardSpec", float]]) -> bool:
    """Whether any of ``rewards`` waits for something outside the worker."""
    return any(spec.device == "wait" for spec, _ in rewards)


def _jpeg_kilobytes(images: np.ndarray) -> np.ndarray:
    sizes = []
    for img in images:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=95)
        sizes.append(buf.tell() / 1000.0)
    return np.asarray(sizes, dtype=np.float64)


@register_reward("jpeg_compressibility")
def jpeg_compressibility(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    """Minus the JPEG size (quality 95) in kB, as in DDPO: smaller files score higher."""
    return -_jpeg_kilobytes(images)


@register_reward("jpeg_incompressibility")
def jpeg_incompressibility(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    """The JPEG size (quality 95) in kB, as in DDPO: more detail scores higher."""
    return _jpeg_kilobytes(images)


@register_reward("colorfulness")
def colorfulness(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    """Hasler and Suesstrunk's colourfulness metric (2003), on the 0-255 scale."""
    x = images.astype(np.float64)
    rg = x[..., 0] - x[..., 1]
    yb = 0.5 * (x[..., 0] + x[..., 1]) - x[..., 2]
    axes = (1, 2)
    std = np.sqrt(rg.std(axis=axes) ** 2 + yb.std(axis=axes) ** 2)
    mean = np.sqrt(rg.mean(axis=axes) ** 2 + yb.mean(axis=axes) ** 2)
    return std + 0.3 * mean


@register_reward("brightness")
def brightness(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    """Mean luma (ITU-R BT.601) in [0, 1]."""
    x = images.astype(np.float64) / 255.0
    return (0.299 * x[..., 0] + 0.587 * x[..., 1] + 0.114 * x[..., 2]).mean(axis=(1, 2))


def evaluate_rewards(
    images: np.ndarray,
    prompts: Sequence[str],
    sample_ids: Sequence[int],
    components: Mapping[str, float] | Sequence[tuple[RewardSpec, float]],
    on_error: str = "raise",
    iteration: int | None = None,
    metadata: Sequence[Mapping[str, Any]] | None = None,
    sources: Sequence[np.ndarray | None] | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray, list[str]]:
    """The weighted sum of ``components`` for each image.

    ``components`` maps registered reward names to weights, or is the ``(spec,
    weight)`` pairs of :func:`~digenrl.tasks.reward_sources.resolve_rewards` (a group
    reward among them scores ``images`` as one prompt group).
    ``metadata`` (one dict per image, none by default) and ``sources`` (each image's
    source image, or None; none by default) reach the rewards that take them. Returns ``(total,
    per_component, valid, problems)``. A reward that raises, returns a wrong shape, or
    returns NaN/inf for some samples is a :class:`RewardError` naming the reward and
    those samples (and ``iteration`` when given) when ``on_error == "raise"``; with
    ``"drop"`` those samples are marked invalid (their total is NaN) and ``problems``
    says why.
    """
    n = len(images)
    ids = list(sample_ids)
    where = f" of iteration {iteration}" if iteration is not None else ""
    pairs = ([(get_reward(name), float(w)) for name, w in components.items()]
             if isinstance(components, Mapping) else components)
    total = np.zeros(n, dtype=np.float64)
    valid = np.ones(n, dtype=bool)
    per: dict[str, np.ndarray] = {}
    problems: list[str] = []
    metadata = [{} for _ in range(n)] if metadata is None else list(metadata)
    for spec, weight in pairs:
        name = spec.name
        try:
            call = spec.score_group if spec.group else spec
            values = call(images, list(prompts), metadata, sources or ())
            arr = np.asarray(values, dtype=np.float64)
        except Exception as e:  # a user reward may raise anything
            msg = (f"reward {name!r} raised {type(e).__name__}: {e} "
                   f"for samples {ids}{where}")
            if on_error == "raise":
                raise RewardError(msg) from e
            problems.append(msg)
            valid[:] = False
            per[name] = np.full(n, np.nan)
            continue
        if arr.shape != (n,):
            msg = (f"reward {name!r} returned shape {arr.shape}, expected ({n},) "
                   f"for samples {ids}{where}")
            if on_error == "raise":
                raise RewardError(msg)
            problems.append(msg)
            valid[:] = False
            per[name] = np.full(n, np.nan)
            continue
        bad = ~np.isfinite(arr)
        if bad.any():
            bad_ids = [ids[i] for i in np.flatnonzero(bad)]
            msg = f"reward {name!r} returned NaN or inf for samples {bad_ids}{where}"
            if on_error == "raise":
                raise RewardError(msg)
            problems.append(msg)
            valid &= ~bad
        per[name] = arr
        total = total + weight * np.where(bad, 0.0, arr)
    total = np.where(valid, total, np.nan)
    return total, per, valid, problems


def decode_metadata(texts: Sequence[str], n: int) -> list[dict[str, Any]]:
    """Each of ``n`` samples' metadata from its JSON text (as the graph carries it; an
    empty text, or no texts at all, is no metadata)."""
    if not texts:
        return [{} for _ in range(n)]
    return [json.loads(t) if t else {} for t in texts]


# ------------------------------------------------------------------ group rewards

#: How :func:`ranked_reward` turns a reward's scores within a group into the group
#: reward: the normalised rank, or the mean Bradley-Terry preference probability.
GROUP_METHODS = ("rank", "win_rate")


def split_group_rewards(rewards: Sequence[tuple[RewardSpec, float]]
                        ) -> tuple[tuple[tuple[RewardSpec, float], ...],
                                   tuple[tuple[RewardSpec, float], ...]]:
    """``rewards`` as (the ones that score each sample alone, the group rewards)."""
    return (tuple(p for p in rewards if not p[0].group),
            tuple(p for p in rewards if p[0].group))


def _among_finite(scores: np.ndarray, of_several) -> np.ndarray:
    """``of_several`` of a group's finite scores (two or more), NaN for the others; a
    lone finite score gets 0.5."""
    s = np.asarray(scores, dtype=np.float64)
    out = np.full(s.shape, np.nan)
    ok = np.isfinite(s)
    if ok.sum() == 1:
        out[ok] = 0.5
    elif ok.sum() > 1:
        out[ok] = of_several(s[ok])
    return out


def group_rank(scores: np.ndarray) -> np.ndarray:
    """Each score's rank within ``scores`` scaled to [0, 1] (0 the lowest, 1 the
    highest; ties share their mean rank): the fraction of the others it beats, a tie
    counting half. NaN scores get NaN and are left out of the others' ranks; a lone
    finite score gets 0.5."""
    def rank(v: np.ndarray) -> np.ndarray:
        below = (v[None, :] < v[:, None]).sum(axis=1)
        ties = (v[None, :] == v[:, None]).sum(axis=1) - 1
        return (below + 0.5 * ties) / (len(v) - 1)

    return _among_finite(scores, rank)


def group_win_rate(scores: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Each score's mean probability of being preferred to each other score of the group
    under the Bradley-Terry model on the score, ``sigmoid((s_i - s_j) / temperature)``
    (PickScore's preference between two images is this on its logit-scaled scores, at
    temperature 1). NaN scores as in :func:`group_rank`."""
    def win_rate(v: np.ndarray) -> np.ndarray:
        d = (v[:, None] - v[None, :]) / temperature
        p = 0.5 * (1.0 + np.tanh(0.5 * d))   # sigmoid, without overflow
        return (p.sum(axis=1) - 0.5) / (len(v) - 1)   # less the diagonal's 0.5

    return _among_finite(scores, win_rate)


class _Ranked:
    """A group reward's function: ``method`` applied to ``base``'s scores of the group."""

    def __init__(self, base: RewardSpec, method: str, temperature: float):
        self.base, self.method, self.temperature = base, method, temperature

    def __call__(self, samples: np.ndarray, prompts: list, metadata: list,
                 sources: Sequence = ()) -> np.ndarray:
        scores = np.asarray(self.base(samples, prompts, metadata, sources), dtype=np.float64)
        if scores.shape != (len(samples),):
            return scores  # evaluate_rewards reports the wrong shape
        if self.method == "rank":
            return group_rank(scores)
        return group_win_rate(scores, self.temperature)


def ranked_reward(name: str, base: RewardSpec, method: str = "rank",
                  temperature: float = 1.0) -> RewardSpec:
    """The group reward ``name``: ``method`` (:data:`GROUP_METHODS`) of ``base``'s score
    within each prompt group. It needs what ``base`` needs (its device). A sample
    ``base`` cannot score is left out of its group's ranking and is itself invalid."""
    if method not in GROUP_METHODS:
        raise ValueError(f"method: expected one of {list(GROUP_METHODS)}, got {method!r}")
    if base.group:
        raise ValueError(f"base: expected a reward that scores each sample alone, got the "
                         f"group reward {base.name!r}")
    what = ("rank" if method == "rank"
            else f"mean preference probability (temperature {temperature})")
    return RewardSpec(name, _Ranked(base, method, temperature), base.device,
                      f"the within-group {what} of {base.name!r}", scores=base.scores,
                      on_video=base.on_video, takes_metadata=True,
                      takes_sources=base.takes_sources, group=True)

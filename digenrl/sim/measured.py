"""A cost profile measured from a run: what each kind of task took there.

``digenrl report`` writes it beside its figures (``profile.yaml``), so that
``digenrl simulate REPORT/profile.yaml --splits ...`` (or ``digenrl bench --emulate``)
checks other pool splits, modes and scales on the run's own workload rather than on a
published one. Each cost is the mean over the run's tasks of that kind after its first
iteration (start-up left out), in speed-1 seconds (a task's seconds times its worker's
declared speed) per sample of the task's iteration (the mean chunk size the driver
recorded); bytes are the tasks' output sizes. What a run cannot measure keeps the
profile's defaults and is named in ``sources``: the network (the link bandwidth the
schedule assumes) and the co-located design's phase switch (none in this system). The
run's algorithm goes with its task counts (``trained_steps``: the micro-steps of a chunk).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from digenrl.algorithms import DEFAULT_ALGORITHM
from digenrl.vocabulary import (DECODE, DENOISE, ENCODE, GRAD, GROUP_REWARD, OPTIMIZE, PUBLISH,
                                REWARD, ROLLOUT, TRAINER)

__all__ = ["measured_profile"]


def measured_profile(tasks, metrics, attrs: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The profile (as :func:`digenrl.sim.profile.profile_from_dict` reads it) of the run
    with these ``tasks`` records (a DataFrame), per-iteration ``metrics`` (its
    ``chunk_size`` column) and store attributes. Raises ValueError when the run has no
    denoise task past its first iteration to measure."""
    cfg, derived = attrs["config"], attrs["derived"]
    tagged = attrs["cluster"]["pools"]
    speeds = {str(k): float(v) for k, v in (attrs["cluster"].get("speeds") or {}).items()}
    chunk = np.asarray(metrics["chunk_size"], dtype=float)
    t = tasks[tasks["iteration"] >= (1 if len(chunk) > 1 else 0)]
    t = t[t["iteration"] < len(chunk)]
    seconds = ((t["stop"] - t["start"]).to_numpy()
               * t["worker_name"].astype(str).map(lambda w: speeds.get(w, 1.0)).to_numpy())
    per_sample = seconds / chunk[t["iteration"].to_numpy().astype(int)]
    kind = t["kind"].to_numpy()
    nbytes = t["nbytes"].to_numpy()

    def mean(values: np.ndarray, k: str) -> float:
        """The mean of ``values`` over the tasks of kind ``k`` (0 without any)."""
        m = kind == k
        return float(np.mean(values[m])) if m.any() else 0.0

    if not (kind == DENOISE).any():
        raise ValueError("profile: expected denoise tasks after the run's first iteration "
                         f"to measure, got none in {len(chunk)} complete iterations")
    denoise = mean(per_sample, DENOISE)
    reward_gpu = bool(t.loc[kind == REWARD, "gpu"].any()) if "gpu" in t else False
    # The chunk size the run used on average (adaptive chunking varies it), as the
    # largest divisor of an iteration's images not above it (a profile's chunks are equal).
    images = int(derived["images_per_iteration"])
    size = max(d for d in range(1, images + 1)
               if images % d == 0 and d <= max(1, round(float(np.mean(chunk)))))
    latent = mean(nbytes, DENOISE) / max(float(np.mean(chunk)), 1.0)
    profile: dict[str, Any] = {
        "name": name,
        "description": f"measured from run {attrs.get('run')} ({len(chunk)} complete "
                       f"iterations, mode {attrs['schedule']['mode']})",
        "sources": [
            "costs: means over the run's tasks after its first iteration, in speed-1 "
            "seconds per sample (bytes: output sizes)",
            "network.bandwidth: the schedule's transfer_bandwidth (not measured)",
            "colocated: no phase switch and no recomputed log-probs (this system's "
            "colocated mode)",
        ],
        "rollout_workers": max(1, len(tagged.get(ROLLOUT, []))),
        "trainer_workers": max(1, len(tagged.get(TRAINER, []))),
        "prompts_per_iteration": int(cfg["data"]["prompts_per_iteration"]),
        "samples_per_prompt": int(cfg["data"]["samples_per_prompt"]),
        "chunk_size": size,
        "num_steps": int(cfg["sampler"]["num_steps"]),
        "trained_steps": int(derived["trained_steps"]),
        "algorithm": str((cfg.get("algorithm") or {}).get("name", DEFAULT_ALGORITHM)),
        "costs": {
            "denoise_per_sample": denoise,
            "cfg_factor": 1.0,   # (the measured steps include guidance's extra batch)
            "train_factor": mean(per_sample, GRAD) / denoise,
            "decode_per_sample": mean(per_sample, DECODE),
            "reward_per_sample": mean(per_sample, REWARD),
            "reward_on": "gpu" if reward_gpu else "remote",
            "optimizer_step": mean(seconds, OPTIMIZE),
            "weight_bytes": mean(nbytes, PUBLISH),
            "grad_bytes": mean(nbytes, GRAD),
            "latent_bytes_per_sample": latent,
            # (cache hits included: what a group's encoding cost this run on average)
            "encode_per_group": mean(seconds, ENCODE),
        },
        "network": {"bandwidth": float(attrs["schedule"].get("transfer_bandwidth") or 50e9)},
        "colocated": {"phase_switch": 0.0, "recompute_old_logprob": False},
        "time_scale": 1.0,
        "worker_speeds": {w: s for w, s in speeds.items()
                          if s != 1.0 and w in _profile_names(tagged)},
    }
    if (kind == GROUP_REWARD).any():  # a group_reward task scores one prompt group
        profile["costs"]["group_reward_per_sample"] = (
            mean(seconds, GROUP_REWARD) / int(cfg["data"]["samples_per_prompt"]))
    return profile


def _profile_names(tagged: Mapping[str, Any]) -> set[str]:
    """The worker names a profile knows (``rollout-0``, ``trainer-3``, ...) that the run's
    workers had (a dask-cuda worker is named after its GPU instead)."""
    return {f"{pool}-{j}" for pool in (ROLLOUT, TRAINER)
            for j in range(len(tagged.get(pool, [])))}

"""Where each named reward of a run comes from: the registry, a reward server, a VLM
judge, a model resident on the workers, or another reward ranked within each prompt
group.

:func:`resolve_rewards` is the one place they meet; the registry
(:mod:`digenrl.tasks.rewards`), the reward-server client (:mod:`digenrl.serving.remote`),
the judges (:mod:`digenrl.serving.judges`) and the model rewards
(:mod:`digenrl.tasks.reward_models`) each know only what they score.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from digenrl.config import ConfigError, RemoteRewardConfig
from digenrl.tasks.rewards import RewardSpec, get_reward, ranked_reward

__all__ = ["resolve_rewards", "remote_reward"]


def resolve_rewards(components: Mapping[str, float],
                    remote: Mapping[str, Any] | None = None,
                    models: Mapping[str, Any] | None = None,
                    group: Mapping[str, Any] | None = None,
                    ) -> tuple[tuple[RewardSpec, float], ...]:
    """Each named reward's spec with its weight, in order: a registered reward's, for a
    name in ``remote`` (``reward.remote``: name -> RemoteRewardConfig) a reward scored by
    that server, and for a name in ``models`` (``reward.models``: name ->
    RewardModelConfig) a reward scored by a model resident on the worker, and for a name
    in ``group`` (``reward.group``: name -> GroupRewardConfig) the group reward ranking
    the reward it names within each prompt group. Raises
    ConfigError for settings found wrong only now (an unset token variable, an aesthetic
    head that does not fit its CLIP model): call it before any work starts.

    The reward task carries these rather than the names: its function travels with the
    task (a module-level function by reference, so the worker imports the module that
    defines it; anything else by value), and a worker -- including one that joins or is
    restarted mid-run -- needs no registration of its own.
    """
    remote = remote or {}
    models = models or {}
    group = group or {}

    def spec(name: str) -> RewardSpec:
        if name in group:
            g = group[name]
            return ranked_reward(name, spec(g.of), g.method, g.temperature)
        if name in remote:
            return remote_reward(name, remote[name])
        if name in models:
            from digenrl.tasks.reward_models import model_reward

            return model_reward(name, models[name])
        return get_reward(name)

    return tuple((spec(name), float(weight)) for name, weight in components.items())


def remote_reward(name: str, config: RemoteRewardConfig) -> RewardSpec:
    """The spec of the reward ``name`` scored by the server ``config`` describes (a
    ``cpu`` reward taking metadata). Reads the token from ``config.token_env`` now: an
    unset variable is a :class:`ConfigError` before any work starts."""
    from digenrl.serving.remote import RemoteReward

    token = None
    if config.token_env is not None:
        token = os.environ.get(config.token_env)
        if not token:
            raise ConfigError(f"reward.remote.{name}.token_env: expected a set environment "
                              f"variable holding the server's token, got "
                              f"{config.token_env!r} (not set)")
    if config.protocol == "openai":
        from digenrl.serving.judges import openai_judge

        return RewardSpec(name, openai_judge(name, config, token), "wait",
                          f"judged by {config.model} at {config.url}", takes_metadata=True)
    fn = RemoteReward(name, config.url, config.protocol, config.timeout, config.retries,
                      config.backoff, config.batch_size, token)
    return RewardSpec(name, fn, "wait", f"scored by the reward server at {config.url}",
                      takes_metadata=True)

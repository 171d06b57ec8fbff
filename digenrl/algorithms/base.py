"""What an algorithm answers about an iteration's graph, as plain data (no torch).

An algorithm is a component, as a model family is: its shape here says how samples are
drawn (which steps of the sampler are SDE steps, with which dynamics), which micro-steps
a chunk is trained with and what each reads; its torch math (what a micro-step computes)
is in :mod:`digenrl.tasks.algorithms`. Both are found by the algorithm's name in one
registry (:data:`digenrl.algorithms.ALGORITHMS`); the graph builders
(:mod:`digenrl.graph.structure`), the simulator and the emulator read only this shape,
so they build an algorithm's graphs without torch. The scheduling policy never asks
which algorithm runs: it reads the task kinds and annotations the builders write.

Two families (docs/algorithm.md):

* **coupled** (SDE): the trained timesteps are steps of the sampling trajectory, scored
  by the log-probability of the step the sampler took (Flow-GRPO with its dynamics:
  ``flow``, ``dance``, ``cps``; SDE windows; GRPO-Guard). A chunk's micro-step ``t``
  reads the latents before and after step ``t``.
* **decoupled** (forward process): the sampler is the ODE, with no log-probabilities;
  a micro-step noises the chunk's clean (final) latent at freshly drawn noise levels and
  regresses a velocity (DiffusionNFT, AWM, online Diffusion-DPO). It reads the chunk's
  final latent and its advantages only; no trajectory is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar, Hashable, Mapping

from digenrl.seeding import SDE_WINDOW_DRAW, stable_seed

__all__ = ["Algorithm", "DYNAMICS", "ODE", "FLOW", "DANCE", "CPS", "KL_SPACES",
           "LATENT", "VELOCITY"]

# ---------------------------------------------------------------- sampling dynamics
#: Flow-GRPO's SDE: noise scale ``a * sqrt(sigma / (1 - sigma))``.
FLOW = "flow"
#: DanceGRPO's SDE: a constant noise scale ``a``.
DANCE = "dance"
#: Coefficients-preserving sampling (FlowCPS): std ``sigma_next * sin(a * pi / 2)``.
CPS = "cps"
#: The deterministic (Euler) ODE step: no noise, no log-probability.
ODE = "ode"
DYNAMICS = (FLOW, DANCE, CPS, ODE)
#: Dynamics whose step to noise level 0 has no noise (CPS: its std is ``0 * sin``): the
#: last step of the sampler is an ODE step for them.
_QUIET_LAST_STEP = frozenset({CPS})

# ---------------------------------------------------------------- KL to the reference
#: Between the means of the SDE step (coupled only): ``mean((mean - mean_ref)^2) / 2 s^2``.
LATENT = "latent"
#: Between velocities: ``mean((v - v_ref)^2)``.
VELOCITY = "velocity"
KL_SPACES = (LATENT, VELOCITY)


@lru_cache(maxsize=4096)
def _window(seed: int, candidates: tuple[int, ...], count: int,
            iteration: int) -> tuple[int, ...]:
    """``count`` of ``candidates``, ranked by their draw for ``iteration``, in step order."""
    ranked = sorted(candidates, key=lambda c: stable_seed(seed, SDE_WINDOW_DRAW, iteration, c))
    return tuple(sorted(ranked[:count]))


@dataclass(frozen=True)
class Algorithm:
    """An algorithm's shape for one run: its class says what the algorithm is, its
    fields hold the run's settings that shape the graph."""

    #: The name ``algorithm.name`` selects it by.
    name: ClassVar[str]
    #: Its paper (an arXiv id).
    paper: ClassVar[str]
    #: Coupled (SDE, log-probabilities of the trajectory's steps) or decoupled (ODE
    #: sampling, forward-process training).
    coupled: ClassVar[bool]
    #: The sampling dynamics it may use; the first is its default.
    dynamics_choices: ClassVar[tuple[str, ...]]
    #: A policy version keeps a sampling copy apart from the trained weights (a slowly
    #: moving average of them): the rollouts sample with the copy, a micro-step reads
    #: the trained weights and the copy that sampled its chunk and, where that is an
    #: older version's, the copy of the version it trains too (DiffusionNFT).
    sampling_copy: ClassVar[bool] = False
    #: A micro-step of a stale chunk runs the policy that sampled the chunk too (AWM's
    #: behaviour log-probability).
    reads_sampler: ClassVar[bool] = False
    #: A micro-step trains pairs of samples of one prompt group (online DPO), so it
    #: reads every chunk of the group.
    pairwise: ClassVar[bool] = False
    #: A micro-step always reads the frozen reference policy (online DPO), not only for
    #: a KL term.
    reference: ClassVar[bool] = False
    #: The settings a user starts from (measured on the embedded default model:
    #: docs/algorithm.md, "Each algorithm's defaults"), as dotted config fields and
    #: values: a config read from data (YAML, flags, ``config_from_dict``) that leaves a
    #: field unset gets the value of its algorithm.
    defaults: ClassVar[Mapping[str, Any]] = {}
    #: Defaults that depend on the sampling dynamics: for a dynamics, the settings whose
    #: default differs from ``defaults`` with it (a config naming no dynamics runs the
    #: first of ``dynamics_choices``, and gets that one's).
    dynamics_defaults: ClassVar[Mapping[str, Mapping[str, Any]]] = {}

    num_steps: int
    """The sampler's steps."""
    trained_steps: int
    """Coupled without an SDE window: the first steps trained (``sampler.trained_steps``).
    Decoupled: the micro-steps of a chunk (noise levels drawn per sample)."""
    dynamics: str = ""
    """The sampling dynamics; empty: the algorithm's default."""
    sde_candidates: tuple[int, ...] = ()
    """Coupled: the steps an SDE window draws from (empty: no window, every step SDE)."""
    num_sde_steps: int | None = None
    """With a window: how many candidates each iteration samples with the SDE."""
    seed: int = 0
    """The run seed (the window's draw)."""

    def __post_init__(self) -> None:
        if not self.dynamics:
            object.__setattr__(self, "dynamics", self.dynamics_choices[0])

    @classmethod
    def defaults_for(cls, dynamics: Any = None) -> dict[str, Any]:
        """The settings a user starts from with sampling dynamics ``dynamics`` (None or
        empty: the algorithm's own): ``defaults``, with that dynamics' entries of
        ``dynamics_defaults`` in place of theirs. A dynamics the algorithm does not
        have gets ``defaults`` (validation names it)."""
        chosen = dynamics or cls.dynamics_choices[0]
        own = cls.dynamics_defaults.get(chosen, {}) if isinstance(chosen, str) else {}
        return {**cls.defaults, **own}

    # ------------------------------------------------------------------ sampling

    @property
    def window(self) -> bool:
        """Whether the SDE steps are a window drawn per iteration (ODE elsewhere)."""
        return self.coupled and bool(self.sde_candidates)

    def sde_steps(self, iteration: int) -> tuple[int, ...]:
        """The steps of iteration ``iteration``'s sampler that use the SDE (and record a
        log-probability), in order; the others are ODE steps. Decoupled: none."""
        if not self.coupled:
            return ()
        if self.window:
            count = self.num_sde_steps or len(self.sde_candidates)
            return _window(self.seed, tuple(self.sde_candidates), count, iteration)
        last = self.num_steps - (1 if self.dynamics in _QUIET_LAST_STEP else 0)
        return tuple(range(last))

    def keeps_trajectory(self) -> bool:
        """Whether a chunk's steps feed its training (coupled) or only its final latent."""
        return self.coupled

    # ------------------------------------------------------------------ training

    def micro_steps(self, iteration: int) -> tuple[int, ...]:
        """The micro-steps of a chunk in iteration ``iteration``: the trained timesteps
        (coupled: the window's SDE steps, or the first ``trained_steps``), or the draws
        ``0 .. trained_steps - 1`` (decoupled)."""
        if self.coupled and self.window:
            return self.sde_steps(iteration)
        return tuple(range(self.trained_steps))

    def micro_steps_per_chunk(self) -> int:
        """How many micro-steps each chunk has (the same in every iteration)."""
        if self.coupled and self.window:
            return self.num_sde_steps or len(self.sde_candidates)
        return self.trained_steps

    def iteration_shape(self, iteration: int) -> Hashable:
        """What of iteration ``iteration``'s graph depends on the iteration itself, beyond
        the shift of its keys and versions: the SDE window (None without one)."""
        return self.sde_steps(iteration) if self.window else None

"""One chunk's denoise step computed by ``d`` processes together: Ulysses context
parallelism through diffusers' own (``ContextParallelConfig(ulysses_degree=d)`` and the
family's plan, :meth:`~digenrl.models.base.ModelFamily.context_parallel_plan`).

Each of the ``d`` processes (the members of a collective group, :mod:`.collective`)
holds the whole transformer and the chunk's whole inputs. The plan's hooks split the
token sequence: each process runs every layer on ``1/d`` of the image's tokens (and of
the text's, where the plan splits them), and inside each attention an all-to-all swaps
the split from tokens to heads, so each process attends over every token with ``heads/d``
heads, and back. The transformer's last projection gathers the tokens, so every process
gets the whole velocity, computes the same sampler step from it and returns the same
:class:`~digenrl.tasks.types.StepOut` as :func:`digenrl.tasks.rollout.denoise` at degree 1
(equal up to floating-point summation order).

:func:`context_parallel` makes the family's transformer context-parallel for the
duration of a ``with`` block (:func:`digenrl.tasks.ulysses.parallel`, after the family's
checks: a plan, heads the degree divides; and with its attention processors able to
split where they are not: ``ModelFamily.parallel_attention``), and :func:`denoise` is
:func:`digenrl.tasks.rollout.denoise` run inside one, so the sampler step is one code.
Outside the block the resident module computes as before, so other tasks of the worker
use it between steps; during the block every call of it is a collective step of the
group. No run's graph uses this yet ("Context parallelism" in docs/architecture.md).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

from digenrl.config import ModelConfig
from digenrl.models import family
from digenrl.tasks import rollout
from digenrl.tasks.collective import Group
from digenrl.tasks.resident import resident
from digenrl.tasks.rollout import RolloutSpec
from digenrl.tasks.types import Latents, PolicyWeights, StepOut
from digenrl.tasks.ulysses import degree, parallel

if TYPE_CHECKING:
    from diffusers import ModelMixin

__all__ = ["context_parallel", "denoise"]


@contextmanager
def context_parallel(transformer: "ModelMixin", cfg: ModelConfig,
                     over: Group | Any) -> Iterator["ModelMixin"]:
    """``transformer`` (of the family ``cfg`` names) computing context-parallel over
    ``over`` (a collective group, or a device mesh:
    :func:`~digenrl.tasks.ulysses.parallel_config`) inside the block, by the family's
    plan: every member calls it with the same inputs and receives the whole output. Raises
    :class:`~digenrl.config.ConfigError` naming ``rollout.context_parallel`` before
    anything is changed when the family has no plan or its heads do not divide among
    the members."""
    fam = family(cfg)
    fam.check_context_parallel(degree(over))
    plan = fam.context_parallel_plan()
    assert plan is not None     # (the check refuses a family without one)
    with fam.parallel_attention(transformer), parallel(transformer, plan, over):
        yield transformer


def denoise(spec: RolloutSpec, weights: PolicyWeights, prompts: tuple[str, ...],
            iteration: int, t: int, previous: Latents | StepOut, over: Group | Any) -> StepOut:
    """:func:`digenrl.tasks.rollout.denoise` with its velocity computed by every member
    of ``over`` together (each calls this with the same arguments, in a task of its own)
    and the same result on each."""
    models = resident(spec.model, spec.model_seed, spec.trainable)
    with context_parallel(models.policy(weights), spec.model, over):
        return rollout.denoise(spec, weights, prompts, iteration, t, previous)

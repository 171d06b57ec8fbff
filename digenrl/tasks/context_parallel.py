"""One chunk's denoise step computed by ``d`` processes together: Ulysses context
parallelism through diffusers' own (``ContextParallelConfig(ulysses_degree=d)`` and the
family's ``_cp_plan``).

Each of the ``d`` processes (the members of a collective group, :mod:`.collective`)
holds the whole transformer and the chunk's whole inputs. The plan's hooks split the
token sequence: each process runs every layer on ``1/d`` of the image's tokens (and of
the text's, where the plan splits them), and inside each attention an all-to-all swaps
the split from tokens to heads, so each process attends over every token with ``heads/d``
heads, and back. The transformer's last projection gathers the tokens, so every process
gets the whole velocity, computes the same sampler step from it and returns the same
:class:`~digenrl.tasks.types.StepOut` as :func:`digenrl.tasks.rollout.denoise` at degree 1
(equal up to floating-point summation order: the attention of a head runs on one process
instead of beside the others).

:func:`context_parallel` makes a transformer context-parallel for the duration of a
``with`` block, and :func:`denoise` is :func:`digenrl.tasks.rollout.denoise` run inside
one (the sampler step is the same code). Outside the block the resident module computes
as before (its hooks are removed and its attention processors forget the group), so
other tasks of the worker use it between steps; during the block every call of it is
a collective step of the group.

diffusers 0.42.1's ``ModelMixin.enable_parallelism`` places each rank on device ``rank %
torch.accelerator.device_count()``, a division by zero on a CPU-only torch (gloo);
:func:`context_parallel` does what that method does for context parallelism (the
processors' configuration, the plan's hooks by ``apply_context_parallel``) with the
group's own device (the worker's GPU under NCCL, the CPU under gloo) and a device mesh
built once per group formation.

Ulysses splits heads, so the family's attention heads must divide by ``d``
(:meth:`~digenrl.models.base.ModelFamily.check_context_parallel`, checked before any
work). Token counts need not: the split is diffusers' "Ulysses anything" (each process
takes ``tensor_split``'s share), since a prompt's own length (Qwen-Image) or a source
image's tokens (FLUX.1 Kontext, Qwen-Image-Edit) differ from chunk to chunk. Ring
attention needs a GPU attention backend and is not used here. No run's graph uses this
yet ("Context parallelism" in docs/architecture.md).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist

from digenrl.config import ModelConfig
from digenrl.models import family
from digenrl.tasks import rollout
from digenrl.tasks.collective import Group
from digenrl.tasks.resident import resident
from digenrl.tasks.rollout import RolloutSpec
from digenrl.tasks.types import Latents, PolicyWeights, StepOut

if TYPE_CHECKING:
    from diffusers import ModelMixin

__all__ = ["context_parallel", "parallel", "denoise", "parallel_config", "MESH_DIMS"]

#: The device mesh's dimensions, as diffusers' ContextParallelConfig names them.
MESH_DIMS = ("ring", "ulysses")

#: The parallel configuration of the live group's formation (at most one: a process is
#: in one collective group at a time), built on its first step.
_CONFIGS: dict[str, Any] = {}
_LOCK = threading.Lock()


def parallel_config(over: Group | Any) -> Any:
    """diffusers' ``ParallelConfig`` for Ulysses over every member of ``over``: a
    :class:`~digenrl.tasks.collective.Group` (its mesh built on the first call of its
    formation, by every member: a collective) or a ``DeviceMesh`` with the dimensions
    :data:`MESH_DIMS` (ring of size 1)."""
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if isinstance(over, DeviceMesh):
        names = over.mesh_dim_names
        if names != MESH_DIMS or over[MESH_DIMS[0]].size() != 1:
            raise ValueError(f"context parallelism: expected a device mesh of dimensions "
                             f"{MESH_DIMS} with a ring of 1, got {names} of shape "
                             f"{tuple(over.mesh.shape)}")
        return _config(over, over.device_type, ContextParallelConfig, ParallelConfig)
    if not isinstance(over, Group):
        raise TypeError(f"context parallelism: expected a collective Group or a DeviceMesh, "
                        f"got {type(over).__name__}")
    with _LOCK:
        config = _CONFIGS.get(over.formation)
        if config is None:
            device = over.device
            # The group is this process's default process group: the mesh spans it.
            mesh = init_device_mesh(device.type, (1, over.size), mesh_dim_names=MESH_DIMS)
            config = _config(mesh, device.type, ContextParallelConfig, ParallelConfig)
            _CONFIGS.clear()     # an earlier formation's groups are gone with it
            _CONFIGS[over.formation] = config
        return config


def _config(mesh: Any, device_type: str, cp_class: Any, parallel_class: Any) -> Any:
    """A ``ParallelConfig`` set up on ``mesh`` as ``_resolve_parallel_config`` sets one
    up, with this process's device of ``device_type`` (the current CUDA device, or the
    CPU)."""
    degree = mesh[MESH_DIMS[1]].size()
    config = parallel_class(context_parallel_config=cp_class(ulysses_degree=degree,
                                                             ulysses_anything=True,
                                                             mesh=mesh))
    device = (torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda"
              else torch.device(device_type))
    config.setup(dist.get_rank(), dist.get_world_size(), device, mesh=mesh)
    return config


def _processors(transformer: torch.nn.Module) -> list[Any]:
    """The attention processors of ``transformer`` that take a parallel configuration."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    found: dict[int, Any] = {}
    for module in transformer.modules():
        if isinstance(module, (Attention, AttentionModuleMixin)):
            processor = getattr(module, "processor", None)
            if processor is not None and hasattr(processor, "_parallel_config"):
                found[id(processor)] = processor
    return list(found.values())


def _check_backend(processors: list[Any]) -> None:
    """The processors' attention backend splits over processes (as
    ``enable_parallelism`` checks it)."""
    from diffusers.models.attention_dispatch import (AttentionBackendName,
                                                     _AttentionBackendRegistry)

    for processor in processors[:1]:
        backend = getattr(processor, "_attention_backend", None)
        backend = (_AttentionBackendRegistry.get_active_backend()[0] if backend is None
                   else AttentionBackendName(backend))
        if not _AttentionBackendRegistry._is_context_parallel_available(backend):
            raise ValueError(f"context parallelism: the attention backend {backend.value!r} "
                             f"does not split over processes (these do: "
                             f"{sorted(_AttentionBackendRegistry._supports_context_parallel)})")


@contextmanager
def context_parallel(transformer: "ModelMixin", cfg: ModelConfig,
                     over: Group | Any) -> Iterator["ModelMixin"]:
    """``transformer`` (of the family ``cfg`` names) computing context-parallel over
    ``over`` (see :func:`parallel_config`) inside the block, by the family's plan: every
    member calls it with the same inputs and receives the whole output. Raises
    :class:`~digenrl.config.ConfigError` naming ``rollout.context_parallel`` before
    anything is changed when the family has no plan or its heads do not divide among
    the members."""
    fam = family(cfg)
    fam.check_context_parallel(over.size if isinstance(over, Group)
                               else over[MESH_DIMS[1]].size())
    plan = fam.context_parallel_plan()
    assert plan is not None     # (the check refuses a family without one)
    with fam.parallel_attention(transformer), parallel(transformer, plan, over):
        yield transformer


@contextmanager
def parallel(transformer: "ModelMixin", plan: dict, over: Group | Any
             ) -> Iterator["ModelMixin"]:
    """``transformer`` context-parallel over ``over`` by ``plan`` (a diffusers
    ``_cp_plan``) inside the block, as ``enable_parallelism`` makes it (without its
    device arithmetic), and as before after it."""
    if getattr(transformer, "_parallel_config", None) is not None:
        raise RuntimeError(f"context parallelism: this {type(transformer).__name__} is "
                           f"already parallel (one step at a time per module)")
    from diffusers.hooks.context_parallel import (apply_context_parallel,
                                                  remove_context_parallel)

    processors = _processors(transformer)
    _check_backend(processors)
    config = parallel_config(over)
    transformer._parallel_config = config
    for p in processors:
        p._parallel_config = config
    try:
        apply_context_parallel(transformer, config.context_parallel_config, plan)
        try:
            yield transformer
        finally:
            remove_context_parallel(transformer, plan)
    finally:
        for p in processors:
            p._parallel_config = None
        transformer._parallel_config = None


def denoise(spec: RolloutSpec, weights: PolicyWeights, prompts: tuple[str, ...],
            iteration: int, t: int, previous: Latents | StepOut, over: Group | Any) -> StepOut:
    """:func:`digenrl.tasks.rollout.denoise` with its velocity computed by every member
    of ``over`` together (each calls this with the same arguments, in a task of its own)
    and the same result on each."""
    models = resident(spec.model, spec.model_seed, spec.trainable)
    with context_parallel(models.policy(weights), spec.model, over):
        return rollout.denoise(spec, weights, prompts, iteration, t, previous)

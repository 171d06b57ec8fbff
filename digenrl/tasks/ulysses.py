"""Ulysses context parallelism on a diffusers transformer, by a plan, over the members of
a collective group: the mechanism :mod:`digenrl.tasks.context_parallel` computes a
chunk's step with (it knows the families; this knows only diffusers and torch, so a
timing script imports it where no Dask is installed).

:func:`parallel` makes a transformer context-parallel for the duration of a ``with``
block, as diffusers' ``ModelMixin.enable_parallelism`` makes it for good: the
``ParallelConfig`` its attention processors read, the plan's hooks that split the token
sequence on the way in and gather it on the way out (``apply_context_parallel``); after
the block the hooks are removed and the processors forget the group, so the module
computes alone again. diffusers 0.42.1's ``enable_parallelism`` places each rank on
device ``rank % torch.accelerator.device_count()``, a division by zero on a CPU-only
torch (gloo): here the device is the group's own (the worker's GPU under NCCL, the CPU
under gloo), and the device mesh is built once per group formation
(:func:`parallel_config`).

The split is diffusers' "Ulysses anything" (each process takes ``tensor_split``'s share
of the tokens, the sizes exchanged at each attention): token counts need not divide by
the degree, since a prompt's own length or a source image's tokens differ from chunk to
chunk. The heads must (checked by the caller). Ring attention needs a GPU attention
backend and is not used.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist

from digenrl.tasks.collective import Group

if TYPE_CHECKING:
    from diffusers import ModelMixin

__all__ = ["parallel", "parallel_config", "degree", "MESH_DIMS"]

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
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if isinstance(over, DeviceMesh):
        names = over.mesh_dim_names
        if names != MESH_DIMS or over[MESH_DIMS[0]].size() != 1:
            raise ValueError(f"context parallelism: expected a device mesh of dimensions "
                             f"{MESH_DIMS} with a ring of 1, got {names} of shape "
                             f"{tuple(over.mesh.shape)}")
        return _config(over, over.device_type)
    if not isinstance(over, Group):
        raise TypeError(f"context parallelism: expected a collective Group or a DeviceMesh, "
                        f"got {type(over).__name__}")
    with _LOCK:
        config = _CONFIGS.get(over.formation)
        if config is None:
            device = over.device
            # The group is this process's default process group: the mesh spans it.
            mesh = init_device_mesh(device.type, (1, over.size), mesh_dim_names=MESH_DIMS)
            config = _config(mesh, device.type)
            _CONFIGS.clear()     # an earlier formation's groups are gone with it
            _CONFIGS[over.formation] = config
        return config


def _config(mesh: Any, device_type: str) -> Any:
    """A ``ParallelConfig`` set up on ``mesh`` as ``_resolve_parallel_config`` sets one
    up, with this process's device of ``device_type`` (the current CUDA device, or the
    CPU)."""
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    config = ParallelConfig(context_parallel_config=ContextParallelConfig(
        ulysses_degree=mesh[MESH_DIMS[1]].size(), ulysses_anything=True, mesh=mesh))
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


def degree(over: Group | Any) -> int:
    """The Ulysses degree of ``over`` (see :func:`parallel_config`): its members."""
    return over.size if isinstance(over, Group) else over[MESH_DIMS[1]].size()


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

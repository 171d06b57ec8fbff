"""Full-parameter training with the weights, gradients and AdamW moments sharded over a
gang of trainers (FSDP2, ``torch.distributed.fsdp.fully_shard``).

Each transformer block (the family's :attr:`~digenrl.models.base.ModelFamily.block_lists`)
is one FSDP unit and the root holds the rest, so a rank keeps ``1/k`` of every float32
parameter, of its gradient and of both AdamW moments, and gathers one block's weights at
a time for the forward and backward passes (in bfloat16 when ``model.dtype`` is
bfloat16, with gradients reduced in float32).

A :class:`ShardedTrainer` runs the same micro-steps as :func:`~digenrl.tasks.train.grad`
and :func:`~digenrl.tasks.train.matching_grad`: the same algorithm math, and the same
summed, normalised loss and statistics (:func:`~digenrl.tasks.train.micro_loss`), back-
propagated with ``backward`` (FSDP's hooks need it). Gradients accumulate in each rank's
unsharded gradients across the micro-steps of an iteration without any communication;
the last micro-step's backward reduce-scatters their sum (a sum over the ranks: the loss
is already normalised by the iteration's rows), leaving each rank the gradient of its
shard. Every rank takes part in every micro-step: one without a chunk of its own passes
any chunk with ``contributes=False`` and adds zero through the same forward and backward,
since FSDP's collectives need every rank. :meth:`ShardedTrainer.optimize` clips by the
global gradient norm (each shard's squared norm, all-reduced) and takes the AdamW step of
:func:`~digenrl.tasks.train.adamw_update` on each shard, so sharded and unsharded training
agree up to the order of the reductions. :meth:`ShardedTrainer.full_weights` gathers the
version's full weights, named as :func:`~digenrl.models.lora.trainable_parameters` names
them, for publishing.

:meth:`ShardedTrainer.save_checkpoint` writes the trainer state (each rank its shards) as
the version's sharded checkpoint in the run's store with ``torch.distributed.checkpoint``
(:mod:`digenrl.store.sharded`), and :meth:`ShardedTrainer.load_checkpoint` continues from
one on a gang of any size (DCP reshards).

A run with ``train.sharding: fsdp`` calls it from the gang tasks of
:mod:`digenrl.tasks.sharded_steps`, one :class:`ShardedTrainer` kept in each member's
process; an algorithm with a sampling copy (DiffusionNFT) keeps the copy sharded beside
the moments, and publishes it (:meth:`ShardedTrainer.published`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from digenrl.models import family
from digenrl.models.lora import build_policy, cast_for_forward, trainable_parameters
from digenrl.store.sharded import load_sharded, save_sharded, state_key
from digenrl.tasks.algorithms.common import Policies
from digenrl.store import SAMPLING_PART
from digenrl.tasks.train import (TrainSpec, adamw_update, coupled_result, decoupled_result,
                                 grad_norm_clip, micro_loss, sampling_copy_update)
from digenrl.tasks.types import (AdvantageOut, IterationStats, Latents, MicroStats,
                                 PolicyWeights, StepOut)

if TYPE_CHECKING:
    from diffusers import ModelMixin

__all__ = ["shard_transformer", "sharded_policy", "ShardedTrainer", "local_tensors",
           "local_state_bytes"]


def shard_transformer(module: torch.nn.Module, mesh, *, dtype: str | torch.dtype,
                      blocks: Sequence[str]) -> torch.nn.Module:
    """``module`` sharded over ``mesh`` in place (and returned): ``fully_shard`` on every
    block of the ``ModuleList`` attributes ``blocks`` names (the family's
    ``block_lists``), then on the root. With ``dtype`` bfloat16 the gathered weights and
    the computation are bfloat16 and gradients are reduced in float32; otherwise all is
    float32. The parameters become DTensors, each rank holding its shard."""
    bf16 = dtype in ("bfloat16", torch.bfloat16)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else torch.float32,
                                  reduce_dtype=torch.float32)
    for name in blocks:
        for block in getattr(module, name):
            fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            # The loss is normalised by the iteration's rows already: the ranks' parts
            # add up (a plain sum: gloo has no pre-multiplied one).
            sub.set_gradient_divide_factor(1.0)
            sub.set_force_sum_reduction_for_comms(True)
    return module


def sharded_policy(spec: TrainSpec, mesh) -> torch.nn.Module:
    """Version 0's transformer (:func:`~digenrl.models.lora.build_policy`, float32)
    sharded over ``mesh`` in ``model.dtype``, by the family's blocks.

    Only the mesh's first rank builds the whole model (its folder's weights, or the
    seeded ones); the others build its modules on the meta device
    (:meth:`~digenrl.models.base.ModelFamily.transformer_skeleton`), shard them there,
    and receive their slices of the first rank's weights (``distribute_tensor`` from the
    mesh's first rank, one tensor at a time) and every buffer by broadcast: no other
    process holds more than one whole tensor of the model at a time."""
    if spec.trainable.lora:
        raise ValueError("train.lora_rank: expected 0 for sharded training (it shards every "
                         f"weight), got {spec.trainable.lora_rank}")
    group = mesh.get_group()
    first = dist.get_rank(group) == 0
    fam = family(spec.model)
    if first:
        module = build_policy(spec.model, spec.trainable, spec.seed)
    else:
        skeleton: ModelMixin = fam.transformer_skeleton()
        if spec.trainable.gradient_checkpointing:
            skeleton.enable_gradient_checkpointing()
        module = skeleton
    # Its buffers in model.dtype as the unsharded module holds them (FSDP casts only the
    # parameters it gathers).
    cast_for_forward(module, spec.model, spec.trainable, parameters=False)
    # (The built tensors themselves: sharding copies each rank's slice out of them, and
    # each goes once it is sent.)
    full = {n: p.detach() for n, p in module.named_parameters()} if first else {}
    module = shard_transformer(module, mesh, dtype=spec.model.dtype, blocks=fam.block_lists)
    if not first:
        module.to_empty(device=torch.device(mesh.device_type))
    root = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for n, p in module.named_parameters():
            assert isinstance(p, DTensor)
            whole = full.pop(n) if first else torch.empty(p.shape, dtype=p.dtype,
                                                          device=p.to_local().device)
            p.to_local().copy_(distribute_tensor(whole, mesh, p.placements).to_local())
        for buffer in module.buffers():
            dist.broadcast(buffer, src=root, group=group)
    return module


def local_tensors(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """Each parameter's local shard (the tensor itself where it is not a DTensor)."""
    return {n: (p.to_local() if isinstance(p, DTensor) else p) for n, p in params.items()}


def local_state_bytes(module: torch.nn.Module, moments: int = 2) -> int:
    """Bytes this rank holds of ``module``'s trainable parameters, their gradients (as
    large as the parameters) and ``moments`` AdamW moments of the same size: the
    parameters' local storage times ``2 + moments``."""
    local = local_tensors(trainable_parameters(module))
    return (2 + moments) * sum(t.numel() * t.element_size() for t in local.values())


def _like(param: torch.Tensor, local: torch.Tensor) -> DTensor:
    """``local`` as this rank's shard of a DTensor laid out as the sharded ``param``."""
    assert isinstance(param, DTensor)
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


@dataclass
class _Shards:
    """A rank's shard of the trainer state: AdamW's moments (and, for an algorithm that
    samples with one, the sampling copy) beside the module's own (sharded) parameters."""

    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    step: int = 0
    sampling: dict[str, torch.Tensor] | None = None


class ShardedTrainer:
    """One rank's part of sharded training of ``module`` (from :func:`sharded_policy`)
    with the micro-steps of ``spec``'s algorithm, starting at policy ``version``.

    Per iteration: micro-steps (:meth:`grad` or :meth:`matching_grad`), the last of them
    with ``last=True`` (every rank the same number, in step), then :meth:`optimize`. The
    norm and the statistics are reduced over the process group of the module's mesh."""

    def __init__(self, spec: TrainSpec, module: torch.nn.Module, version: int = 0):
        self.spec, self.module, self.version = spec, module, version
        first = next(module.parameters())
        if not isinstance(first, DTensor):
            raise ValueError("module: expected a sharded transformer (shard_transformer), "
                             f"got a {type(module).__name__} whose parameters are not "
                             "sharded")
        self.device = first.device
        self.group = first.device_mesh.get_group()
        local = local_tensors(trainable_parameters(module))
        self.shards = _Shards({n: torch.zeros_like(t) for n, t in local.items()},
                              {n: torch.zeros_like(t) for n, t in local.items()})
        if spec.algorithm.sampling_copy:  # version 0's copy: the weights themselves
            self.shards.sampling = {n: t.detach().clone() for n, t in local.items()}
        self.stats = MicroStats()
        self._started = False

    # ------------------------------------------------------------------ micro-steps

    def grad(self, reference: torch.nn.Module | None, prompts: tuple[str, ...], t: int,
             before: Latents | StepOut, after: StepOut, *advantages: AdvantageOut,
             last: bool = False, contributes: bool = True) -> MicroStats:
        """A coupled micro-step (:func:`~digenrl.tasks.train.grad`'s loss) of one chunk at
        trained step ``t``; ``reference``: version 0's module where the loss has a KL
        term."""
        self._check_reference(reference)
        policies = self._policies(None, reference, None)
        result = coupled_result(self.spec, policies, self.device, prompts, t, before, after,
                                advantages)
        return self._backward(result, self.version - after.version, last, contributes)

    def matching_grad(self, sampling: torch.nn.Module | None, anchor: torch.nn.Module | None,
                      reference: torch.nn.Module | None, prompts: tuple[str, ...],
                      iteration: int, j: int, *inputs: StepOut | AdvantageOut,
                      last: bool = False, contributes: bool = True) -> MicroStats:
        """Decoupled micro-step ``j`` (:func:`~digenrl.tasks.train.matching_grad`'s loss);
        ``sampling``, ``anchor``, ``reference``: the modules of those roles (plain or
        sharded; a sharded one's forward needs every rank as well)."""
        self._check_reference(reference)
        policies = self._policies(sampling, reference, anchor)
        result, behaviour = decoupled_result(self.spec, policies, self.device, prompts,
                                             iteration, j, inputs)
        return self._backward(result, self.version - behaviour, last, contributes)

    def _check_reference(self, reference) -> None:
        if self.spec.kl_beta > 0 and reference is None:
            raise ValueError(f"train.kl_beta: a sharded micro-step with a KL term "
                             f"({self.spec.kl_beta}) needs the reference module, got None")

    def _policies(self, sampling, reference, anchor) -> Policies:
        spec = self.spec
        return Policies(spec.model, spec.sampler.guidance_scale, self.module, sampling,
                        reference, spec.trainable.lora, anchor)

    def _backward(self, result, staleness: int, last: bool, contributes: bool) -> MicroStats:
        assert isinstance(self.module, FSDPModule)
        total, stats = micro_loss(self.spec, result, staleness)
        if not contributes:
            total, stats = total * 0.0, MicroStats()
        if not self._started:
            self.module.zero_grad(set_to_none=True)
            self._started = True
        # Accumulate locally; the iteration's last backward reduce-scatters the sum.
        self.module.set_requires_gradient_sync(last)
        self.module.set_is_last_backward(last)
        total.backward()
        self.stats = self.stats.combine(stats)
        return stats

    # ------------------------------------------------------------------ optimizer step

    def gradients(self) -> dict[str, torch.Tensor]:
        """This rank's shard of the iteration's summed gradient (zero for a parameter no
        micro-step reached), after the last micro-step."""
        params = trainable_parameters(self.module)
        local = local_tensors(params)
        return {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).float()
                if p.grad is not None else torch.zeros_like(local[n])
                for n, p in params.items()}

    def global_norm(self, grads: dict[str, torch.Tensor]) -> float:
        """The norm of the whole gradient: the shards' squared norms, all-reduced."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)  # (NCCL: on the GPU)
        for g in grads.values():
            sq += torch.linalg.vector_norm(g).double() ** 2
        dist.all_reduce(sq, group=self.group)
        return float(sq.sqrt())

    def optimize(self, iteration: int) -> IterationStats:
        """Clip by the global gradient norm and take one AdamW step on this rank's shards
        (as :func:`~digenrl.tasks.train.optimize`): version + 1. Returns the iteration's
        statistics over every rank's micro-steps (gathered in rank order)."""
        grads = self.gradients()
        norm = self.global_norm(grads)
        coef = grad_norm_clip(norm, self.spec.train)
        params = trainable_parameters(self.module)
        sh = self.shards
        sh.step += 1
        with torch.no_grad():
            local = local_tensors(params)
            # One tensor at a time, each moment replaced as it is updated: the step holds
            # one tensor's new values beside the state, not a second state.
            for n, t in local.items():
                g = grads.pop(n)
                if coef < 1.0:
                    g = g * coef
                new_p, m, v = adamw_update({n: t.detach()}, {n: sh.exp_avg[n]},
                                           {n: sh.exp_avg_sq[n]}, {n: g}, sh.step,
                                           self.spec.train)
                sh.exp_avg[n], sh.exp_avg_sq[n] = m[n], v[n]
                t.copy_(new_p[n])
                params[n].grad = None
                if sh.sampling is not None:
                    sh.sampling[n] = sampling_copy_update(
                        {n: sh.sampling[n]}, {n: t.detach()},
                        self.spec.settings.sampling_copy_decay(iteration))[n]
        self.module.zero_grad(set_to_none=True)
        self._started = False
        self.version += 1
        gathered: list[MicroStats | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, self.stats, group=self.group)
        micro = MicroStats()
        for s in gathered:
            assert s is not None
            micro = micro.combine(s)
        self.stats = MicroStats()
        published = 4 * sum(p.numel() for p in params.values())  # the full float32 weights
        return IterationStats(iteration=iteration, version=self.version, micro=micro,
                              grad_norm=norm, weight_bytes=published)

    # ------------------------------------------------------------------ checkpoints

    def sharded_state(self) -> dict[str, torch.Tensor]:
        """This rank's part of the trainer state as DTensors over the gang, keyed by
        :func:`~digenrl.store.sharded.state_key`: each trainable parameter and its two
        AdamW moments (views of this rank's shards)."""
        state: dict[str, torch.Tensor] = {}
        for n, p in trainable_parameters(self.module).items():
            for part, local in self._locals(n, p):
                state[state_key(part, n)] = _like(p, local)
        return state

    def _locals(self, n: str, p: torch.nn.Parameter) -> tuple[tuple[str, torch.Tensor], ...]:
        assert isinstance(p, DTensor)
        parts = [("params", p.to_local().detach()), ("exp_avg", self.shards.exp_avg[n]),
                 ("exp_avg_sq", self.shards.exp_avg_sq[n])]
        if self.shards.sampling is not None:
            parts.append((SAMPLING_PART, self.shards.sampling[n]))
        return tuple(parts)

    def save_checkpoint(self, store: str) -> None:
        """Write this version's sharded checkpoint into the store (every rank of the gang
        calls it after the same optimizer step): :func:`~digenrl.store.sharded.save_sharded`."""
        save_sharded(store, self.version, self.sharded_state(), self.shards.step, self.group)

    def load_checkpoint(self, store: str, version: int) -> None:
        """Continue from version ``version``'s sharded checkpoint, written by a gang of any
        size (every rank of this gang calls it): the parameters, the AdamW moments and
        step, and the version. DCP reads into new tensors of this rank's shards' layout,
        which are then copied into the shards."""
        params = trainable_parameters(self.module)
        state: dict[str, torch.Tensor] = {
            state_key(part, n): _like(p, torch.empty_like(local))
            for n, p in params.items() for part, local in self._locals(n, p)}
        step = load_sharded(store, version, state, self.group)
        with torch.no_grad():
            for n, p in params.items():
                for part, local in self._locals(n, p):
                    loaded = state[state_key(part, n)]
                    assert isinstance(loaded, DTensor)
                    local.copy_(loaded.to_local())
        self.module.zero_grad(set_to_none=True)
        self.shards.step, self.version = step, version
        self.stats, self._started = MicroStats(), False

    # ------------------------------------------------------------------ publishing

    def published(self) -> PolicyWeights | None:
        """The version's weights as the rollout workers receive them (its sampling copy
        where the algorithm keeps one, else the trained weights; float32 on the CPU, as
        :func:`~digenrl.tasks.train.publish` gives them unsharded), on rank 0 of the group;
        None on the other ranks. Every rank takes part: each tensor is gathered in turn,
        so a rank holds at most one full tensor beside its shards."""
        rank0 = dist.get_rank(self.group) == 0
        copy = self.shards.sampling
        out: dict[str, torch.Tensor] = {}
        for n, p in trainable_parameters(self.module).items():
            assert isinstance(p, DTensor)
            local = copy[n] if copy is not None else p.to_local().detach()
            full = _like(p, local).full_tensor()
            if rank0:
                out[n] = full.float().cpu()
        if not rank0:
            return None
        return PolicyWeights(version=self.version, tensors=out, sampling_copy=copy is not None)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The version's full trainable weights (float32, on the CPU), named as
        :func:`~digenrl.models.lora.trainable_parameters` names them, on rank 0 of the
        group; an empty dict on the other ranks (every rank takes part in gathering)."""
        state = get_model_state_dict(self.module, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        names = trainable_parameters(self.module)
        return {n: t for n, t in state.items() if n in names and isinstance(t, torch.Tensor)}

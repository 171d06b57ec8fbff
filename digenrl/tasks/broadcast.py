"""A policy version's full weights from a trainer to every rollout worker by collective
broadcast, in buckets, over a group of :mod:`digenrl.tasks.collective`.

Only the :class:`Manifest` travels through Dask (plain data on the project's wire format:
the version and, per tensor, its name, shape, dtype, bucket and byte offset in it); the
bytes go over the group. Every member calls, inside a task of its own, with the same
manifest: :func:`send` on rank 0 (a trainer holding the version's full state dict, e.g.
:meth:`~digenrl.tasks.sharding.ShardedTrainer.full_weights`), :func:`receive` on every
other rank.

**Buckets.** The manifest lays the tensors out, in the state dict's order, in buckets of
at most ``bucket_mb`` MiB (a tensor larger than that is a bucket of its own), each tensor
at an offset that is a multiple of :data:`~digenrl.serving.wire.ALIGN` bytes (so a slice
of a bucket is a valid view of any dtype). A bucket is a flat uint8 buffer on the group's
device (:attr:`~digenrl.tasks.collective.Group.device`) and is moved by one
``dist.broadcast`` from rank 0. Two buffers alternate on every rank: the sender packs
bucket ``k + 1`` while bucket ``k`` is in flight (``async_op=True``), waiting for the
broadcast that last used a buffer before it packs that buffer again; a receiver posts the
broadcast of bucket ``k + 1`` before it unpacks bucket ``k``.

**Where the bytes land.** A receiver unpacks each bucket straight into its tensors:
``into`` a module (its parameters and buffers by name) or a dict of tensors is written in
place with ``copy_``, with no second full copy of the weights; with ``into`` None each bucket is
received into memory of its own and the new tensors are views of it (no copy at all). Tensors of ``into`` the manifest does not name are left as they are (a
LoRA base, buffers the version does not carry).

**Refusals, on every member together.** Before any bucket moves, each rank checks its
side: the sender that its state dict holds exactly the manifest's tensors, a receiver
that ``into`` holds every tensor the manifest names with its shape and dtype, and that
the manifest's version is not older than the one it holds (``holds``). The ranks then
exchange their verdicts (and a digest of their manifest, so that members given different
manifests are caught) in one small all-reduce, and if any rank refused, every member
raises the same one line naming the rank, the worker and the tensor
(:class:`ManifestMismatch`, :class:`StaleVersion`, or :class:`BroadcastRefused` for any
other error of a member's check): no member is left waiting in a broadcast its peers
never join, and the group stays usable. (A member lost mid-broadcast fails the others
after the group's timeout, as any collective of the group does.)
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import astuple, dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from digenrl.checks import fail, finite, is_int, require
from digenrl.serving.wire import ALIGN, TORCH_DTYPES
from digenrl.tasks.collective import CollectiveError, Group
from digenrl.tasks.types import travels

__all__ = ["Manifest", "TensorSpec", "send", "receive", "BroadcastRefused",
           "ManifestMismatch", "StaleVersion", "BUCKET_MB", "MIB"]

#: The default bucket size, in MiB.
BUCKET_MB = 512.0
MIB = 1 << 20
_DTYPE_NAMES = {d: name for name, d in TORCH_DTYPES.items()}

#: Bytes of a rank's row in the exchange of verdicts: its kind of refusal, its message
#: (cut to fit) and its manifest's digest.
_MESSAGE_BYTES = 480
_DIGEST_BYTES = 16
_ROW = 1 + _MESSAGE_BYTES + _DIGEST_BYTES
_OK, _MISMATCH, _STALE, _OTHER = 0, 1, 2, 3


class BroadcastRefused(CollectiveError):
    """A member refused the broadcast before any bucket moved; every member raises it."""


class ManifestMismatch(BroadcastRefused):
    """The manifest does not match a member's tensors (a name missing, another shape or
    dtype), or the members were given different manifests."""


class StaleVersion(BroadcastRefused):
    """The manifest's version is older than the one a receiver holds."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a :class:`Manifest`: where its bytes lie in which bucket."""

    name: str
    shape: tuple[int, ...]
    #: The dtype's name as the wire format spells it (``"float32"``, ``"bfloat16"``).
    dtype: str
    bucket: int
    #: Its first byte in the bucket (a multiple of ``wire.ALIGN``).
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * TORCH_DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Manifest:
    """What travels through Dask for a broadcast version: its number and its tensors'
    layout in buckets (:meth:`of`)."""

    version: int
    tensors: tuple[TensorSpec, ...]
    #: Each bucket's length in bytes.
    buckets: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """The bytes of the tensors (without the alignment between them)."""
        return sum(t.nbytes for t in self.tensors)

    @classmethod
    def of(cls, version: int, state_dict: Mapping[str, torch.Tensor],
           bucket_mb: float = BUCKET_MB) -> "Manifest":
        """The manifest of ``state_dict`` as version ``version``, in buckets of at most
        ``bucket_mb`` MiB (one tensor larger than that: a bucket of its own)."""
        require(is_int(version) and version >= 0, "version", "an integer >= 0", version)
        finite(bucket_mb, "bucket_mb", 0.0, lo_open=True)
        limit = max(int(bucket_mb * MIB), ALIGN)
        require(isinstance(state_dict, Mapping), "state_dict",
                "a mapping of names to tensors", type(state_dict).__name__,
                ManifestMismatch)
        specs: list[TensorSpec] = []
        buckets: list[int] = []
        end = 0   # (where the last bucket's bytes end)
        for name, t in state_dict.items():
            _check_tensor(name, t)
            size = t.numel() * t.element_size()
            offset = -(-end // ALIGN) * ALIGN
            if not buckets or (size and offset + size > limit and end > 0):
                buckets.append(0)
                offset = 0
            end = offset + size
            buckets[-1] = end
            specs.append(TensorSpec(str(name), tuple(t.shape), _DTYPE_NAMES[t.dtype],
                                    len(buckets) - 1, offset))
        return cls(int(version), tuple(specs), tuple(buckets))

    def digest(self) -> bytes:
        """A fingerprint of this manifest, the same on every member given it."""
        text = repr((self.version, self.buckets, [astuple(t) for t in self.tensors]))
        return hashlib.blake2b(text.encode(), digest_size=_DIGEST_BYTES).digest()


#: The error every member raises for a rank's kind of refusal.
_REFUSALS: dict[int, type[BroadcastRefused]] = {
    _MISMATCH: ManifestMismatch, _STALE: StaleVersion, _OTHER: BroadcastRefused}

travels(Manifest, TensorSpec)  # (plain data: no tensor, a header only)


# ------------------------------------------------------------------------------ send


def send(group: Group, state_dict: Mapping[str, torch.Tensor], manifest: Manifest) -> None:
    """Broadcast ``state_dict`` (laid out by ``manifest``) from this member, rank 0 of
    ``group``, to every other member, which calls :func:`receive` with the same
    manifest. Raises :class:`BroadcastRefused` (on every member) when any member refuses
    it."""
    def check() -> None:
        _require_rank(group, sender=True)
        held = _check_manifest(manifest)
        require(isinstance(state_dict, Mapping), "state_dict",
                "a mapping of names to tensors", type(state_dict).__name__,
                ManifestMismatch)
        extra = [n for n in state_dict if n not in {s.name for s in manifest.tensors}]
        require(not extra, "state_dict", f"only the tensors manifest version "
                f"{manifest.version} names", f"also {extra[:3]}", ManifestMismatch)
        _check_targets(held, state_dict)

    _agree(group, manifest, check)
    device = group.device
    buffers = [torch.empty(0, dtype=torch.uint8, device=device)] * 2
    works: list = [None, None]
    by_bucket = _by_bucket(manifest)
    for k, size in enumerate(manifest.buckets):
        slot = k % 2
        if works[slot] is not None:
            works[slot].wait()   # the buffer's last bucket has left
        if buffers[slot].numel() < size:
            buffers[slot] = torch.empty(size, dtype=torch.uint8, device=device)
        buf = buffers[slot][:size]
        for spec in by_bucket[k]:
            if spec.nbytes:
                buf[spec.offset:spec.offset + spec.nbytes].copy_(_bytes(state_dict[spec.name]))
        works[slot] = dist.broadcast(buf, src=0, group=group.process_group, async_op=True)
    for work in works:
        if work is not None:
            work.wait()


# --------------------------------------------------------------------------- receive


def receive(group: Group, manifest: Manifest,
            into: torch.nn.Module | Mapping[str, torch.Tensor] | None = None, *,
            holds: int | None = None) -> dict[str, torch.Tensor]:
    """Receive the version ``manifest`` describes from rank 0 of ``group`` (this member
    being another rank), bucket by bucket: into the tensors of ``into`` in place (a
    module's parameters and buffers, or a dict of tensors, by name), or into new tensors
    on the group's device when ``into`` is None (views of the buckets they arrived in). ``holds``: the version this member
    holds now, if any; an older manifest is refused (:class:`StaleVersion`). Returns the
    tensors written, by name. Raises :class:`BroadcastRefused` (on every member) when any
    member refuses the broadcast."""
    device = group.device
    targets: dict[str, torch.Tensor] = {}

    def check() -> None:
        _require_rank(group, sender=False)
        held = _check_manifest(manifest)
        if holds is not None and manifest.version < holds:
            raise StaleVersion(f"manifest version {manifest.version} is older than version "
                               f"{holds}, which worker {group.members[group.rank]!r} "
                               f"holds")
        if into is None:
            return
        tensors = _tensors_of(into)
        _check_targets(held, tensors)
        targets.update({s.name: tensors[s.name] for s in held})

    _agree(group, manifest, check)
    buffers = [torch.empty(0, dtype=torch.uint8, device=device)] * 2
    by_bucket = _by_bucket(manifest)

    def post(k: int):
        size = manifest.buckets[k]
        if into is None:   # each bucket its own memory: the new tensors are views of it
            buf = torch.empty(size, dtype=torch.uint8, device=device)
        else:
            slot = k % 2
            if buffers[slot].numel() < size:
                buffers[slot] = torch.empty(size, dtype=torch.uint8, device=device)
            buf = buffers[slot][:size]
        return buf, dist.broadcast(buf, src=0, group=group.process_group, async_op=True)

    pending = post(0) if manifest.buckets else None
    with torch.no_grad():
        for k in range(len(manifest.buckets)):
            assert pending is not None
            buf, work = pending
            work.wait()
            # The next bucket lands in the other buffer while this one is unpacked.
            pending = post(k + 1) if k + 1 < len(manifest.buckets) else None
            for spec in by_bucket[k]:
                view = buf[spec.offset:spec.offset + spec.nbytes] \
                    .view(TORCH_DTYPES[spec.dtype]).view(spec.shape)
                if into is None:
                    targets[spec.name] = view
                elif spec.nbytes:
                    targets[spec.name].copy_(view)
    return targets


# ---------------------------------------------------------------------------- checks


def _agree(group: Group, manifest: Manifest, check) -> None:
    """Run ``check()`` on this member, exchange every member's verdict and manifest
    digest in one all-reduce, and raise the first refusal on every member."""
    kind, message = _OK, ""
    try:
        check()
    except StaleVersion as e:
        kind, message = _STALE, str(e)
    except (ManifestMismatch, ValueError) as e:   # (ConfigError is a ValueError)
        kind, message = _MISMATCH, str(e)
    except Exception as e:   # (refused with the others rather than leave them waiting)
        kind, message = _OTHER, f"{type(e).__name__}: {e}".splitlines()[0]
    digest = manifest.digest() if isinstance(manifest, Manifest) else bytes(_DIGEST_BYTES)
    mine = bytes([kind]) + message.encode()[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0") \
        + digest
    row = torch.zeros(group.size, _ROW, dtype=torch.uint8)
    row[group.rank] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    verdicts = row.to(group.device)
    dist.all_reduce(verdicts, group=group.process_group)   # one row per rank: a sum
    verdicts = verdicts.cpu()
    what = f"broadcast of version {getattr(manifest, 'version', '?')} over " \
           f"collective group {group.name!r}"
    for r in range(group.size):
        if verdicts[r, 0].item() != _OK:
            said = bytes(verdicts[r, 1:1 + _MESSAGE_BYTES].tolist()).rstrip(b"\0")
            cls = _REFUSALS[int(verdicts[r, 0].item())]
            raise cls(f"{what}: rank {r} ({group.members[r]!r}) refused it: "
                      f"{said.decode(errors='replace')}")
    digests = {bytes(verdicts[r, 1 + _MESSAGE_BYTES:].tolist()) for r in range(group.size)}
    if len(digests) > 1:
        raise ManifestMismatch(f"{what}: the members were given different manifests "
                               f"(every member calls with the same one)")


def _require_rank(group: Group, sender: bool) -> None:
    if sender:
        require(group.rank == 0, "send", "to be called on rank 0 of the group",
                f"rank {group.rank}", ManifestMismatch)
    else:
        require(group.rank != 0, "receive", "to be called on a rank other than 0 (rank 0 "
                "sends)", "rank 0", ManifestMismatch)


def _check_manifest(manifest: Manifest) -> tuple[TensorSpec, ...]:
    require(isinstance(manifest, Manifest), "manifest", "a Manifest",
            type(manifest).__name__, ManifestMismatch)
    for s in manifest.tensors:
        fits = (0 <= s.bucket < len(manifest.buckets) and s.offset % ALIGN == 0
                and s.dtype in TORCH_DTYPES
                and s.offset + s.nbytes <= manifest.buckets[s.bucket])
        require(fits, f"manifest tensor {s.name!r}", "a place inside its bucket",
                f"bucket {s.bucket}, offset {s.offset}, {s.dtype} {list(s.shape)}",
                ManifestMismatch)
    return manifest.tensors


def _check_tensor(name: object, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        fail(f"tensor {name!r}", "a tensor", type(t).__name__, ManifestMismatch)
    require(t.layout is torch.strided and not t.is_meta, f"tensor {name!r}",
            "a dense tensor with its data", f"a {t.layout} tensor on {t.device}",
            ManifestMismatch)
    require(t.dtype in _DTYPE_NAMES, f"tensor {name!r}",
            f"a dtype of {sorted(TORCH_DTYPES)}", t.dtype, ManifestMismatch)
    return t


def _check_targets(specs: tuple[TensorSpec, ...], tensors: Mapping[str, torch.Tensor]) -> None:
    """Every tensor of ``specs`` is in ``tensors`` with its shape and dtype."""
    for s in specs:
        require(s.name in tensors, f"tensor {s.name!r}", "a tensor of that name (the "
                "manifest names it)", None, ManifestMismatch)
        t = _check_tensor(s.name, tensors[s.name])
        require(tuple(t.shape) == s.shape and _DTYPE_NAMES[t.dtype] == s.dtype,
                f"tensor {s.name!r}", f"{s.dtype} {list(s.shape)} (the manifest's)",
                f"{_DTYPE_NAMES[t.dtype]} {list(t.shape)}", ManifestMismatch)


def _tensors_of(into: torch.nn.Module | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    if isinstance(into, torch.nn.Module):
        return {**dict(into.named_buffers()), **dict(into.named_parameters())}
    require(isinstance(into, Mapping), "into", "a module, a mapping of names to tensors "
            "or None", type(into).__name__, ManifestMismatch)
    return into


def _by_bucket(manifest: Manifest) -> list[list[TensorSpec]]:
    out: list[list[TensorSpec]] = [[] for _ in manifest.buckets]
    for s in manifest.tensors:
        out[s.bucket].append(s)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor (a view where ``t`` is contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)

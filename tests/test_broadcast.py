"""A version's weights by collective broadcast (digenrl.tasks.broadcast) on a real local
cluster: one trainer and the two rollout workers of ``cluster_2x2`` join one gloo group
from tasks pinned to them, the trainer sends, the rollout workers receive."""

from __future__ import annotations

import pytest
import torch
from distributed import wait

from digenrl.checks import ConfigError
from digenrl.config import ModelConfig
from digenrl.models.lora import Trainable, build_policy
from digenrl.run.cluster import pool_counts
from digenrl.serving import wire
from digenrl.tasks import broadcast, collective
from digenrl.tasks.broadcast import Manifest
from digenrl.tasks.types import PolicyWeights
from digenrl.vocabulary import ROLLOUT, TRAINER
from tests.test_collective import BOUND, TIMEOUT, group_name, on_each

#: A bucket size that cuts the built-in model's 18.6 MB into five buckets.
BUCKET_MB = 4.0
#: A bucket size that cuts :func:`_mixed`'s tensors into three buckets.
MIXED_MB = 0.25


# ------------------------------------------------------------------ tasks (on workers)


def _model(seed: int) -> torch.nn.Module:
    """The built-in tiny model's transformer with seed ``seed``'s weights."""
    return build_policy(ModelConfig(), Trainable(), seed)


def _state(seed: int) -> dict[str, torch.Tensor]:
    return {n: t.detach() for n, t in _model(seed).state_dict().items()}


def _mixed(seed: int) -> dict[str, torch.Tensor]:
    """A few MB of tensors of several dtypes and shapes (a scalar, an empty tensor, one
    larger than a bucket of :data:`MIXED_MB`)."""
    g = torch.Generator().manual_seed(seed)
    return {"half": torch.randn(64, 1000, generator=g).to(torch.bfloat16),
            "scalar": torch.randn((), generator=g, dtype=torch.float64),
            "empty": torch.empty(0, 7),
            "ids": torch.randint(-9, 9, (5000, 3), generator=g),
            "big": torch.randn(300_000, generator=g),
            "mask": torch.rand(333, generator=g) > 0.5,
            "strided": torch.randn(200, 300, generator=g).t()}


def _join(name, members, subgroups=None):
    collective.join(name, members, 1, backend="auto", timeout=TIMEOUT, subgroups=subgroups)


def _send(name, seed, manifest, mixed=False, rename=None):
    state = _mixed(seed) if mixed else _state(seed)
    if rename:
        state[rename[1]] = state.pop(rename[0])
    broadcast.send(collective.group(name, 1), state, manifest)
    return PolicyWeights(manifest.version, state)   # (what travels back as Dask data)


def _receive_in_place(name, manifest, seed, holds=None, reshape=None):
    """Receive into a module built with ``seed`` (``reshape``: a parameter of another
    shape): its tensors after, and whether each one kept its storage."""
    module = _model(seed)
    if reshape is not None:
        p = dict(module.named_parameters())[reshape]
        p.data = torch.zeros(p.shape[0] + 1, *p.shape[1:])
    before = {n: t.data_ptr() for n, t in module.state_dict().items()}
    got = broadcast.receive(collective.group(name, 1), manifest, into=module, holds=holds)
    state = module.state_dict()
    in_place = all(state[n].data_ptr() == before[n] for n in got)
    return {n: t.detach().clone() for n, t in state.items()}, in_place, set(got)


def _receive_new(name, manifest):
    return PolicyWeights(manifest.version,
                         broadcast.receive(collective.group(name, 1), manifest))


def _leave():
    return collective.leave()


# ---------------------------------------------------------------------------- helpers


@pytest.fixture
def members(cluster_2x2):
    """(client, [a trainer, both rollout workers], name -> address); the group is left
    afterwards on each."""
    client = cluster_2x2.client
    pools = pool_counts(client)
    names = [sorted(pools[TRAINER])[0], *sorted(pools[ROLLOUT])]
    workers = client.scheduler_info(n_workers=-1)["workers"]
    addresses = {str(w["name"]): a for a, w in workers.items()}
    yield client, names, addresses
    if client.status == "running":
        on_each(client, addresses, names, _leave)


def pinned(client, addresses, name, fn, *args, **kwargs):
    return client.submit(fn, *args, workers=[addresses[name]], allow_other_workers=False,
                         pure=False, **kwargs)


def refusals(futures) -> list[BaseException]:
    """The exceptions of tasks that must each fail by themselves (within BOUND: well
    inside the group's timeout, so not by it)."""
    wait(futures, timeout=BOUND)
    assert [f.status for f in futures] == ["error"] * len(futures)
    return [f.exception() for f in futures]


# ------------------------------------------------------------------------------ tests


def test_a_manifest_lays_tensors_out_in_aligned_buckets():
    state = _mixed(0)
    m = Manifest.of(3, state, bucket_mb=MIXED_MB)
    assert [s.name for s in m.tensors] == list(state)
    assert len(m.buckets) >= 3
    for s in m.tensors:
        t = state[s.name]
        assert (s.shape, s.dtype) == (tuple(t.shape), str(t.dtype).removeprefix("torch."))
        assert s.offset % wire.ALIGN == 0 and s.offset + s.nbytes <= m.buckets[s.bucket]
    # The tensor larger than a bucket is one of its own; the others share theirs.
    big = next(s for s in m.tensors if s.name == "big")
    assert m.buckets[big.bucket] == big.nbytes > MIXED_MB * broadcast.MIB
    assert len(m.buckets) < len(m.tensors)
    assert m.nbytes == sum(t.numel() * t.element_size() for t in state.values())
    # It travels through Dask as plain data: a header, no frame.
    header, frames = wire.encode(m)
    assert frames == [] and wire.decode(header, frames, Manifest) == m
    with pytest.raises(ConfigError, match=r"^bucket_mb: expected a finite number > 0"):
        Manifest.of(3, state, bucket_mb=0)


def test_every_receiver_gets_the_senders_bytes_in_place_and_as_new_tensors(members):
    """The built-in model's state dict in five buckets into each rollout worker's module
    (other weights before, the same storages after, equal bit for bit), then a state dict
    of mixed dtypes in buckets of 0.25 MiB into new tensors."""
    client, names, addresses = members
    name = group_name()
    on_each(client, addresses, names, _join, name, names)
    manifest = Manifest.of(1, _state(1), bucket_mb=BUCKET_MB)
    assert len(manifest.buckets) >= 3
    sent = pinned(client, addresses, names[0], _send, name, 1, manifest)
    received = [pinned(client, addresses, n, _receive_in_place, name, manifest, 0, holds=0)
                for n in names[1:]]
    sent = sent.result(timeout=BOUND).tensors
    before = _state(0)
    assert any(not torch.equal(before[n], t) for n, t in sent.items())
    for future in received:
        state, in_place, written = future.result(timeout=BOUND)
        assert in_place and written == set(sent)
        assert state.keys() == sent.keys()
        for n, t in sent.items():
            assert state[n].dtype == t.dtype and torch.equal(state[n], t), n

    mixed = Manifest.of(2, _mixed(5), bucket_mb=MIXED_MB)
    assert len(mixed.buckets) >= 3
    sent = pinned(client, addresses, names[0], _send, name, 5, mixed, mixed=True)
    received = [pinned(client, addresses, n, _receive_new, name, mixed) for n in names[1:]]
    sent = sent.result(timeout=BOUND).tensors
    for future in received:
        got = future.result(timeout=BOUND).tensors
        assert got.keys() == sent.keys()
        for n, t in sent.items():
            assert got[n].dtype == t.dtype and got[n].shape == t.shape
            assert torch.equal(got[n], t), n


def test_a_refusal_on_one_member_fails_every_member_in_one_line(members):
    """A receiver whose module has a tensor of another shape, a receiver holding a newer
    version, and a sender whose state dict lacks a tensor: every member raises the same
    line naming the rank, the worker and the tensor (none waits for the group's timeout),
    and the group still carries a broadcast afterwards."""
    client, names, addresses = members
    name = group_name()
    on_each(client, addresses, names, _join, name, names)
    manifest = Manifest.of(4, _state(1), bucket_mb=BUCKET_MB)
    wrong = "proj_out.weight"
    assert wrong in {s.name for s in manifest.tensors}

    futures = [pinned(client, addresses, names[0], _send, name, 1, manifest),
               pinned(client, addresses, names[1], _receive_in_place, name, manifest, 0),
               pinned(client, addresses, names[2], _receive_in_place, name, manifest, 0,
                      reshape=wrong)]
    errors = refusals(futures)
    assert all(type(e) is broadcast.ManifestMismatch for e in errors), errors
    assert len({str(e) for e in errors}) == 1 and "\n" not in str(errors[0])
    assert str(errors[0]).startswith(
        f"broadcast of version 4 over collective group {name!r}: rank 2 ({names[2]!r}) "
        f"refused it: tensor {wrong!r}: expected float32 [")

    futures = [pinned(client, addresses, names[0], _send, name, 1, manifest),
               pinned(client, addresses, names[1], _receive_in_place, name, manifest, 0,
                      holds=5),
               pinned(client, addresses, names[2], _receive_in_place, name, manifest, 0)]
    errors = refusals(futures)
    assert all(type(e) is broadcast.StaleVersion for e in errors), errors
    assert str(errors[2]) == str(errors[0]) and (
        f"rank 1 ({names[1]!r}) refused it: manifest version 4 is older than version 5"
        in str(errors[0]))

    futures = [pinned(client, addresses, names[0], _send, name, 1, manifest,
                      rename=(wrong, "renamed")),
               pinned(client, addresses, names[1], _receive_new, name, manifest),
               pinned(client, addresses, names[2], _receive_new, name, manifest)]
    errors = refusals(futures)
    assert len({str(e) for e in errors}) == 1
    assert f"rank 0 ({names[0]!r}) refused it: state_dict: expected only the tensors" \
        in str(errors[0])

    # The refusals left the group usable.
    sent = pinned(client, addresses, names[0], _send, name, 1, manifest)
    got = [pinned(client, addresses, n, _receive_new, name, manifest) for n in names[1:]]
    sent = sent.result(timeout=BOUND).tensors
    assert all(torch.equal(f.result(timeout=BOUND).tensors[wrong], sent[wrong])
               for f in got)

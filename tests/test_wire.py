"""Task results on the wire (digenrl/tasks/wire.py): every type that travels between
workers goes through Dask's "dask" serializer as plain data plus one frame per tensor or
array, comes back bit for bit, and a header naming anything else is refused."""

from __future__ import annotations

import hashlib
import logging
import warnings
from dataclasses import fields, is_dataclass, replace

import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster
from distributed.protocol import deserialize, dumps, loads, serialize, to_serialize

from digenrl.config import config_from_dict
from digenrl.graph.build import GraphContext
from digenrl.models import Conditioning, to_uint8
from digenrl.tasks import rollout, train, wire
from digenrl.tasks.advantage import advantage
from digenrl.tasks.types import (TRAVELLING, DecodeOut, GradOut, IterationStats, MicroStats,
                                 PolicyWeights, RewardOut)

PROMPTS = ("a cat", "a dog")
IDS = (4, 5)


@pytest.fixture(scope="module")
def examples() -> dict[str, object]:
    """One of each travelling type, built by the tasks that return it where that is
    cheap (a tiny model), by hand as the tasks build it where not."""
    ctx = GraphContext.from_config(config_from_dict({
        "model": {"transformer_layers": 2, "image_size": 32},
        "sampler": {"guidance_scale": 3.0},  # a negative prompt's conditioning too
        "data": {"prompts_per_iteration": 1, "samples_per_prompt": 2},
        "rollout": {"chunk_size": 2}}))
    state = train.init_state(ctx.train)
    weights = train.publish(state)
    latents = rollout.encoded_noise(ctx.rollout, 0, IDS, PROMPTS)
    step = rollout.denoise(ctx.rollout, weights, PROMPTS, 0, 0, latents)
    assert latents.cond.negative is not None
    pixels = torch.linspace(-1, 1, 2 * 3 * 8 * 8).reshape(2, 3, 8, 8)
    decoded = DecodeOut(IDS, to_uint8(pixels), np.full((2, 8), -0.25, np.float32), 3,
                        latents=torch.stack([latents.x, step.latent], dim=1).numpy())
    rewards = RewardOut(IDS, np.array([0.5, np.nan]), {"aesthetic": np.array([0.5, np.nan])},
                        np.array([True, False]), problems=["sample 5: no face found"])
    g = torch.Generator().manual_seed(1)
    parts = [GradOut({n: torch.randn(p.shape, generator=g) for n, p in weights.tensors.items()},
                     MicroStats(count=2, loss_sum=-0.1 * i, ratio_dev=1e-3 * i,
                                ratio_dev_count=2, staleness_sum=i))
             for i in range(3)]
    reduced = train.reduce(*parts)
    bf16 = Conditioning(PROMPTS, latents.cond.tensors).to_dtype(torch.bfloat16)
    return {
        "PolicyWeights": weights,
        "TrainerState": state.state,
        "OptimizeOut": state,
        "Latents": latents,
        "Latents without conditioning": replace(latents, cond=None),
        "StepOut": step,
        "StepOut in float16": replace(step, latent=step.latent.half(),
                                      cond=latents.cond.to_dtype(torch.float16)),
        "DecodeOut": decoded,
        "DecodeOut without latents": replace(decoded, latents=None),
        "DecodeOut of an evaluation": replace(decoded, log_probs=np.zeros((2, 0), np.float32),
                                              latents=None),
        "RewardOut": rewards,
        "AdvantageOut": advantage(0, IDS, "group", 5.0, rewards),
        "GradOut": reduced,
        "MicroStats": reduced.stats,
        "IterationStats": IterationStats(2, 3, reduced.stats, 0.75, weights.nbytes),
        "Conditioning": latents.cond,
        "Conditioning in bfloat16 without a negative prompt": bf16,
        "PolicyWeights of every dtype and shape": mixed_weights(7),
    }


def mixed_weights(seed: int) -> PolicyWeights:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 5, generator=g)
    return PolicyWeights(seed, {
        "float32": x, "bfloat16": x.bfloat16(), "float16": x.half(),
        "int64": torch.randint(-2**40, 2**40, (7,), generator=g),
        "bool": x > 0, "scalar": torch.tensor(2.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 3, dtype=torch.float16), "strided": x.t()[1:4],
        "nan": torch.tensor([float("nan"), -0.0, float("inf")])})


def assert_bit_identical(got, want, where="value") -> None:
    assert type(got) is type(want), (where, type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert torch.equal(_bits(got), _bits(want)), where
    elif isinstance(want, np.ndarray):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert got.tobytes() == want.tobytes(), where
    elif is_dataclass(want):
        for f in fields(want):
            assert_bit_identical(getattr(got, f.name), getattr(want, f.name),
                                 f"{where}.{f.name}")
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_bit_identical(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_bit_identical(a, b, f"{where}[{i}]")
    else:
        assert got == want, where


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_every_travelling_type_has_an_example(examples):
    names = {type(v).__name__ for v in examples.values()}
    assert names >= {cls.__name__ for cls in TRAVELLING} | {"OptimizeOut"}


@pytest.mark.parametrize("writable", [True, False], ids=["bytearray", "bytes"])
def test_every_travelling_type_round_trips_bit_exact(examples, writable):
    """Through Dask's own message framing (the header packed with MessagePack) and
    frames received as fresh buffers, writable or not, without a warning."""
    for name, value in examples.items():
        frames = [bytearray(f) if writable else bytes(f)
                  for f in dumps({"data": to_serialize(value)})]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = loads(frames)["data"]
        assert_bit_identical(got, value, name)
        if writable and isinstance(value, PolicyWeights):  # a received frame is used as is
            first = next(iter(got.tensors.values()))
            assert any(first.data_ptr() == np.frombuffer(f, np.uint8).ctypes.data
                       for f in frames)


def test_dask_uses_the_dask_serializer_one_frame_per_tensor(examples):
    for name, value in examples.items():
        header, frames = serialize(value)
        assert header["serializer"] == "dask", name
        buffers = []
        _collect_buffers(value, buffers)
        assert len(frames) == len(buffers), name
        assert sum(memoryview(f).nbytes for f in frames) == sum(buffers), name


def _collect_buffers(value, out: list[int]) -> None:
    if isinstance(value, torch.Tensor):
        out.append(value.numel() * value.element_size())
    elif isinstance(value, np.ndarray):
        out.append(value.nbytes)
    elif is_dataclass(value):
        for f in fields(value):
            _collect_buffers(getattr(value, f.name), out)
    elif isinstance(value, dict):
        for v in value.values():
            _collect_buffers(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect_buffers(v, out)


def _tampered(value, change):
    header, frames = serialize(value)
    change(header["sub-header"]["value"])
    return header, frames


@pytest.mark.parametrize("change, message", [
    (lambda v: v.update(type="Evil"),
     r"PolicyWeights: class: expected one of \[.*'PolicyWeights'.*\], got 'Evil'"),
    (lambda v: v.update(type="GradOut"),
     r"PolicyWeights: expected the fields \['grads', 'stats'\] of GradOut, got "
     r"\['sampling_copy', 'tensors', 'version'\]"),
    (lambda v: v["fields"]["tensors"]["dict"]["float32"]["tensor"].update(dtype="object"),
     r"PolicyWeights.tensors\['float32'\]: tensor dtype: expected one of .*, got 'object'"),
    (lambda v: v["fields"]["tensors"]["dict"]["float32"]["tensor"].update(shape=[6, 6]),
     r"PolicyWeights.tensors\['float32'\]: expected 144 bytes for shape \[6, 6\], got a "
     r"frame of 120"),
    (lambda v: v["fields"].update(version={"set": [1]}),
     r"PolicyWeights.version: expected a number, .*got \{'set': \[1\]\}"),
])
def test_a_header_it_did_not_write_is_refused_in_one_line(change, message):
    header, frames = _tampered(mixed_weights(1), change)
    with pytest.raises(ValueError, match="^wire: " + message) as e:
        deserialize(header, frames)
    assert "\n" not in str(e.value)


def test_an_array_header_naming_object_dtype_is_refused():
    header, frames = _tampered(
        RewardOut(IDS, np.zeros(2), {}, np.ones(2, bool)),
        lambda v: v["fields"]["rewards"]["array"].update(dtype="|O"))
    with pytest.raises(ValueError, match=r"RewardOut.rewards: array dtype: expected a "
                                         r"boolean or numeric NumPy dtype, got '\|O'"):
        deserialize(header, frames)


def test_what_cannot_travel_is_refused_naming_the_field():
    off_cpu = PolicyWeights(0, {"w": torch.empty(2, device="meta")})
    with pytest.raises(TypeError, match=r"PolicyWeights.tensors\['w'\]: expected a dense "
                                        r"tensor on the CPU .* on meta"):
        wire.encode(off_cpu)
    odd = RewardOut(IDS, np.zeros(2), {}, np.ones(2, bool), problems={"a set"})
    with pytest.raises(TypeError, match=r"RewardOut.problems: expected .* got set"):
        wire.encode(odd)


# -------------------------------------------------------------- between two workers

def _make(seed: int) -> PolicyWeights:
    return mixed_weights(seed)


def _fingerprint(w: PolicyWeights) -> dict[str, tuple]:
    """What arrived, as dtype, shape and a digest of the bytes (a few bytes back)."""
    return {n: (str(t.dtype), tuple(t.shape), hashlib.sha256(
        _bits(t).numpy().tobytes()).hexdigest()) for n, t in w.tensors.items()}


def test_weights_computed_on_one_worker_arrive_bit_identical_on_another():
    """Two workers talking TCP (in this process, so nothing to start but the sockets):
    a result moves between them as messages on the wire, serialized and read back."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, protocol="tcp://",
                      dashboard_address=":0", silence_logs=logging.WARNING) as cluster, \
            Client(cluster) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        made = client.submit(_make, 11, workers=[a], allow_other_workers=False)
        seen = client.submit(_fingerprint, made, workers=[b], allow_other_workers=False)
        assert seen.result(timeout=60) == _fingerprint(_make(11))
        assert set(client.who_has(made)[made.key]) == {a, b}  # it moved from a to b
        held = client.run(lambda dask_worker: id(dask_worker.data[made.key]))
        assert held[a] != held[b]  # b holds what it read back, not a's object

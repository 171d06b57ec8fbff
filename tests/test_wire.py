"""Task results on the wire (digenrl/serving/wire.py): every type that travels between
workers goes through Dask's "dask" serializer as plain data plus frames (a large tensor or
array in a frame of its own, the small ones sharing one), comes back bit for bit, and a
header naming anything else is refused."""

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
from digenrl.serving import wire
from digenrl.tasks import rollout, train
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
        "PolicyWeights with tensors too large to share a frame": large_weights(3),
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


def large_weights(seed: int) -> PolicyWeights:
    """Weights with tensors above the size that shares a frame (one of them not
    contiguous) and at it, between small ones."""
    g = torch.Generator().manual_seed(seed)
    floats = wire.PACKED_BYTES // 4
    big = torch.randn(floats + 1, generator=g)
    return PolicyWeights(seed, {
        "small": torch.randn(3, 5, generator=g), "large": big,
        "at the limit": torch.randn(floats, generator=g),
        "large bfloat16": torch.randn(3, floats, generator=g).bfloat16(),
        "large, strided": torch.randn(2, floats, generator=g).t(),
        "last": torch.arange(7)})


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


def _received_at(frame, offset: int) -> memoryview:
    """``frame``'s bytes in writable memory starting ``offset`` bytes past a 64-byte
    boundary, as a socket may fill a frame Dask reads inside a larger buffer."""
    n = memoryview(frame).nbytes
    block = torch.empty(n + 128, dtype=torch.uint8).numpy()
    start = -block.ctypes.data % 64 + offset
    block[start:start + n] = np.frombuffer(frame, np.uint8)
    return memoryview(block[start:start + n])


@pytest.mark.parametrize("received", ["aligned", "4 bytes past", "16 bytes past", "bytes"])
def test_every_travelling_type_round_trips_bit_exact(examples, received):
    """Through Dask's own message framing (the header packed with MessagePack) and
    frames received as fresh buffers, writable or not, on a 64-byte boundary or off it,
    without a warning; every tensor read back lies on a 64-byte boundary, as torch puts
    a tensor it makes, in the received frame where that frame lies on one."""
    offset = {"aligned": 0, "4 bytes past": 4, "16 bytes past": 16}.get(received)
    for name, value in examples.items():
        frames = [bytes(f) if offset is None else _received_at(f, offset)
                  for f in dumps({"data": to_serialize(value)})]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = loads(frames)["data"]
        assert_bit_identical(got, value, name)
        if isinstance(value, PolicyWeights):
            spans = [(np.frombuffer(f, np.uint8).ctypes.data, memoryview(f).nbytes)
                     for f in frames]
            for t in got.tensors.values():
                if t.numel():
                    assert t.data_ptr() % wire.ALIGN == 0, name
                    in_frame = any(a <= t.data_ptr() < a + n for a, n in spans)
                    assert in_frame == (offset == 0), name


def test_a_product_of_a_received_tensor_has_the_bits_of_one_made_here():
    """A small matrix product on the CPU can take another path for an input off a
    16-byte boundary, and give other bits: what a worker computes from a received tensor
    must be what it computes from the tensor made where it was sent from."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 8, generator=g), torch.randn(32, 8, generator=g)
    want = torch.nn.functional.linear(x, w)
    for offset in range(0, 64, 4):
        frames = [_received_at(f, offset)
                  for f in dumps({"data": to_serialize(PolicyWeights(0, {"x": x}))})]
        got = loads(frames)["data"].tensors["x"]
        assert torch.equal(torch.nn.functional.linear(got, w), want), offset


def test_large_buffers_travel_as_they_lie_and_small_ones_share_one_frame(examples):
    for name, value in examples.items():
        header, frames = serialize(value)
        assert header["serializer"] == "dask", name
        buffers = []
        _collect_buffers(value, buffers)
        large = [n for n in buffers if n > wire.PACKED_BYTES]
        small = len(large) < len(buffers)
        assert len(frames) == len(large) + small, name
        assert sorted(memoryview(f).nbytes for f in frames[:len(large)]) == sorted(large), name
        if small:  # each small buffer at an aligned offset, after the one before it
            assert sum(buffers) - sum(large) <= memoryview(frames[-1]).nbytes < \
                sum(buffers) - sum(large) + wire.ALIGN * len(buffers), name
    weights = large_weights(3)
    _, frames = serialize(weights)
    # A large contiguous tensor's frame is its memory; a strided one's, a copy.
    pointers = {np.frombuffer(f, np.uint8).ctypes.data for f in frames}
    assert weights.tensors["large"].data_ptr() in pointers
    assert weights.tensors["large, strided"].data_ptr() not in pointers


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
     r"\['held', 'sampling_copy', 'store', 'tensors', 'version'\]"),
    (lambda v: v["fields"]["tensors"]["dict"]["float32"]["tensor"].update(dtype="object"),
     r"PolicyWeights.tensors\['float32'\]: tensor dtype: expected one of .*, got 'object'"),
    (lambda v: v["fields"]["tensors"]["dict"]["float32"]["tensor"].update(shape=[60, 6]),
     r"PolicyWeights.tensors\['float32'\]: expected 1440 bytes for shape \[60, 6\] at "
     r"offset 0, got a shared frame of \d+"),
    (lambda v: v["fields"]["tensors"]["dict"]["bool"]["tensor"].update(packed=-64),
     r"PolicyWeights.tensors\['bool'\]: expected an offset in the shared frame \(a "
     r"multiple of 64\), got -64"),
    (lambda v: v["fields"]["tensors"]["dict"]["bool"]["tensor"].update(packed=True),
     r"PolicyWeights.tensors\['bool'\]: expected an offset in the shared frame \(a "
     r"multiple of 64\), got True"),
    (lambda v: v["fields"]["tensors"]["dict"]["bool"]["tensor"].update(packed=8),
     r"PolicyWeights.tensors\['bool'\]: expected an offset in the shared frame \(a "
     r"multiple of 64\), got 8"),
    (lambda v: v["fields"].update(version={"set": [1]}),
     r"PolicyWeights.version: expected a number, .*got \{'set': \[1\]\}"),
])
def test_a_header_it_did_not_write_is_refused_in_one_line(change, message):
    header, frames = _tampered(mixed_weights(1), change)
    with pytest.raises(ValueError, match="^wire: " + message) as e:
        deserialize(header, frames)
    assert "\n" not in str(e.value)


def test_a_large_buffers_frame_of_the_wrong_size_or_index_is_refused_in_one_line():
    header, frames = serialize(large_weights(1))
    tensors = header["sub-header"]["value"]["fields"]["tensors"]["dict"]
    tensors["large"]["tensor"]["shape"] = [7]
    with pytest.raises(ValueError, match=r"^wire: PolicyWeights.tensors\['large'\]: "
                                         r"expected 28 bytes for shape \[7\], got a frame "
                                         rf"of {4 * (wire.PACKED_BYTES // 4 + 1)}$"):
        deserialize(header, frames)
    header, frames = serialize(large_weights(1))
    header["sub-header"]["value"]["fields"]["tensors"]["dict"]["large"]["tensor"]["frame"] = 9
    with pytest.raises(ValueError, match=r"^wire: PolicyWeights.tensors\['large'\]: "
                                         rf"expected a frame index below {len(frames)}, "
                                         r"got 9$"):
        deserialize(header, frames)


def test_a_header_without_its_shared_frame_is_refused():
    header, frames = serialize(mixed_weights(1))
    header["sub-header"]["shared"] = 3
    with pytest.raises(ValueError, match=r"^wire: PolicyWeights: expected the shared "
                                         r"frame's index below 1, got 3$"):
        deserialize(header, frames)
    del header["sub-header"]["shared"]
    with pytest.raises(ValueError, match=r"expected an offset in the shared frame \(a "
                                         r"multiple of 64\), got 0 \(shared frame: None\)"):
        deserialize(header, frames)


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

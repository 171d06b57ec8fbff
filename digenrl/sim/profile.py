"""Cost profiles: what each task costs on a GPU, as data files with their sources.

A profile describes a published-setup-like workload (model, algorithm, steps, batch, pools)
and the seconds each kind of task takes on a speed-1 GPU, plus weight-synchronisation
bytes, network bandwidth, and the phase-switch costs the co-located design pays. Its
``algorithm`` (``flow_grpo`` unless named) shapes the graph as it does a run's: a
decoupled algorithm's ``trained_steps`` are the micro-steps of a chunk (noise levels
drawn afresh), its ``denoise`` steps are ODE steps, and a micro-step reads only the
chunk's final latent. A ``costs.group_reward_per_sample`` above 0 (none by default) adds
a reward that scores whole prompt groups: a ``group_reward`` task per group, after its
chunks' rewards, on the GPU like the rewards (``reward_on``). A ``model`` section
(:mod:`digenrl.sim.memory`) gives the model's size, whether training shards it with FSDP
(whose collectives :mod:`digenrl.sim.costs` then charges) and the GPUs' memory, which
each role must fit in. The emulator
(real Dask, tasks that sleep) and the simulator (discrete events) read the same profile
through :meth:`Profile.task_seconds`, so they model the same work.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from digenrl.algorithms import ALGORITHMS, DEFAULT_ALGORITHM, Algorithm
from digenrl.figures.analysis import ideal_bound
from digenrl.checks import require
from digenrl.config import AUTO
from digenrl.graph.plan import IterationPlan
from digenrl.graph.structure import GraphLayout
from digenrl.schedulers.parallelism import CP_EFFICIENCY, DEGREES
from digenrl.sim.memory import Model, MemoryPerGpu
from digenrl.vocabulary import (DECODE, DENOISE, ENCODE, GRAD, GROUP_REWARD, OPTIMIZE, REWARD,
                                ROLLOUT,
                                TRAINER)

__all__ = ["Profile", "ProfileError", "Slowdown", "load_profile", "list_profiles", "PROFILE_DIR",
           "slowdown_at"]

PROFILE_DIR = resources.files("digenrl.sim") / "profiles"


class ProfileError(ValueError):
    pass


def _need(cond: Any, path: str, expected: str, got: Any) -> None:
    """A profile's check (:func:`digenrl.checks.require`), raising :class:`ProfileError`."""
    require(cond, path, expected, got, ProfileError)


def _pos(v: Any, path: str, zero_ok: bool = False) -> float:
    if isinstance(v, str):  # YAML 1.1 reads 24.0e9 (no exponent sign) as a string
        try:
            v = float(v)
        except ValueError:
            pass
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (v >= 0 if zero_ok else v > 0)
    _need(ok, path, "a number >= 0" if zero_ok else "a number > 0", v)
    return float(v)


@dataclass(frozen=True)
class Costs:
    """Seconds on a speed-1 GPU, and bytes."""

    denoise_per_sample: float          # one transformer forward of one sample at one step
    cfg_factor: float = 1.0            # 2.0 when classifier-free guidance doubles the batch
    train_factor: float = 3.0          # a micro-step over a forward (forward + backward,
                                       # recomputation, a decoupled algorithm's other
                                       # policies' forwards)
    decode_per_sample: float = 0.05
    reward_per_sample: float = 0.02
    reward_on: str = "gpu"             # gpu: a GPU slot on a rollout worker; remote: none
    group_reward_per_sample: float = 0.0  # > 0: a reward scoring whole prompt groups, a
                                          # group_reward task per group (where reward_on)
    optimizer_step: float = 1.0
    weight_bytes: float = 0.0          # synchronised to each rollout worker per version
    grad_bytes: float = 0.0            # all-reduced among trainers once per iteration
                                       # (both derived from model.params with
                                       # model.sharding fsdp: bf16 weights, fp32
                                       # gradients, reduce-scattered)
    latent_bytes_per_sample: float = 0.0
    #: One prompt group's ``encode`` task: its prompt through the text encoders (a GPU
    #: slot on a rollout worker). 0, the default: encoding is not modelled and the graph
    #: has no ``encode`` tasks (a CLIP/T5 encoder's share is small; a language-model
    #: encoder's is not).
    encode_per_group: float = 0.0
    #: Context parallelism (:mod:`digenrl.sim.costs`, ``context_parallel``): a step at
    #: degree ``d`` computes ``d x cp_efficiency ** log2(d)`` times faster than on one
    #: GPU (by default the prior a run predicts with, 0.9 per doubling: docs/sources.md,
    #: "Context parallelism"), plus Ulysses' all-to-alls over a sample's
    #: ``tokens_per_sample`` x ``hidden_size`` bf16 activations in each of
    #: ``attention_layers`` (0: no all-to-all charged).
    cp_efficiency: float = CP_EFFICIENCY
    tokens_per_sample: float = 0.0
    hidden_size: float = 0.0
    attention_layers: float = 0.0


@dataclass(frozen=True)
class Network:
    bandwidth: float = 50e9            # bytes/s per worker link (400 Gb/s InfiniBand)
    latency: float = 5e-6              # seconds per message
    #: With ``model.sharding: fsdp``: the bucket of the weights' broadcast to the
    #: rollout workers, MiB (the next bucket is filled while one is in flight).
    sync_bucket_mb: float = 512.0


@dataclass(frozen=True)
class ColocatedCosts:
    """What the co-located design pays on top of the same GPU work."""

    phase_switch: float = 0.0          # s per worker each time it switches rollout <-> training
    recompute_old_logprob: bool = True  # one extra forward per trained sample-step


@dataclass(frozen=True)
class Slowdown:
    """``worker`` runs ``factor`` times slower from ``start`` to ``stop`` (seconds of the
    profile's time since the run began): a transient straggler."""

    worker: str
    factor: float
    start: float
    stop: float


def slowdown_at(slowdowns: Iterable[Slowdown], worker: str, now: float) -> float:
    """How many times slower ``worker`` runs at ``now`` under ``slowdowns``."""
    f = 1.0
    for s in slowdowns:
        if s.worker == worker and s.start <= now < s.stop:
            f *= s.factor
    return f


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    sources: tuple[str, ...]
    rollout_workers: int
    trainer_workers: int
    rollout_speed: float
    trainer_speed: float
    prompts_per_iteration: int
    samples_per_prompt: int
    chunk_size: int
    num_steps: int
    trained_steps: int
    costs: Costs
    network: Network = field(default_factory=Network)
    colocated: ColocatedCosts = field(default_factory=ColocatedCosts)
    time_scale: float = 0.1            # the emulator sleeps costs x time_scale
    #: Per-worker speeds by name (``rollout-0``, ``trainer-3``), over the pool speeds.
    worker_speeds: Mapping[str, float] = field(default_factory=dict)
    slowdowns: tuple[Slowdown, ...] = ()
    #: The algorithm whose graph the profile runs (``algorithm.name``).
    algorithm: str = DEFAULT_ALGORITHM
    #: The model's size, how training shards it and the GPUs' memory
    #: (:mod:`digenrl.sim.memory`); unset: no memory model, no sharded collectives.
    model: Model = field(default_factory=Model)
    #: How many rollout workers compute a chunk's denoise steps together (a gang):
    #: 1, a power of two, or ``auto`` (:func:`digenrl.sim.costs.chunk_degrees`).
    context_parallel: int | str = 1

    # ------------------------------------------------------------------ shape

    def shape(self) -> Algorithm:
        """The algorithm's shape on the profile's steps."""
        return ALGORITHMS[self.algorithm](num_steps=self.num_steps,
                                          trained_steps=self.trained_steps)

    @property
    def gpus(self) -> int:
        return self.rollout_workers + self.trainer_workers

    @property
    def images_per_iteration(self) -> int:
        return self.prompts_per_iteration * self.samples_per_prompt

    def worker_names(self) -> list[tuple[str, str]]:
        """(name, pool) of every worker, rollout first: ``rollout-0``, ..."""
        return ([(f"rollout-{j}", ROLLOUT) for j in range(self.rollout_workers)]
                + [(f"trainer-{j}", TRAINER) for j in range(self.trainer_workers)])

    def speed_of(self, name: str) -> float:
        """The declared speed of worker ``name``."""
        if name in self.worker_speeds:
            return self.worker_speeds[name]
        return self.rollout_speed if name.startswith(ROLLOUT) else self.trainer_speed

    def speeds(self) -> dict[str, float]:
        return {name: self.speed_of(name) for name, _ in self.worker_names()}

    def slowdown_factor(self, worker: str, now: float) -> float:
        """How many times slower ``worker`` runs at ``now`` (profile seconds)."""
        return slowdown_at(self.slowdowns, worker, now)

    def layout(self, max_staleness: int = 0, stale_groups: int | None = None) -> GraphLayout:
        gpu = self.costs.reward_on == "gpu"
        return GraphLayout(num_steps=self.num_steps, trained_steps=self.trained_steps,
                           reward_gpu=gpu, version_lag=max_staleness,
                           stale_groups=stale_groups, algorithm=self.shape(),
                           group_rewards=self.costs.group_reward_per_sample > 0,
                           group_reward_gpu=gpu, encode=self.costs.encode_per_group > 0)

    def plans(self, iterations: int) -> list[IterationPlan]:
        prompts = tuple(f"prompt {j}" for j in range(self.prompts_per_iteration))
        return [IterationPlan.uniform(i, prompts, self.samples_per_prompt, self.chunk_size)
                for i in range(iterations)]

    def scaled(self, gpus: int) -> "Profile":
        """The same work per GPU on ``gpus`` GPUs: pools and prompts scaled together
        (per-worker speeds and slowdowns name workers of the original size: dropped)."""
        f = gpus / self.gpus
        rollout = max(1, round(self.rollout_workers * f))
        return dataclasses.replace(
            self, name=f"{self.name}@{gpus}", rollout_workers=rollout,
            trainer_workers=max(1, gpus - rollout),
            prompts_per_iteration=max(1, round(self.prompts_per_iteration * f)),
            worker_speeds={}, slowdowns=())

    def with_pools(self, rollout: int, trainer: int) -> "Profile":
        """The same work on ``rollout`` + ``trainer`` GPUs (per-worker speeds and
        slowdowns of workers that no longer exist are dropped)."""
        _need(isinstance(rollout, int) and rollout >= 1, "rollout_workers",
              "an integer >= 1", rollout)
        _need(isinstance(trainer, int) and trainer >= 1, "trainer_workers",
              "an integer >= 1", trainer)
        names = {n for n, _ in self.worker_names()}
        p = dataclasses.replace(self, name=f"{self.name}[{rollout}+{trainer}]",
                                rollout_workers=rollout, trainer_workers=trainer)
        names &= {n for n, _ in p.worker_names()}
        return dataclasses.replace(
            p, worker_speeds={n: s for n, s in self.worker_speeds.items() if n in names},
            slowdowns=tuple(s for s in self.slowdowns if s.worker in names))

    def split(self, rollout: int, trainer: int) -> "Profile":
        """The same work on the profile's GPUs split ``rollout : trainer`` (a ratio,
        rounded to whole GPUs, at least one in each pool)."""
        _need(isinstance(rollout, int) and isinstance(trainer, int) and rollout >= 1
              and trainer >= 1, "split", "ROLLOUT:TRAINER, integers >= 1",
              f"{rollout}:{trainer}")
        n = self.gpus
        r = min(max(1, round(n * rollout / (rollout + trainer))), n - 1)
        return self.with_pools(r, n - r)

    # ------------------------------------------------------------------ costs

    def task_seconds(self, kind: str, samples: int, *, colocated: bool = False) -> float:
        """Seconds a task of ``kind`` over ``samples`` samples takes on a speed-1 GPU."""
        c = self.costs
        fwd = c.denoise_per_sample * c.cfg_factor * samples
        if kind == DENOISE:
            return fwd
        if kind == GRAD:
            # The co-located design recomputes the old log-probs a coupled algorithm's
            # micro-step reads (a decoupled one reads none).
            recompute = (colocated and self.colocated.recompute_old_logprob
                         and self.shape().coupled)
            return fwd * c.train_factor + (fwd if recompute else 0.0)
        if kind == DECODE:
            return c.decode_per_sample * samples
        if kind == REWARD:
            return c.reward_per_sample * samples
        if kind == GROUP_REWARD:
            return c.group_reward_per_sample * samples
        if kind == OPTIMIZE:
            return c.optimizer_step
        if kind == ENCODE:
            return c.encode_per_group
        return 0.0

    def weight_sync_seconds(self) -> float:
        """Moving one version's weights to one worker."""
        n = self.network
        return n.latency + self.costs.weight_bytes / n.bandwidth

    def allreduce_seconds(self) -> float:
        """One ring all-reduce of the gradients among the trainers."""
        n, t = self.network, self.trainer_workers
        if t <= 1 or self.costs.grad_bytes <= 0:
            return 0.0
        return 2 * (t - 1) * n.latency + 2 * (t - 1) / t * self.costs.grad_bytes / n.bandwidth

    def gpu_seconds_per_iteration(self, colocated: bool = False) -> float:
        """Total GPU work of one iteration (speed-1 seconds), for the ideal bound."""
        n = self.images_per_iteration
        chunks = n // self.chunk_size
        t = self.task_seconds
        total = chunks * self.num_steps * t(DENOISE, self.chunk_size)
        if not self.shape().pairwise:
            total += chunks * self.trained_steps * t(GRAD, self.chunk_size, colocated=colocated)
        else:  # a micro-step per pair-training chunk, two samples per pair
            layout = self.layout()
            total += self.trained_steps * sum(
                t(GRAD, 2 * len(groups), colocated=colocated)
                for _, _, groups in layout.units(self.plans(1)[0]))
        total += chunks * t(DECODE, self.chunk_size)
        if self.costs.reward_on == "gpu":
            total += chunks * t(REWARD, self.chunk_size)
            total += self.prompts_per_iteration * t(GROUP_REWARD, self.samples_per_prompt)
        total += self.prompts_per_iteration * t(ENCODE, self.samples_per_prompt)
        return total + t(OPTIMIZE, 0)

    def ideal_images_per_s(self, capacity: float | None = None) -> float:
        """Images/s with every GPU busy (:func:`~digenrl.figures.analysis.ideal_bound` of an
        iteration's work): ``capacity`` is the sum of the workers' speeds
        (default: the profile's workers at their declared speeds; transient slowdowns
        are not counted, so the bound stays the one the hardware allows)."""
        if capacity is None:
            capacity = sum(self.speeds().values())
        return ideal_bound(self.images_per_iteration, self.gpu_seconds_per_iteration(), capacity)

    def memory_degree(self) -> int:
        """The context-parallel degree the memory check assumes: the fixed one, or for
        ``auto`` the highest the rollout pool allows."""
        if self.context_parallel == AUTO:
            return max(d for d in DEGREES if d <= self.rollout_workers)
        return int(self.context_parallel)

    def memory(self) -> MemoryPerGpu:
        """Each role's gigabytes per GPU on the profile's pools."""
        return self.model.per_gpu(self.rollout_workers, self.trainer_workers,
                                  samples=self.chunk_size, degree=self.memory_degree())

    def check_memory(self, *, colocated: bool) -> None:
        """Refuse (:class:`ProfileError`, one line) GPUs too small for their roles."""
        self.model.check(self.rollout_workers, self.trainer_workers, colocated=colocated,
                         error=ProfileError, samples=self.chunk_size,
                         degree=self.memory_degree())

    def with_context_parallel(self, degree: int | str) -> "Profile":
        """The same profile at context-parallel ``degree`` (1, a power of two, ``auto``),
        checked as the profile's field is."""
        return dataclasses.replace(self, context_parallel=_degree(
            degree, self.rollout_workers, self.costs, "context_parallel"))

    def pools(self) -> dict[str, tuple[int, float]]:
        return {ROLLOUT: (self.rollout_workers, self.rollout_speed),
                TRAINER: (self.trainer_workers, self.trainer_speed)}


def _section(cls, data: Mapping[str, Any] | None, path: str):
    data = dict(data or {})
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        _need(k in names, f"{path}.{k}", f"a field of {path} ({sorted(names)})", k)
    for f in dataclasses.fields(cls):
        if f.name in data and f.type in ("float", float):
            data[f.name] = _pos(data[f.name], f"{path}.{f.name}", zero_ok=True)
    return cls(**data)


def _degree(v: Any, rollout_workers: int, costs: Costs, path: str) -> int | str:
    """A checked context-parallel degree: ``auto`` or a power of two the rollout pool
    holds; above 1 only with the all-to-all's sizes (``costs.tokens_per_sample``,
    ``hidden_size``, ``attention_layers``)."""
    if v == AUTO:
        degree = 2
    else:
        ok = (isinstance(v, int) and not isinstance(v, bool) and v in DEGREES
              and v <= rollout_workers)
        _need(ok, path, f"'auto' or one of {[d for d in DEGREES if d <= rollout_workers]} "
              f"(at most the {rollout_workers} rollout workers)", v)
        degree = v
    if degree > 1:
        for k in ("tokens_per_sample", "hidden_size", "attention_layers"):
            _need(getattr(costs, k) > 0, f"profile.costs.{k}",
                  f"a number > 0 with {path} {v} (the all-to-alls' size)", getattr(costs, k))
        _need(0 < costs.cp_efficiency <= 1, "profile.costs.cp_efficiency",
              "a number in (0, 1]", costs.cp_efficiency)
    return v


def profile_from_dict(data: Mapping[str, Any]) -> Profile:
    known = {f.name for f in dataclasses.fields(Profile)}
    for k in data:
        _need(k in known, f"profile.{k}", f"a profile field ({sorted(known)})", k)
    for k in ("name", "rollout_workers", "trainer_workers", "prompts_per_iteration",
              "samples_per_prompt", "chunk_size", "num_steps", "trained_steps", "costs"):
        _need(k in data, f"profile.{k}", "a value", None)
    ints = {}
    for k in ("rollout_workers", "trainer_workers", "prompts_per_iteration",
              "samples_per_prompt", "chunk_size", "num_steps", "trained_steps"):
        v = data[k]
        _need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"profile.{k}",
              "an integer >= 1", v)
        ints[k] = v
    algorithm = data.get("algorithm", DEFAULT_ALGORITHM)
    _need(algorithm in ALGORITHMS, "profile.algorithm", f"one of {sorted(ALGORITHMS)}",
          algorithm)
    if ALGORITHMS[algorithm].coupled:
        _need(ints["trained_steps"] < ints["num_steps"], "profile.trained_steps",
              f"fewer than num_steps ({ints['num_steps']})", ints["trained_steps"])
    n = ints["prompts_per_iteration"] * ints["samples_per_prompt"]
    _need(n % ints["chunk_size"] == 0, "profile.chunk_size",
          f"a divisor of the samples per iteration ({n})", ints["chunk_size"])
    names = {f"rollout-{j}" for j in range(ints["rollout_workers"])} \
        | {f"trainer-{j}" for j in range(ints["trainer_workers"])}
    speeds = data.get("worker_speeds") or {}
    _need(isinstance(speeds, Mapping), "profile.worker_speeds",
          "a mapping of worker name to speed", speeds)
    worker_speeds = {}
    for name, v in speeds.items():
        _need(name in names, "profile.worker_speeds", f"names of the profile's workers "
              f"(rollout-0 .. trainer-{ints['trainer_workers'] - 1})", name)
        worker_speeds[name] = _pos(v, f"profile.worker_speeds.{name}")
    slowdowns = []
    for j, sd in enumerate(data.get("slowdowns") or ()):
        path = f"profile.slowdowns[{j}]"
        _need(isinstance(sd, Mapping) and set(sd) == {"worker", "factor", "start", "stop"},
              path, "a mapping with worker, factor, start and stop", sd)
        _need(sd["worker"] in names, f"{path}.worker", "a name of the profile's workers",
              sd["worker"])
        start = _pos(sd["start"], f"{path}.start", zero_ok=True)
        stop = _pos(sd["stop"], f"{path}.stop")
        _need(stop > start, f"{path}.stop", f"a time after start ({start})", stop)
        slowdowns.append(Slowdown(sd["worker"], _pos(sd["factor"], f"{path}.factor"),
                                  start, stop))
    costs = _section(Costs, data["costs"], "profile.costs")
    _need(costs.denoise_per_sample > 0, "profile.costs.denoise_per_sample", "a number > 0",
          costs.denoise_per_sample)
    _need(costs.reward_on in ("gpu", "remote"), "profile.costs.reward_on", "'gpu' or 'remote'",
          costs.reward_on)
    network = _section(Network, data.get("network"), "profile.network")
    _need(network.sync_bucket_mb > 0, "profile.network.sync_bucket_mb", "a number > 0",
          network.sync_bucket_mb)
    model = _section(Model, data.get("model"), "profile.model")
    model.validate(ProfileError)
    if model.fsdp:  # the collectives' bytes follow from the size: one fact, one place
        for k in ("weight_bytes", "grad_bytes"):
            _need(k not in data["costs"], f"profile.costs.{k}",
                  "no value with model.sharding fsdp (derived from model.params)",
                  data["costs"].get(k))
        costs = dataclasses.replace(costs, weight_bytes=model.weight_bytes,
                                    grad_bytes=model.grad_bytes)
    degree = _degree(data.get("context_parallel", 1), ints["rollout_workers"], costs,
                     "profile.context_parallel")
    profile = Profile(
        name=str(data["name"]), description=str(data.get("description", "")),
        sources=tuple(str(s) for s in data.get("sources", ())), **ints,
        rollout_speed=_pos(data.get("rollout_speed", 1.0), "profile.rollout_speed"),
        trainer_speed=_pos(data.get("trainer_speed", 1.0), "profile.trainer_speed"),
        costs=costs, network=network, model=model,
        colocated=_section(ColocatedCosts, data.get("colocated"), "profile.colocated"),
        time_scale=_pos(data.get("time_scale", 0.1), "profile.time_scale"),
        worker_speeds=worker_speeds, slowdowns=tuple(slowdowns), algorithm=algorithm,
        context_parallel=degree)
    profile.check_memory(colocated=False)
    return profile


def list_profiles() -> list[str]:
    return sorted(p.name[:-5] for p in PROFILE_DIR.iterdir() if p.name.endswith(".yaml"))


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (``flux12b-16gpu``) or a YAML file by path."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        text = p.read_text()
    else:
        f = PROFILE_DIR / f"{name_or_path}.yaml"
        if not f.is_file():
            raise ProfileError(f"profile: expected a YAML file or one of {list_profiles()}, "
                               f"got {str(name_or_path)!r}")
        text = f.read_text()
    data = yaml.safe_load(text)
    _need(isinstance(data, Mapping), "profile", "a YAML mapping", type(data).__name__)
    return profile_from_dict(data)

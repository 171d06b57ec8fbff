"""Weight-sync and gradient traffic of one RL iteration on two network designs.

A closed-form (fluid) model, pure Python, for the question "does a reconfigurable
fabric pay off for disaggregated RL?" at 16 to 2,048 GPUs. It complements the event
simulator (:mod:`digenrl.sim.simulate`), which charges a flat ``weight_bytes /
bandwidth`` per rollout worker and one flat ring all-reduce.

Placement
    ``gpus_per_node`` GPUs per node, one NIC per GPU. The profile scaled to N GPUs
    (:meth:`~digenrl.sim.profile.Profile.scaled`) gives T trainers and R rollout
    workers; trainers take GPUs ``0 .. T-1`` and rollout workers the rest, so nodes are
    filled in order and at most one node holds both pools (a *shared* node).

Two traffic kinds per iteration
    *Gradient all-reduce* among the trainers (``costs.grad_bytes`` = B), hierarchical:
    NVLink reduce-scatter inside each trainer node, a ring all-reduce across the n
    trainer nodes on each of ``r`` rails (r = the fewest trainers on any trainer node;
    rail i links the i-th GPU of every node), then an NVLink all-gather. Each ring link
    carries ``2 (n-1)/n * B/r`` bytes in ``2 (n-1)`` steps.

    *Weight synchronisation*, trainer pool to rollout pool (``costs.weight_bytes`` = W),
    as a sharded, rail-aligned transfer: the weights are cut into ``gpus_per_node``
    slices of W/g; the trainers are data-parallel replicas, so any trainer can send any
    slice. Slice i reaches every rollout-only node through pipelined chains on rail i,
    each headed by a rail-i trainer (those on the trainer nodes nearest the rollout
    nodes); with at least as many rail-i trainers as rollout-only nodes (every shipped
    profile) each chain has one hop: a direct transfer, one sender per receiver. Each
    rollout node then all-gathers its slices over NVLink. Rollout workers on the shared
    node copy the weights from a co-located trainer over NVLink instead, beside the
    network transfer. (With fewer trainers than ``gpus_per_node`` a trainer NIC heads
    several chains; the circuit fabric is then charged that NIC's load as if its
    circuits were served in turn without extra switches -- optimistic, and never the
    case for the shipped profiles above one node.)

Bandwidth is charged by link load: a pattern's flows run concurrently and the pattern
takes ``max(load / capacity)`` over the links it loads (each NIC, each direction; on
the fat-tree also each leaf's up- and down-links), plus a latency per algorithm step.

Two fabrics
    :class:`FatTree`: static two-tier leaf-spine tree; ``nodes_per_leaf`` nodes per leaf
    switch; a leaf's up-link capacity is its down-link capacity divided by
    ``oversubscription``. Traffic between leaves (cross-pool weight sync whenever the
    pools sit under different leaves) shares those up-links.
    :class:`CircuitFabric`: an optical-circuit-switch style fabric that gives each
    pattern dedicated NIC-to-NIC circuits at full NIC bandwidth, and costs
    ``switching_delay`` seconds each time it changes pattern. When both patterns cross
    nodes it changes twice per iteration (into the all-reduce, back into weight sync);
    with one inter-node pattern it is configured once and never switches.

Exposure
    *raw*: all communication time of an iteration, every switch charged.
    *synchronous* (``disaggregated`` mode): the all-reduce and the weight sync sit on the
    critical path; a switch is issued as soon as the fabric is idle, so the switch into
    the all-reduce hides behind the training compute and the switch back behind the
    optimizer step.
    *pipelined* (``digenrl`` mode): rollout keeps generating with the previous version
    while the new one streams in, and idle trainers generate during the all-reduce, so
    the fabric's busy time (transfers + switches) is hidden up to the iteration's compute
    time at the ideal bound; only the excess is exposed.

Small traffic (latents to the trainers, control) is not modelled: it is assumed to use a
packet network kept beside the circuits (OrchestrRL describes an optical/electrical
fabric).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from digenrl.checks import finite, positive_int
from digenrl.sim.profile import Profile, load_profile
from digenrl.vocabulary import GRAD, OPTIMIZE

__all__ = ["FatTree", "CircuitFabric", "Placement", "PatternTime", "NetworkCase",
           "allreduce_time", "weight_sync_time", "ring_time", "allgather_time",
           "bucketed_broadcast_time", "network_case", "network_study",
           "format_network_study", "run_network_study", "DEFAULT_GPUS",
           "DEFAULT_OVERSUBSCRIPTIONS", "DEFAULT_SWITCHING_DELAYS"]

#: Bytes per direction per GPU NIC: 400 Gb/s InfiniBand (docs/sources.md, "Hardware").
NIC_BANDWIDTH = 50e9
#: Bytes per direction per GPU over NVLink 4: 900 GB/s per GPU counting both directions
#: (docs/sources.md, "Hardware"), halved.
NVLINK_BANDWIDTH = 450e9
#: Seconds per message end to end (the shipped profiles' ``network.latency``).
MESSAGE_LATENCY = 5e-6

DEFAULT_GPUS = (16, 64, 256, 1024, 2048)
DEFAULT_OVERSUBSCRIPTIONS = (1.0, 2.0, 4.0)
#: Fast optical circuit switch (10 us) to MEMS-like (10-100 ms).
DEFAULT_SWITCHING_DELAYS = (1e-5, 1e-3, 1e-2, 1e-1)


def _number(owner: str, name: str, value: Any, minimum: int, strict: bool) -> None:
    finite(value, f"{owner}.{name}", lo=minimum, lo_open=strict, error=ValueError)


def _integer(owner: str, name: str, value: Any, minimum: int) -> None:
    positive_int(value, f"{owner}.{name}", minimum, error=ValueError)


@dataclass(frozen=True)
class FatTree:
    """A static, possibly oversubscribed two-tier fat-tree (leaf-spine).

    A leaf switch serves ``nodes_per_leaf`` whole nodes; its up-links carry
    ``1 / oversubscription`` of what its down-links can, shared by all traffic leaving
    or entering the leaf. A path inside a leaf crosses one switch, between leaves three
    (two tiers reach 2,048 NICs at 1:1 with 64-port switches, so the swept scales need no
    third tier).
    """

    nic_bandwidth: float = NIC_BANDWIDTH       # bytes/s per GPU NIC, each direction
    nvlink_bandwidth: float = NVLINK_BANDWIDTH  # bytes/s per GPU inside a node, each direction
    oversubscription: float = 1.0              # leaf down-link : up-link capacity
    nodes_per_leaf: int = 4                    # 32 NICs: a 64-port leaf, half of it down
    latency: float = MESSAGE_LATENCY           # s per message, end to end
    switch_latency: float = 1e-6               # s per switch a message crosses
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        name = type(self).__name__
        _number(name, "nic_bandwidth", self.nic_bandwidth, 0, True)
        _number(name, "nvlink_bandwidth", self.nvlink_bandwidth, 0, True)
        _number(name, "oversubscription", self.oversubscription, 1, False)
        _integer(name, "nodes_per_leaf", self.nodes_per_leaf, 1)
        _number(name, "latency", self.latency, 0, False)
        _number(name, "switch_latency", self.switch_latency, 0, False)
        _integer(name, "gpus_per_node", self.gpus_per_node, 1)

    def leaf(self, node: int) -> int:
        return node // self.nodes_per_leaf

    def load_seconds(self, flows: Sequence[tuple[int, int, int, int, float]]) -> float:
        """Time for concurrent flows ``(src node, src rail, dst node, dst rail, bytes)``:
        the most loaded NIC direction or leaf up/down-link over its capacity."""
        nic = _nic_loads(flows)
        leaf: defaultdict[tuple[str, int], float] = defaultdict(float)
        for sn, _, dn, _, b in flows:
            if self.leaf(sn) != self.leaf(dn):
                leaf[("up", self.leaf(sn))] += b
                leaf[("down", self.leaf(dn))] += b
        uplink = self.nodes_per_leaf * self.gpus_per_node * self.nic_bandwidth / self.oversubscription
        return max(max(nic.values(), default=0.0) / self.nic_bandwidth,
                   max(leaf.values(), default=0.0) / uplink)

    def step_latency(self, flows: Sequence[tuple[int, int, int, int, float]]) -> float:
        """Per algorithm step: the message latency plus the switches on the longest path."""
        cross = any(self.leaf(sn) != self.leaf(dn) for sn, _, dn, _, _ in flows)
        return self.latency + (3 if cross else 1) * self.switch_latency


@dataclass(frozen=True)
class CircuitFabric:
    """A reconfigurable fabric: each traffic pattern gets dedicated circuits.

    A circuit joins two NICs at full NIC bandwidth with nothing shared and no packet
    switch on the path; changing the pattern takes ``switching_delay`` seconds, during
    which the inter-node fabric carries nothing.
    """

    nic_bandwidth: float = NIC_BANDWIDTH
    nvlink_bandwidth: float = NVLINK_BANDWIDTH
    switching_delay: float = 0.0               # s per reconfiguration
    latency: float = MESSAGE_LATENCY
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        name = type(self).__name__
        _number(name, "nic_bandwidth", self.nic_bandwidth, 0, True)
        _number(name, "nvlink_bandwidth", self.nvlink_bandwidth, 0, True)
        _number(name, "switching_delay", self.switching_delay, 0, False)
        _number(name, "latency", self.latency, 0, False)
        _integer(name, "gpus_per_node", self.gpus_per_node, 1)

    def load_seconds(self, flows: Sequence[tuple[int, int, int, int, float]]) -> float:
        return max(_nic_loads(flows).values(), default=0.0) / self.nic_bandwidth

    def step_latency(self, flows: Sequence[tuple[int, int, int, int, float]]) -> float:
        return self.latency


def _nic_loads(flows: Iterable[tuple[int, int, int, int, float]]) -> dict:
    load: dict = defaultdict(float)
    for sn, sr, dn, dr, b in flows:
        load[("tx", sn, sr)] += b
        load[("rx", dn, dr)] += b
    return load


@dataclass(frozen=True)
class Placement:
    """Trainers on GPUs ``0 .. trainers-1``, rollout workers after them."""

    trainers: int
    rollouts: int
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        _integer("Placement", "trainers", self.trainers, 1)
        _integer("Placement", "rollouts", self.rollouts, 1)
        _integer("Placement", "gpus_per_node", self.gpus_per_node, 1)

    @classmethod
    def of(cls, profile: Profile, gpus_per_node: int = 8) -> "Placement":
        return cls(profile.trainer_workers, profile.rollout_workers, gpus_per_node)

    @property
    def gpus(self) -> int:
        return self.trainers + self.rollouts

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    def _count(self, node: int, lo: int, hi: int) -> int:
        g = self.gpus_per_node
        return max(0, min(hi, (node + 1) * g) - max(lo, node * g))

    def trainers_on(self, node: int) -> int:
        return self._count(node, 0, self.trainers)

    def rollouts_on(self, node: int) -> int:
        return self._count(node, self.trainers, self.gpus)

    def trainer_nodes(self) -> list[int]:
        return [k for k in range(self.nodes) if self.trainers_on(k)]

    def rollout_only_nodes(self) -> list[int]:
        return [k for k in range(self.nodes) if self.rollouts_on(k) and not self.trainers_on(k)]

    def shared_nodes(self) -> list[int]:
        return [k for k in range(self.nodes) if self.rollouts_on(k) and self.trainers_on(k)]


@dataclass(frozen=True)
class PatternTime:
    """One traffic kind on one fabric: seconds over NVLink and over the network."""

    intra_node_s: float
    inter_node_s: float

    @property
    def seconds(self) -> float:
        return self.intra_node_s + self.inter_node_s

    @property
    def crosses_nodes(self) -> bool:
        return self.inter_node_s > 0


Fabric = FatTree | CircuitFabric


def _check_fit(placement: Placement, fabric: Fabric) -> None:
    if placement.gpus_per_node != fabric.gpus_per_node:
        raise ValueError(f"Placement.gpus_per_node: expected the fabric's "
                         f"{fabric.gpus_per_node}, got {placement.gpus_per_node}")


def allreduce_time(placement: Placement, fabric: Fabric, grad_bytes: float) -> PatternTime:
    """Hierarchical all-reduce of ``grad_bytes`` among the trainers (see the module)."""
    _number("allreduce_time", "grad_bytes", grad_bytes, 0, False)
    _check_fit(placement, fabric)
    nodes = placement.trainer_nodes()
    if placement.trainers < 2 or grad_bytes == 0:
        return PatternTime(0.0, 0.0)
    intra = 0.0
    for k in nodes:
        t = placement.trainers_on(k)
        if t > 1:  # reduce-scatter, then all-gather, inside the node
            intra = max(intra, 2 * ((t - 1) / t * grad_bytes / fabric.nvlink_bandwidth
                                    + (t - 1) * fabric.latency))
    n = len(nodes)
    if n < 2:
        return PatternTime(intra, 0.0)
    rails = min(placement.trainers_on(k) for k in nodes)
    per_link = 2 * (n - 1) / n * grad_bytes / rails
    flows = [(nodes[i], r, nodes[(i + 1) % n], r, per_link)
             for r in range(rails) for i in range(n)]
    inter = fabric.load_seconds(flows) + 2 * (n - 1) * fabric.step_latency(flows)
    return PatternTime(intra, inter)


def weight_sync_time(placement: Placement, fabric: Fabric, weight_bytes: float, *,
                     chunk_bytes: float = 4 * 2**20) -> PatternTime:
    """One policy version's ``weight_bytes`` from the trainers to every rollout worker
    (sharded, rail-aligned chains; see the module). ``chunk_bytes``: the pipelining
    unit of a chain longer than one hop."""
    _number("weight_sync_time", "weight_bytes", weight_bytes, 0, False)
    _number("weight_sync_time", "chunk_bytes", chunk_bytes, 0, True)
    _check_fit(placement, fabric)
    if weight_bytes == 0:
        return PatternTime(0.0, 0.0)
    g = placement.gpus_per_node
    nvlink = fabric.nvlink_bandwidth
    intra = 0.0
    if placement.shared_nodes():  # copied from a co-located trainer
        intra = weight_bytes / nvlink + fabric.latency
    receivers = placement.rollout_only_nodes()
    if not receivers:
        return PatternTime(intra, 0.0)
    senders: dict[int, list[tuple[int, int]]] = defaultdict(list)  # rail -> trainer NICs
    for t in range(placement.trainers):
        senders[t % g].append((t // g, t % g))
    slice_bytes = weight_bytes / g
    flows, depth = [], 1
    for rail in range(g):
        heads = senders.get(rail) or senders[rail % min(placement.trainers, g)]
        chains = min(len(heads), len(receivers))
        heads = heads[-chains:]  # the trainer nodes nearest the rollout nodes
        size = -(-len(receivers) // chains)
        depth = max(depth, size)
        for c, head in enumerate(heads):
            hops = [head] + [(k, rail % placement.rollouts_on(k))
                             for k in receivers[c * size:(c + 1) * size]]
            flows += [(a[0], a[1], b[0], b[1], slice_bytes) for a, b in zip(hops, hops[1:])]
    inter = (fabric.load_seconds(flows) + depth * fabric.step_latency(flows)
             + (depth - 1) * chunk_bytes / fabric.nic_bandwidth)
    gather = max((placement.rollouts_on(k) - 1) / placement.rollouts_on(k) * weight_bytes / nvlink
                 + (placement.rollouts_on(k) - 1) * fabric.latency for k in receivers)
    # The shared node's copy runs beside the network transfer; the gather follows it.
    total = max(inter + gather, intra)
    return PatternTime(total - inter, inter)


def ring_time(fabric: Fabric, first: int, ranks: int, hop_bytes: float, steps: int, *,
              closed: bool = True) -> PatternTime:
    """A pipelined ring (``closed``) or chain over GPUs ``first .. first+ranks-1`` (nodes
    filled in order) in which every hop carries ``hop_bytes`` in ``steps`` algorithm
    steps: NVLink when every rank is on one node, else the network's most loaded link
    (each hop between nodes loads a NIC each way; on the fat-tree, leaf links too)."""
    _integer("ring_time", "ranks", ranks, 1)
    _number("ring_time", "hop_bytes", hop_bytes, 0, False)
    if ranks < 2 or hop_bytes == 0:
        return PatternTime(0.0, 0.0)
    g = fabric.gpus_per_node
    gpus = list(range(first, first + ranks))
    pairs = list(zip(gpus, gpus[1:] + (gpus[:1] if closed else [])))
    flows = [(a // g, a % g, b // g, b % g, hop_bytes) for a, b in pairs if a // g != b // g]
    if not flows:
        return PatternTime(hop_bytes / fabric.nvlink_bandwidth + steps * fabric.latency, 0.0)
    return PatternTime(0.0, fabric.load_seconds(flows) + steps * fabric.step_latency(flows))


def allgather_time(fabric: Fabric, ranks: int, nbytes: float, first: int = 0) -> PatternTime:
    """Ring all-gather (or reduce-scatter: the same traffic) of ``nbytes`` among
    ``ranks`` GPUs, each holding ``1/ranks`` of them: every rank sends and receives
    ``(ranks-1)/ranks`` of the bytes in ``ranks-1`` steps."""
    return ring_time(fabric, first, ranks, (ranks - 1) / ranks * nbytes, ranks - 1)


def bucketed_broadcast_time(placement: Placement, fabric: Fabric, weight_bytes: float,
                            bucket_bytes: float) -> float:
    """Seconds to broadcast the FSDP-sharded ``weight_bytes`` from the trainers to every
    rollout worker in buckets of ``bucket_bytes``: each bucket is filled by an
    all-gather among the trainers, then sent by the trainer nearest the rollout pool
    down a pipelined chain through every rollout worker (NCCL's broadcast); the next
    bucket is filled while one is in flight, so the two stages overlap:
    ``fill_1 + sum(max(send_i, fill_i+1)) + send_n``."""
    _number("bucketed_broadcast_time", "weight_bytes", weight_bytes, 0, False)
    _number("bucketed_broadcast_time", "bucket_bytes", bucket_bytes, 0, True)
    _check_fit(placement, fabric)
    if weight_bytes == 0:
        return 0.0
    full, rest = divmod(weight_bytes, bucket_bytes)
    buckets = [bucket_bytes] * int(full) + ([rest] if rest else [])
    t, r = placement.trainers, placement.rollouts
    fill = [allgather_time(fabric, t, b).seconds for b in buckets]
    send = [ring_time(fabric, t - 1, r + 1, b, r, closed=False).seconds for b in buckets]
    return fill[0] + sum(max(s, f) for s, f in zip(send, fill[1:])) + send[-1]


def _delay(d: float) -> str:
    if d >= 1:
        return f"{d:g} s"
    if d >= 1e-3:
        return f"{d * 1e3:g} ms"
    return f"{d * 1e6:g} us"


@dataclass(frozen=True)
class NetworkCase:
    """One (profile, GPUs, oversubscription) case, both fabrics, all switching delays."""

    profile: str
    gpus: int
    nodes: int
    rollout_workers: int
    trainer_workers: int
    oversubscription: float
    tree_sync: PatternTime
    tree_allreduce: PatternTime
    circuit_sync: PatternTime
    circuit_allreduce: PatternTime
    switches: int                 # reconfigurations per iteration on the circuit fabric
    compute_s: float              # iteration time at the ideal bound (all GPUs busy)
    train_compute_s: float        # the trainers' gradient compute, synchronous mode
    optimizer_s: float            # the optimizer step between all-reduce and weight sync
    delays: tuple[float, ...]

    # ---- raw: every switch charged
    @property
    def tree_s(self) -> float:
        return self.tree_sync.seconds + self.tree_allreduce.seconds

    def circuit_s(self, delay: float = 0.0) -> float:
        return self.circuit_sync.seconds + self.circuit_allreduce.seconds + self.switches * delay

    def gain_s(self, delay: float) -> float:
        """Fat-tree minus circuit communication per iteration (positive: circuits win)."""
        return self.tree_s - self.circuit_s(delay)

    @property
    def advantage_s(self) -> float:
        return self.tree_s - self.circuit_s(0.0)

    def break_even_raw(self) -> float | None:
        """Largest switching delay at which the circuit fabric's communication time
        (every switch charged) is still below the fat-tree's; ``inf`` when it never
        switches, ``None`` when it never wins."""
        if self.advantage_s <= 0:
            return None
        return math.inf if self.switches == 0 else self.advantage_s / self.switches

    # ---- synchronous iteration: switches hide behind the compute before each pattern
    def exposed_sync_circuit_s(self, delay: float) -> float:
        hidden = 0.0
        if self.switches:
            hidden = (max(0.0, delay - self.train_compute_s) + max(0.0, delay - self.optimizer_s))
        return self.circuit_s(0.0) + hidden

    def break_even_sync(self) -> float | None:
        gain = self.advantage_s
        if gain <= 0:
            return None
        if self.switches == 0:
            return math.inf
        lo, hi = sorted((self.train_compute_s, self.optimizer_s))
        # Solve max(0, d - lo) + max(0, d - hi) = gain.
        return lo + gain if gain <= hi - lo else (gain + lo + hi) / 2

    # ---- pipelined iteration: the fabric's busy time hides under the compute
    @property
    def exposed_pipelined_tree_s(self) -> float:
        return max(0.0, self.tree_s - self.compute_s)

    def exposed_pipelined_circuit_s(self, delay: float) -> float:
        return max(0.0, self.circuit_s(delay) - self.compute_s)

    def break_even_pipelined(self) -> float | None:
        if self.exposed_pipelined_tree_s <= 0:
            return None  # nothing exposed to win back
        return self.break_even_raw()

    def hidden_up_to(self) -> float:
        """Largest switching delay the pipelined iteration still hides entirely."""
        room = self.compute_s - self.circuit_s(0.0)
        if room < 0:
            return 0.0
        return math.inf if self.switches == 0 else room / self.switches


def _train_compute_s(p: Profile) -> tuple[float, float]:
    chunks = p.images_per_iteration // p.chunk_size
    grads = chunks * p.trained_steps * p.task_seconds(GRAD, p.chunk_size)
    opt = p.task_seconds(OPTIMIZE, 0) / p.trainer_speed
    return grads / (p.trainer_workers * p.trainer_speed), opt


def network_case(profile: Profile, gpus: int, oversubscription: float = 1.0, *,
                 delays: Sequence[float] = DEFAULT_SWITCHING_DELAYS,
                 tree: FatTree | None = None, circuit: CircuitFabric | None = None
                 ) -> NetworkCase:
    """Both fabrics for ``profile`` scaled to ``gpus`` GPUs. ``tree`` / ``circuit``:
    the fabric parameters (default: the H800 figures of docs/sources.md, the profile's
    NIC bandwidth and latency); ``oversubscription`` replaces the tree's."""
    _integer("network_case", "gpus", gpus, 2)
    for d in delays:
        _number("network_case", "delays", d, 0, False)
    net = profile.network
    tree = tree or FatTree(nic_bandwidth=net.bandwidth, latency=net.latency)
    tree = dataclasses.replace(tree, oversubscription=oversubscription)
    circuit = circuit or CircuitFabric(nic_bandwidth=tree.nic_bandwidth,
                                       nvlink_bandwidth=tree.nvlink_bandwidth,
                                       latency=tree.latency, gpus_per_node=tree.gpus_per_node)
    p = profile.scaled(gpus)
    place = Placement.of(p, tree.gpus_per_node)
    c = p.costs
    ts, ta = weight_sync_time(place, tree, c.weight_bytes), allreduce_time(place, tree, c.grad_bytes)
    cs = weight_sync_time(place, circuit, c.weight_bytes)
    ca = allreduce_time(place, circuit, c.grad_bytes)
    switches = 2 if cs.crosses_nodes and ca.crosses_nodes else 0
    train, opt = _train_compute_s(p)
    return NetworkCase(profile=profile.name, gpus=p.gpus, nodes=place.nodes,
                       rollout_workers=p.rollout_workers, trainer_workers=p.trainer_workers,
                       oversubscription=float(oversubscription), tree_sync=ts,
                       tree_allreduce=ta, circuit_sync=cs, circuit_allreduce=ca,
                       switches=switches,
                       compute_s=p.images_per_iteration / p.ideal_images_per_s(),
                       train_compute_s=train, optimizer_s=opt, delays=tuple(delays))


def network_study(profiles: Sequence[Profile], gpus: Sequence[int] = DEFAULT_GPUS,
                  oversubscriptions: Sequence[float] = DEFAULT_OVERSUBSCRIPTIONS,
                  delays: Sequence[float] = DEFAULT_SWITCHING_DELAYS, **fabrics
                  ) -> list[NetworkCase]:
    """Every profile x GPU count x oversubscription; ``fabrics``: ``tree=`` and
    ``circuit=`` as in :func:`network_case`."""
    if not delays:
        raise ValueError("network_study.delays: expected at least one switching delay, got ()")
    return [network_case(p, n, s, delays=delays, **fabrics)
            for p in profiles for n in gpus for s in oversubscriptions]


def _duration(s: float | None) -> str:
    if s is None:
        return "never"
    if math.isinf(s):
        return "no switch"
    if s < 1e-3:
        return f"{s * 1e6:.3g} us"
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def format_network_study(cases: Sequence[NetworkCase]) -> str:
    """One table per profile: communication per iteration in milliseconds, the gain of
    the circuit fabric at each switching delay, and the break-even delays."""
    out: list[str] = []
    by_profile: dict[str, list[NetworkCase]] = {}
    for case in cases:
        by_profile.setdefault(case.profile, []).append(case)
    for name, rows in by_profile.items():
        delays = rows[0].delays
        gains = " ".join(f"{'@' + _delay(d):>8}" for d in delays)
        out.append(f"{name}: per iteration, ms; tree = static fat-tree, OCS = reconfigurable "
                   f"circuits; sync = weight sync, AR = all-reduce; sw/it = reconfigurations "
                   f"per iteration")
        out.append(f"{'':>26} | {'fat-tree':^16} | {'circuits':^22} | "
                   f"{'gain = tree - OCS, ms':^{9 * len(delays) - 1}} | "
                   f"{'break-even switching delay':^32} |")
        out.append(f"{'GPUs':>5} {'nodes':>5} {'R/T':>9} {'over':>4} | {'sync':>8} {'AR':>7} | "
                   f"{'sync':>8} {'AR':>7} {'sw/it':>5} | {gains} | {'raw':>10} "
                   f"{'synchronous':>11} {'pipelined':>9} | {'compute s':>9} {'comm %':>6}")
        for c in rows:
            g = " ".join(f"{round(c.gain_s(d) * 1e3, 1) + 0.0:8.1f}" for d in delays)
            piped = ("hidden" if c.break_even_pipelined() is None and c.advantage_s > 0
                     else _duration(c.break_even_pipelined()))
            out.append(
                f"{c.gpus:5d} {c.nodes:5d} {f'{c.rollout_workers}/{c.trainer_workers}':>9} "
                f"{c.oversubscription:>4g} | {c.tree_sync.seconds * 1e3:8.1f} "
                f"{c.tree_allreduce.seconds * 1e3:7.1f} | {c.circuit_sync.seconds * 1e3:8.1f} "
                f"{c.circuit_allreduce.seconds * 1e3:7.1f} {c.switches:5d} | {g} | "
                f"{_duration(c.break_even_raw()):>10} {_duration(c.break_even_sync()):>11} "
                f"{piped:>9} | {c.compute_s:9.1f} {100 * c.tree_s / c.compute_s:6.2f}")
        hidden = min(c.hidden_up_to() for c in rows)
        out.append("break-even raw: every switch charged; synchronous: a switch hides behind "
                   "the training compute (into the all-reduce) or the optimizer step (back);")
        out.append(f"pipelined: 'hidden' = the fat-tree's traffic already hides under the "
                   f"compute, nothing to win; the circuits stay hidden up to a "
                   f"{_duration(hidden)} switching delay in every row;")
        out.append("comm % = fat-tree communication / compute per iteration at the ideal bound.")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def run_network_study(profile: str, gpus: int | None = None) -> str:
    """The ``digenrl simulate PROFILE --network-study`` table: the default sweep, or
    one GPU count."""
    p = load_profile(profile)
    counts = DEFAULT_GPUS if gpus is None else (gpus,)
    return format_network_study(network_study([p], counts))

"""An iteration's tasks built once per shape and shifted to later iterations.

Building an iteration's nodes (keys, annotations, arguments) and reading their
annotations back costs about a quarter of a large simulation. Iterations of one
:func:`~digenrl.graph.structure.iteration_shape` differ only in the integers that move
with the iteration number, so the simulator builds the first two iterations of a shape
with the real builders, compiles the second into a template -- recording which key
elements and annotation fields moved between the two -- and makes every later
iteration of that shape from the template by shifting those fields. The tasks stay
the builders': a template only repeats what they produced, and a shape whose two builds
differ in any other way gets no template (each of its iterations is built).

A batch of tasks for the engine is ``(entries, externals)``: each entry is ``(key,
info, inputs)``, an input ``j >= 0`` being entry ``j`` of the batch and ``j < 0`` the
key ``externals[~j]`` (a task of an earlier batch). A template's inputs are the same
integers for every iteration; only the few external keys are shifted.

A chunk computed with context parallelism at degree ``d`` has each ``denoise`` step as a
gang of ``d`` members (:func:`context_parallel_batch`, applied to an iteration's batch
however it was made): member 0 keeps the step's key, so what reads the step reads it;
member ``m`` reads what the step reads, with member ``m`` of the chunk's previous step
in place of the step itself. The scheduling policy releases a gang's members together,
each on its own rollout worker (:mod:`digenrl.schedulers.policy.rules.gang`).
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

from digenrl.graph.keys import gang_id, member_key
from digenrl.graph.plan import IterationPlan
from digenrl.graph.structure import GraphLayout, Node, iteration_nodes, iteration_shape
from digenrl.schedulers.policy import TaskInfo
from digenrl.vocabulary import DENOISE, Key, ROLLOUT

__all__ = ["Entry", "Batch", "node_batch", "IterationTemplate", "IterationSource",
           "context_parallel_batch"]

#: An iteration's chunk degrees: the context-parallel degree of each chunk of a plan.
Degrees = Callable[[IterationPlan], Sequence[int]]

Entry = tuple[Key, TaskInfo, Sequence[int]]
Batch = tuple[list[Entry], list[Key]]


def node_batch(nodes: Sequence[Node], factory: type[TaskInfo] = TaskInfo) -> Batch:
    """The engine's batch of built nodes (each task made by ``factory``: TaskInfo or
    a subclass of it)."""
    index = {n.key: j for j, n in enumerate(nodes)}
    externals: dict[Key, int] = {}
    from_meta = factory.from_meta
    entries: list[Entry] = []
    for n in nodes:
        inputs = []
        for d in n.deps:
            j = index.get(d)
            if j is None:
                j = externals.get(d)
                if j is None:
                    j = externals[d] = ~len(externals)
            inputs.append(j)
        entries.append((n.key, from_meta(n.key, n.meta), inputs))
    return entries, list(externals)


def _moves(a, b, delta: int) -> int | None:
    """For integers (or None) of two builds ``delta`` iterations apart: 0 when equal,
    1 when ``b`` is ``a`` moved by ``delta``, None otherwise."""
    if a is None or b is None:
        return 0 if a is b else None
    if type(a) is not int or type(b) is not int:
        return None
    return 0 if a == b else 1 if b - a == delta else None


def _key_pattern(a: Key, b: Key, delta: int):
    """``(head, base, moves, tail)``: the key is ``head + (base + d * moves,) + tail``
    shifted by ``d`` iterations (only the element after the kind may move); None when
    ``a`` and ``b`` are not one key shifted by ``delta``."""
    if type(a) is not tuple or type(b) is not tuple or len(a) != len(b) or len(a) < 2:
        return None
    if a[0] != b[0] or a[2:] != b[2:]:
        return None
    m = _moves(a[1], b[1], delta)
    return None if m is None or a[1] is None else (a[:1], a[1], m, a[2:])


def _shift(pattern, d: int) -> Key:
    head, base, moves, tail = pattern
    return head + (base + d * moves,) + tail


class IterationTemplate:
    """Iteration ``base``'s batch, with what moves with the iteration marked."""

    def __init__(self, base: int, rows: list[tuple], externals: list[tuple]):
        self.base = base
        self._rows = rows
        self._externals = externals

    @classmethod
    def compile(cls, first: tuple[int, Batch],
                second: tuple[int, Batch]) -> "IterationTemplate | None":
        """The template of two builds of one shape (None when they are not one DAG
        shifted)."""
        (ia, (a, ext_a)), (ib, (b, ext_b)) = first, second
        delta = ib - ia
        if delta == 0 or len(a) != len(b) or len(ext_a) != len(ext_b):
            return None
        externals = [_key_pattern(x, y, delta) for x, y in zip(ext_a, ext_b)]
        if None in externals:
            return None
        rows = []
        for (ka, x, inputs_a), (kb, y, inputs_b) in zip(a, b):
            key = _key_pattern(ka, kb, delta)
            if key is None or inputs_a != inputs_b:
                return None
            # The fields that never move with the iteration, then the three that may.
            if (x.kind, x.pool, x.gpu, x.timestep, x.chunk, x.group, x.samples) != \
                    (y.kind, y.pool, y.gpu, y.timestep, y.chunk, y.group, y.samples):
                return None
            if x.gang is not None or y.gang is not None:
                return None       # (gangs are built per iteration: a template has none)
            it, pv, bv = (_moves(x.iteration, y.iteration, delta),
                          _moves(x.policy_version, y.policy_version, delta),
                          _moves(x.behaviour_version, y.behaviour_version, delta))
            if it is None or pv is None or bv is None:
                return None
            rows.append((*key, x.kind, x.pool, x.iteration, it, x.policy_version, pv, x.gpu,
                         x.timestep, x.chunk, x.group, x.behaviour_version, bv, x.samples,
                         tuple(inputs_a)))
        return cls(ia, rows, externals)

    def batch(self, iteration: int, factory: type[TaskInfo] = TaskInfo) -> Batch:
        """The batch of ``iteration`` (of this template's shape), its tasks made by
        ``factory``."""
        d = iteration - self.base
        entries = []
        for (head, k, km, tail, kind, pool, it, itm, pv, pvm, gpu, timestep, chunk, group,
             bv, bvm, samples, inputs) in self._rows:
            key = head + (k + d * km,) + tail
            info = factory(key=key, kind=kind, pool=pool, iteration=it + d * itm,
                           policy_version=pv + d * pvm, gpu=gpu, timestep=timestep,
                           chunk=chunk, group=group,
                           behaviour_version=None if bv is None else bv + d * bvm,
                           samples=samples)
            entries.append((key, info, inputs))
        return entries, [_shift(p, d) for p in self._externals]


def context_parallel_batch(batch: Batch, iteration: int, degrees: Sequence[int],
                           factory: type[TaskInfo] = TaskInfo) -> Batch:
    """``batch`` (iteration ``iteration``'s) with each rollout ``denoise`` step of chunk
    ``c`` a gang of ``degrees[c]`` members where that is above 1."""
    entries, externals = batch

    def degree(info: TaskInfo) -> int:
        if info.kind != DENOISE or info.pool != ROLLOUT or info.chunk is None:
            return 1
        return degrees[info.chunk] if info.chunk < len(degrees) else 1

    sizes = [degree(info) for _, info, _ in entries]
    if max(sizes, default=1) <= 1:
        return batch
    first: list[int] = []          # old index -> new index of its (member 0's) entry
    n = 0
    for d in sizes:
        first.append(n)
        n += d
    out: list[Entry] = []
    step = 0
    for (key, info, inputs), d in zip(entries, sizes):
        if d == 1:
            out.append((key, info, [first[j] if j >= 0 else j for j in inputs]))
            continue
        gid = gang_id(iteration, step)
        step += 1
        for m in range(d):
            # Member m reads member m of an input step of the same gang size.
            ins = [j if j < 0 else first[j] + m if sizes[j] == d else first[j]
                   for j in inputs]
            out.append((key if m == 0 else member_key(key, m), factory(
                key=key if m == 0 else member_key(key, m), kind=info.kind, pool=info.pool,
                iteration=info.iteration, policy_version=info.policy_version, gpu=info.gpu,
                timestep=info.timestep, chunk=info.chunk, group=info.group,
                behaviour_version=info.behaviour_version, samples=info.samples,
                gang=(gid, m, d)), ins))
    return out, externals


class IterationSource:
    """The batch of each iteration of a run with one layout: built by
    :func:`iteration_nodes` until its shape has been built twice, from the shape's
    template after that."""

    def __init__(self, layout: GraphLayout, factory: type[TaskInfo] = TaskInfo,
                 degrees: Degrees | None = None):
        self.layout = layout
        self.factory = factory
        #: The context-parallel degree of each chunk of a plan (None: every chunk 1).
        self.degrees = degrees
        # The latest shape built once, with its batch (one is kept: a run has few shapes
        # and they come in a row).
        self._first: tuple[Hashable, int, Batch] | None = None
        self._templates: dict[Hashable, IterationTemplate | None] = {}
        self.built = 0           # iterations built by the builders (the rest: templates)

    def batch(self, plan: IterationPlan) -> Batch:
        batch = self._batch(plan)
        if self.degrees is None:
            return batch
        return context_parallel_batch(batch, plan.iteration, self.degrees(plan),
                                      self.factory)

    def _batch(self, plan: IterationPlan) -> Batch:
        shape = iteration_shape(self.layout, plan)
        template = self._templates.get(shape)
        if template is not None:
            return template.batch(plan.iteration, self.factory)
        self.built += 1
        batch = node_batch(iteration_nodes(self.layout, plan), self.factory)
        if shape not in self._templates:
            # (The engine changes only its own and the policy's state of the tasks, not
            # the fields a template is compiled from.)
            if self._first is not None and self._first[0] == shape:
                self._templates[shape] = IterationTemplate.compile(
                    self._first[1:], (plan.iteration, batch))
                self._first = None
            else:
                self._first = (shape, plan.iteration, batch)
        return batch

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

A chunk the plan computes with context parallelism has each ``denoise`` step as a gang
(:mod:`digenrl.graph.structure`, as a run's graph has it); an iteration with gangs gets
no template (its gangs' ids are built per iteration), so the builders make each one.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from digenrl.graph.plan import IterationPlan
from digenrl.graph.structure import GraphLayout, Node, iteration_nodes, iteration_shape
from digenrl.schedulers.policy import TaskInfo
from digenrl.vocabulary import Key

__all__ = ["Entry", "Batch", "node_batch", "IterationTemplate", "IterationSource"]


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


class IterationSource:
    """The batch of each iteration of a run with one layout: built by
    :func:`iteration_nodes` until its shape has been built twice, from the shape's
    template after that."""

    def __init__(self, layout: GraphLayout, factory: type[TaskInfo] = TaskInfo):
        self.layout = layout
        self.factory = factory
        # The latest shape built once, with its batch (one is kept: a run has few shapes
        # and they come in a row).
        self._first: tuple[Hashable, int, Batch] | None = None
        self._templates: dict[Hashable, IterationTemplate | None] = {}
        self.built = 0           # iterations built by the builders (the rest: templates)

    def batch(self, plan: IterationPlan) -> Batch:
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

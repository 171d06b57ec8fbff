"""Iteration templates: the simulator's later iterations are the builders' DAGs shifted."""

import dataclasses

import pytest

from digenrl.graph.plan import IterationPlan
from digenrl.graph.structure import GraphLayout, iteration_nodes
from digenrl.sim.template import IterationSource, IterationTemplate, node_batch

BASE = GraphLayout(num_steps=4, trained_steps=2, reduce_fanin=3)
LAYOUTS = {
    "default": BASE,
    "kl": dataclasses.replace(BASE, kl=True, version_lag=1),
    "stale-groups": dataclasses.replace(BASE, version_lag=2, stale_groups=1),
    "batch-std": dataclasses.replace(BASE, advantage_std="batch", reward_gpu=True,
                                     reduce_fanin=2),
}
PROMPTS = ("cat", "dog", "fox")


def uniform(i):
    return IterationPlan.uniform(i, PROMPTS, 4, 2)


def uneven(i):
    # Chunks of different sizes, one spanning two groups.
    return IterationPlan(i, PROMPTS, 4, ((0, 3), (3, 6), (6, 7), (7, 12)))


def as_data(batch):
    """A batch as comparable data: each task's key, annotation fields and input keys."""
    entries, externals = batch
    keys = [e[0] for e in entries]
    out = []
    for key, info, inputs in entries:
        fields = dataclasses.astuple(info)[:11]   # the annotation, not the policy's state
        out.append((key, fields, [keys[j] if j >= 0 else externals[~j] for j in inputs]))
    return out


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("make_plan", [uniform, uneven])
def test_every_iteration_equals_what_the_builders_make(name, make_plan):
    layout = LAYOUTS[name]
    source = IterationSource(layout)
    for i in range(8):
        plan = make_plan(i)
        assert as_data(source.batch(plan)) == as_data(node_batch(iteration_nodes(layout, plan))), \
            f"iteration {i}"
    # The iterations past the clamped versions came from a template.
    assert source.built <= 2 + layout.version_lag + 1 < 8


def test_two_builds_that_are_not_one_dag_shifted_get_no_template():
    # Iteration 0's optimizer step reads the initial state, iteration 1's reads
    # iteration 0's: not a shift of one another.
    a = node_batch(iteration_nodes(BASE, uniform(0)))
    b = node_batch(iteration_nodes(BASE, uniform(1)))
    assert IterationTemplate.compile((0, a), (1, b)) is None
    # Different chunking: different DAGs.
    c = node_batch(iteration_nodes(BASE, uneven(2)))
    assert IterationTemplate.compile((1, b), (2, c)) is None
    # The same shape two iterations apart: a template that makes any iteration.
    d = node_batch(iteration_nodes(BASE, uniform(3)))
    t = IterationTemplate.compile((1, b), (3, d))
    assert t is not None
    assert as_data(t.batch(7)) == as_data(node_batch(iteration_nodes(BASE, uniform(7))))

"""``digenrl why STORE KEY``: a task's story, from a run's store.

The store's ``tasks`` group holds a record per finished task (:mod:`digenrl.records`),
among its columns the scheduling policy's decisions on the task (``decisions``, written
by the plugin from the policy's decision trail: :mod:`digenrl.schedulers.policy.trail`).
:func:`why` finds a task's records by key and tells its story: its kind, when it became
ready and eligible, was released, started and stopped, which worker ran it, and every
decision with its rule and reason, in order.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from digenrl.schedulers.policy.trail import key_parts, story
from digenrl.store import StoreError, open_run

__all__ = ["why"]

#: How many of the nearest keys an unknown key's message names.
NEAREST = 3


def _distance(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[int, float]:
    """How far key ``b`` is from ``a``: elements that differ, then how much the numbers
    among them differ."""
    if len(a) != len(b):
        return (max(len(a), len(b)) + 1, math.inf)
    differ, by = 0, 0.0
    for x, y in zip(a, b):
        if x != y:
            differ += 1
            try:
                by += abs(float(x) - float(y))
            except ValueError:
                by += 1.0
    return (differ, by)


def _unknown(store: str, key: str, keys: list[str]) -> StoreError:
    """The one-line error for ``key``, not in ``store``, naming the nearest keys."""
    want = key_parts(key)
    same_kind = [k for k in keys if want and key_parts(k)[:1] == want[:1]]
    if not same_kind:
        kinds = sorted({key_parts(k)[0] for k in keys if key_parts(k)})
        return StoreError(f"key: expected the key of a task in {store}, got {key!r}; the "
                          f"store has tasks of kinds {', '.join(kinds) or 'none'}")
    nearest = sorted(set(same_kind), key=lambda k: (_distance(want, key_parts(k)), k))
    return StoreError(f"key: expected the key of a task in {store}, got {key!r}; nearest: "
                      + ", ".join(nearest[:NEAREST]))


def why(store: str | Path, key: str) -> str:
    """The story of task ``key`` in the run at ``store`` (every record of it: a task
    recomputed after a worker loss ran more than once). Times are seconds since the
    run's first task became ready. Raises :class:`StoreError` for a path that is not a
    digenrl store and for a key of no task it holds."""
    store = str(store)
    tasks = open_run(store)["tasks"]
    if "key" not in tasks:
        raise StoreError(f"store: {store!r} holds no task records yet")
    keys = [str(k) for k in tasks["key"].values]
    want = key_parts(key)
    rows = [i for i, k in enumerate(keys) if key_parts(k) == want]
    if not rows:
        raise _unknown(store, key, keys)
    columns = {str(name): tasks[name].values for name in tasks.data_vars}
    ready = columns.get("ready")
    t0 = float(np.nanmin(ready)) if ready is not None and np.isfinite(ready).any() else 0.0
    stories = [story({name: _plain(values[i]) for name, values in columns.items()}, t0)
               for i in rows]
    if len(rows) > 1:
        stories.insert(0, f"{keys[rows[0]]} ran {len(rows)} times (recomputed after a loss)")
    return "\n".join(stories) + "\n(times: seconds since the run's first task became ready)"


def _plain(value):
    """A column's value as a plain Python one (text, number or bool)."""
    return value.item() if isinstance(value, np.generic) else value

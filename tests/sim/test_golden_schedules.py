"""Pinned schedules: every decision the simulator makes on the shipped profiles.

For each shipped profile (its work cut to a quarter of the prompts, so the whole file
runs in seconds) under every benchmark variant, the digest of the sorted
``(key, worker, start)`` records of a short simulation is compared with the digest
pinned in ``golden_schedules.json``. Any change in what runs where and when fails here,
including one that leaves the throughput figures alone. A few extra cases reach the
costs the shipped profiles leave out: a reward scored remotely, a straggler window
inside the short run, a queued hand-over latency.

The digest reads keys, worker names and ``repr`` of the start times (exact for floats),
never the builtin ``hash``, so it is the same in every interpreter whatever
``PYTHONHASHSEED``. A change that alters schedules on purpose re-pins them with
``python tests/sim/test_golden_schedules.py --update`` and says why in its message.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import pytest

from digenrl.variants import VARIANTS
from digenrl.sim.profile import Slowdown, list_profiles, load_profile
from digenrl.sim.simulate import simulate_variants

PINNED = Path(__file__).with_name("golden_schedules.json")
ITERATIONS = 3
#: The fraction of each profile's prompts simulated (workers, speeds and costs stay).
WORK = 4


def _small(name: str):
    p = load_profile(name)
    return dataclasses.replace(p, prompts_per_iteration=max(1, p.prompts_per_iteration // WORK),
                               slowdowns=tuple(dataclasses.replace(s, start=s.start / WORK,
                                                                   stop=s.stop / WORK)
                                               for s in p.slowdowns))


def _cases():
    """(case name, profile, variants, simulate keywords)."""
    cases = [(name, _small(name), tuple(VARIANTS), {}) for name in list_profiles()]
    flux = _small("flux12b-16gpu")
    cases.append(("flux12b-16gpu+remote-reward",
                  dataclasses.replace(flux, costs=dataclasses.replace(flux.costs,
                                                                      reward_on="remote")),
                  ("colocated", "disaggregated", "digenrl"), {}))
    cases.append(("flux12b-16gpu+straggler",
                  dataclasses.replace(flux, slowdowns=(Slowdown("rollout-1", 4.0, 10.0, 60.0),
                                                       Slowdown("trainer-2", 3.0, 30.0, 90.0))),
                  ("colocated", "digenrl", "digenrl-pinned"), {}))
    cases.append(("flux12b-16gpu+queued-latency", flux, ("disaggregated", "digenrl"),
                  {"queued_latency": 0.05, "dispatch_latency": 0.002}))
    return cases


def schedule_digest(records) -> str:
    """sha256 of the sorted lines ``repr(key) worker repr(start)`` of every task run."""
    lines = sorted(f"{r.key!r}\t{r.worker}\t{r.start!r}" for r in records)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def digests() -> dict[str, str]:
    """``case/variant`` -> digest of its schedule, for every case."""
    out = {}
    for case, profile, variants, kw in _cases():
        for variant, report in simulate_variants(profile, variants, ITERATIONS, **kw):
            out[f"{case}/{variant}"] = schedule_digest(report.result.records)
    return out


@pytest.fixture(scope="module")
def computed():
    return digests()


def test_every_shipped_profile_and_variant_is_pinned(computed):
    pinned = json.loads(PINNED.read_text())
    assert sorted(computed) == sorted(pinned), "cases added or removed: re-pin (see above)"


def test_the_schedules_are_the_pinned_ones(computed):
    pinned = json.loads(PINNED.read_text())
    changed = sorted(k for k in pinned if computed.get(k) != pinned[k])
    assert not changed, f"schedules changed: {changed}"


def test_the_digest_sees_one_start_time_moved(computed):
    profile = _small("flux12b-16gpu")
    [(_, report)] = simulate_variants(profile, ["digenrl"], ITERATIONS)
    records = list(report.result.records)
    assert schedule_digest(records) == computed["flux12b-16gpu/digenrl"]
    r = records[len(records) // 2]
    records[len(records) // 2] = r._replace(start=r.start + 1e-9)
    assert schedule_digest(records) != computed["flux12b-16gpu/digenrl"]


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python tests/sim/test_golden_schedules.py --update")
    PINNED.write_text(json.dumps(digests(), indent=1, sort_keys=True) + "\n")
    print(f"pinned {PINNED}")

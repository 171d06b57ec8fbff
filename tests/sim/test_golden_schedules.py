"""Pinned schedules: every decision the simulator makes on the shipped profiles.

For each shipped profile (its work cut to a quarter of the prompts, so the whole file
runs in seconds) under every benchmark variant whose GPUs hold its model (a profile
with a ``model`` section may not fit the co-located design), the digest of the sorted
``(key, worker, start)`` records of a short simulation is compared with the digest
pinned in ``golden_schedules.json``. Any change in what runs where and when fails here,
including one that leaves the throughput figures alone. A few extra cases reach the
costs the shipped profiles leave out: a reward scored remotely, a straggler window
inside the short run, a queued hand-over latency, context-parallel steps (gangs of two
rollout workers).

The digest reads keys, worker names and ``repr`` of the start times (exact for floats),
never the builtin ``hash``, so it is the same in every interpreter whatever
``PYTHONHASHSEED``. Beside the digests, ``golden_schedules.tsv.xz`` holds every pinned
schedule itself (its tasks' start, key and worker, in order of start): a changed
schedule fails with its first differing tasks, pinned and computed side by side, so
what moved is read before anything is re-pinned. A change that alters schedules on
purpose re-pins both with ``python tests/sim/test_golden_schedules.py --update`` and
says in its message why the tasks it names moved.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import lzma
import sys
from pathlib import Path

import pytest

from digenrl.figures.variants import VARIANTS, variant_schedule
from digenrl.sim.profile import ProfileError, Slowdown, list_profiles, load_profile
from digenrl.sim.simulate import simulate_variants

PINNED = Path(__file__).with_name("golden_schedules.json")
#: Each pinned schedule's tasks: a ``# case/variant`` line, then ``start key worker``
#: lines (tab-separated, ``repr`` of the start and the key) in order of start and key.
SCHEDULES = Path(__file__).with_name("golden_schedules.tsv.xz")
#: How many differing tasks a failure shows per changed schedule, and how many schedules.
SHOWN_TASKS, SHOWN_CASES = 3, 4
ITERATIONS = 3
#: The fraction of each profile's prompts simulated (workers, speeds and costs stay).
WORK = 4


def _small(name: str):
    p = load_profile(name)
    return dataclasses.replace(p, prompts_per_iteration=max(1, p.prompts_per_iteration // WORK),
                               slowdowns=tuple(dataclasses.replace(s, start=s.start / WORK,
                                                                   stop=s.stop / WORK)
                                               for s in p.slowdowns))


def _fitting(profile) -> tuple[str, ...]:
    """The benchmark variants whose GPUs hold the profile's model (a co-located variant
    holds both roles on each GPU; a profile without ``model.params`` fits every one)."""
    out = []
    for v in VARIANTS:
        try:
            profile.check_memory(colocated=not variant_schedule(v).options().pools)
        except ProfileError:
            continue
        out.append(v)
    return tuple(out)


def _cases():
    """(case name, profile, variants, simulate keywords)."""
    cases = [(name, p, _fitting(p), {}) for name, p in ((n, _small(n)) for n in list_profiles())]
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
    wan = _small("wan14b-32gpu")
    cases.append(("wan14b-32gpu+context-parallel-2", wan.with_context_parallel(2),
                  ("disaggregated", "digenrl"), {}))
    return cases


def schedule_digest(records) -> str:
    """sha256 of the sorted lines ``repr(key) worker repr(start)`` of every task run."""
    lines = sorted(f"{r.key!r}\t{r.worker}\t{r.start!r}" for r in records)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def schedule_lines(records) -> list[str]:
    """The schedule as ``start key worker`` lines in order of start, then key."""
    ordered = sorted(records, key=lambda r: (r.start, repr(r.key)))
    return [f"{r.start!r}\t{r.key!r}\t{r.worker}" for r in ordered]


def schedules() -> dict[str, list]:
    """``case/variant`` -> the records of its schedule, for every case."""
    return {f"{case}/{variant}": list(report.result.records)
            for case, profile, variants, kw in _cases()
            for variant, report in simulate_variants(profile, variants, ITERATIONS, **kw)}


def read_pinned_schedules() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in lzma.decompress(SCHEDULES.read_bytes()).decode().splitlines():
        if line.startswith("# "):
            out[line[2:]] = current = []
        else:
            current.append(line)
    return out


def _by_key(lines: list[str]) -> dict[str, tuple[int, str]]:
    """Each task's key -> its place in the schedule and its line."""
    return {line.split("\t")[1]: (k, line) for k, line in enumerate(lines)}


def _task(line: str | None) -> str:
    if line is None:
        return "-"
    start, key, worker = line.split("\t")
    return f"{ast.literal_eval(key)[0]} {key} on {worker} at {start}"


def explain(case: str, pinned: list[str], computed: list[str]) -> str:
    """The first tasks (in order of start) that run elsewhere or at another time in two
    schedules of ``case``, or in one of them only, pinned and computed side by side."""
    old, new = _by_key(pinned), _by_key(computed)
    differ = sorted((min(old.get(key, (len(pinned),))[0], new.get(key, (len(computed),))[0]),
                     key) for key in old.keys() | new.keys()
                    if old.get(key, (0, None))[1] != new.get(key, (0, None))[1])
    out = [f"{case}: {len(differ)} tasks differ of {len(pinned)} pinned and "
           f"{len(computed)} computed; the first, in order of start:"]
    for _, key in differ[:SHOWN_TASKS]:
        out.append(f"  pinned:   {_task(old.get(key, (0, None))[1])}")
        out.append(f"  computed: {_task(new.get(key, (0, None))[1])}")
    return "\n".join(out)


@pytest.fixture(scope="module")
def computed():
    return schedules()


def test_every_shipped_profile_and_variant_is_pinned(computed):
    pinned = json.loads(PINNED.read_text())
    assert sorted(computed) == sorted(pinned), "cases added or removed: re-pin (see above)"
    assert sorted(read_pinned_schedules()) == sorted(pinned)


def test_the_schedules_are_the_pinned_ones(computed):
    pinned = json.loads(PINNED.read_text())
    changed = sorted(k for k in pinned
                     if k not in computed or schedule_digest(computed[k]) != pinned[k])
    if changed:
        tasks = read_pinned_schedules()
        shown = [explain(k, tasks[k], schedule_lines(computed.get(k, [])))
                 for k in changed[:SHOWN_CASES]]
        pytest.fail(f"schedules changed: {changed}\n" + "\n".join(shown), pytrace=False)


def test_the_pinned_tasks_are_the_pinned_digests():
    """The stored schedules are the ones the digests were taken of."""
    pinned = json.loads(PINNED.read_text())
    for case, lines in read_pinned_schedules().items():
        digest = hashlib.sha256("\n".join(sorted(
            "\t".join((key, worker, start))
            for start, key, worker in (line.split("\t") for line in lines))).encode())
        assert digest.hexdigest() == pinned[case], case


def test_the_digest_and_the_explanation_see_one_start_time_moved(computed):
    records = list(computed["flux12b-16gpu/digenrl"])
    r = records[len(records) // 2]
    records[len(records) // 2] = moved = r._replace(start=r.start + 1e-9)
    assert schedule_digest(records) != schedule_digest(computed["flux12b-16gpu/digenrl"])
    told = explain("flux12b-16gpu/digenrl", schedule_lines(computed["flux12b-16gpu/digenrl"]),
                   schedule_lines(records))
    assert told.startswith("flux12b-16gpu/digenrl: ")
    assert f"{r.kind} {r.key!r} on {r.worker} at {r.start!r}" in told
    assert f"{r.kind} {r.key!r} on {r.worker} at {moved.start!r}" in told


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python tests/sim/test_golden_schedules.py --update")
    found = schedules()
    PINNED.write_text(json.dumps({k: schedule_digest(v) for k, v in found.items()},
                                 indent=1, sort_keys=True) + "\n")
    text = "".join(f"# {k}\n" + "".join(line + "\n" for line in schedule_lines(found[k]))
                   for k in sorted(found))
    SCHEDULES.write_bytes(lzma.compress(text.encode(), preset=9 | lzma.PRESET_EXTREME))
    print(f"pinned {PINNED} and {SCHEDULES}")

"""Process settings (digenrl.process), each checked in a fresh interpreter: freezing
the collector is process-wide and happens once."""

from __future__ import annotations

import json
import subprocess
import sys

_FREEZE = """
import gc, json
from digenrl.process import freeze_collector

def cycle():
    # ten lists in a ring, garbage once this returns
    ring = [[] for _ in range(10)]
    for a, b in zip(ring, ring[1:] + ring[:1]):
        a.append(b)

held = [[i] for i in range(50_000)]          # long-lived objects, as imports leave
cycle()
frozen = freeze_collector()
tracked = len(gc.get_objects())
again = freeze_collector()

cycle()                                      # garbage made after the freeze
print(json.dumps({"frozen": frozen, "tracked": tracked, "again": again,
                  "collected": gc.collect(), "held": len(held)}))
"""


def test_the_freeze_keeps_start_up_objects_out_of_full_passes_and_later_garbage_in():
    out = subprocess.run([sys.executable, "-c", _FREEZE], capture_output=True, text=True,
                         check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    # What the process held is frozen (the 50,000 lists among it) and no full pass walks
    # it: the collector tracks next to nothing right after.
    assert r["frozen"] >= 50_000
    assert r["tracked"] < 1_000
    # A second call freezes nothing more.
    assert r["again"] == r["frozen"]
    # A cycle made after the freeze is still collected (its 10 lists).
    assert r["collected"] >= 10
    assert r["held"] == 50_000

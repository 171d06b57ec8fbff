"""The scheduling switches: each declared once, everything else derived from it."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from digenrl.cli import build_parser, config_from_args
from digenrl.config import ConfigError, ScheduleConfig, reference_markdown
from digenrl.schedulers.options import MODES, ScheduleOptions
from digenrl.schedulers.switches import MODE_NAMES, SWITCHES, Switch, declare

#: A module declaring one more switch, as a project adding one would (imported before
#: the options are built).
EXTRA = '''
from digenrl.schedulers.switches import MODE_NAMES, Switch, declare

declare(Switch("warp", bool, title="warp drive", modes=dict(zip(MODE_NAMES, (False, False, True))),
               fixed={"colocated": "there is no warp core"},
               help="Warp drive: every task arrives before it leaves."))
declare(Switch("warp_factor", int, title="the warp factor", low=1, high=9,
               modes=dict(zip(MODE_NAMES, (1, 2, 9))), help="How fast the warp drive runs."))
'''

#: What the subprocess reports about the declared switches, through the real command
#: line, config, options, modes and configuration reference.
PROBE = '''
import contextlib, io, json
import extra_switches  # the declarations come first
from digenrl.cli import build_parser, config_from_args, main
from digenrl.config import ConfigError, load_config, reference_markdown
from digenrl.schedulers.options import MODES

def options(*argv):
    o = config_from_args(build_parser().parse_args(["run", "--out", "x.zarr", *argv]))
    return o.schedule.options().as_dict()

def error(overrides):
    try:
        load_config(None, overrides)
    except ConfigError as e:
        return str(e)

def run_help():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(["run", "--help"])
    return out.getvalue()

reference = [line for line in reference_markdown().splitlines()
             if line.startswith(("| `warp`", "| `warp_factor`"))]
print(json.dumps({
    "modes": MODES,
    "default": options(),
    "flags": options("--no-warp", "--warp-factor", "3"),
    "colocated": options("--mode", "colocated"),
    "help": run_help(),
    "reference": reference,
    "bad_value": error({"schedule.warp_factor": 10}),
    "fixed": error({"schedule.mode": "colocated", "schedule.warp": True}),
}))
'''


def probe(tmp_path) -> dict:
    (tmp_path / "extra_switches.py").write_text(EXTRA)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_declared_switch_reaches_the_modes_the_config_the_flags_and_the_reference(tmp_path):
    seen = probe(tmp_path)
    assert [seen["modes"][m]["warp"] for m in MODE_NAMES] == [False, False, True]
    assert [seen["modes"][m]["warp_factor"] for m in MODE_NAMES] == [1, 2, 9]
    # The mode's value unless a flag or the config sets it.
    assert (seen["default"]["warp"], seen["default"]["warp_factor"]) == (True, 9)
    assert (seen["flags"]["warp"], seen["flags"]["warp_factor"]) == (False, 3)
    assert (seen["colocated"]["warp"], seen["colocated"]["warp_factor"]) == (False, 1)
    assert "--warp, --no-warp" in seen["help"] and "switch warp drive on or off" in seen["help"]
    assert "--warp-factor INT" in seen["help"] and "the warp factor" in seen["help"]
    warp, factor = seen["reference"]
    assert warp.startswith("| `warp` | `bool \\| None` | `null` | Warp drive: every task") \
        and "(colocated false, disaggregated false, digenrl true)" in warp
    assert factor.startswith("| `warp_factor` | `int \\| None` | `null` | How fast") \
        and "(colocated 1, disaggregated 2, digenrl 9)" in factor
    assert seen["bad_value"] == ("schedule.warp_factor: expected an integer from 1 to 9 or "
                                 "null, got 10")
    assert seen["fixed"] == ("schedule.warp: expected false or null in colocated mode "
                             "(schedule.mode; there is no warp core), got True")


def test_the_declared_switches_are_what_this_process_uses():
    """Without extra declarations: the options and the config have a field per switch,
    and no switch exists in one place only."""
    options = {f.name for f in dataclasses.fields(ScheduleOptions)}
    config = {f.name for f in dataclasses.fields(ScheduleConfig)}
    assert options == {"mode"} | {s.name for s in SWITCHES.values() if s.scheduling}
    assert config == {"mode"} | {s.name for s in SWITCHES.values() if s.configurable}
    assert set(MODES) == set(MODE_NAMES)
    for mode, preset in MODES.items():
        assert preset == {s.name: s.modes[mode] for s in SWITCHES.values() if s.preset}
        ScheduleOptions(mode=mode, **preset)  # a preset is a complete set of options
    reference = reference_markdown()
    for name in config:
        assert f"| `{name}` |" in reference
    # Every mode preset the config sets has its flag, and the flag sets it.
    for s in SWITCHES.values():
        if s.preset and s.configurable:
            value = {bool: True, int: 1, float: 1.5}[s.type]
            argv = [s.flag] if s.type is bool else [s.flag, str(value)]
            cfg = config_from_args(build_parser().parse_args(
                ["run", "--out", "x.zarr", "--mode", "disaggregated", *argv]))
            assert getattr(cfg.schedule, s.name) == value, s.name


def test_the_existing_flags_still_set_the_switches():
    args = build_parser().parse_args(["run", "--out", "x.zarr", "--mode", "disaggregated",
                                      "--max-staleness", "2", "--rebalance", "--no-rat",
                                      "--tsp"])
    o = config_from_args(args).schedule.options()
    assert (o.mode, o.max_staleness, o.rebalance, o.rat, o.tsp, o.gap, o.pools) == (
        "disaggregated", 2, True, False, True, False, True)


def test_declaring_after_the_options_are_built_is_refused():
    with pytest.raises(RuntimeError, match="declared after digenrl.schedulers.options built"):
        declare(Switch("late", bool, title="late", help="Too late.",
                       modes=dict.fromkeys(MODE_NAMES, False)))
    assert "late" not in SWITCHES


@pytest.mark.parametrize("bad, message", [
    (dict(modes={"colocated": True}), "modes: expected a value for each of"),
    (dict(modes=dict.fromkeys(MODE_NAMES, True), title=""), "title: expected the words"),
    (dict(fixed={"colocated": "why"}), "fixed: expected modes of a mode preset"),
])
def test_a_switch_declared_wrong_says_what_is_missing(bad, message):
    with pytest.raises(ValueError, match=message):
        Switch(**{"name": "odd", "type": bool, "help": "Odd.", **bad})


def test_bad_switch_values_name_the_field():
    with pytest.raises(ConfigError, match=r"^schedule.gap: expected true, false or null, "
                                          r"got 'yes'$"):
        ScheduleConfig(gap="yes").validate()
    with pytest.raises(ConfigError, match=r"^schedule.slots_per_worker: expected an integer "
                                          r">= 1, got 0$"):
        ScheduleConfig(slots_per_worker=0).validate()
    with pytest.raises(ConfigError, match=r"^schedule.max_staleness: expected 0 or null in "
                                          r"colocated mode"):
        ScheduleConfig(mode="colocated", max_staleness=1).validate()

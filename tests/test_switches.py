"""The scheduling switches: each declared once, everything else derived from it."""

import dataclasses
import os
import subprocess
import sys

import pytest

from digenrl.commands.cli import build_parser, config_from_args
from digenrl.config import ConfigError, ScheduleConfig, reference_markdown
from digenrl.schedulers.options import MODES, ScheduleOptions, check_fields
from digenrl.schedulers.switches import MODE_NAMES, SWITCHES, Switch, declare

#: A module declaring one more switch, as a change adding one starts (imported before
#: the options): without its fields, importing the options refuses it.
EXTRA = '''
from digenrl.schedulers.switches import MODE_NAMES, Switch, declare

declare(Switch("warp", bool, title="warp drive", modes=dict(zip(MODE_NAMES, (False, False, True))),
               help="Warp drive: every task arrives before it leaves."))
'''


def test_a_switch_declared_without_its_fields_is_refused_on_import(tmp_path):
    (tmp_path / "extra_switches.py").write_text(EXTRA)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", "import extra_switches, digenrl.config"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().endswith(
        "TypeError: ScheduleOptions: expected a field warp: <class 'bool'> for the "
        "declared switch warp, got none"), done.stderr


def test_the_fields_check_names_a_wrong_type_default_or_extra_field():
    """check_fields, which importing the options and the config runs on their classes."""
    switch = Switch("speed", int, default=3, low=1, help="How fast.")

    def check(cls):
        check_fields(cls, (switch,), field_type=lambda s: s.type,
                     field_default=lambda s: s.default)

    @dataclasses.dataclass
    class Right:
        mode: str
        speed: int = 3

    @dataclasses.dataclass
    class WrongType:
        mode: str
        speed: float = 3

    @dataclasses.dataclass
    class WrongDefault:
        mode: str
        speed: int = 4

    @dataclasses.dataclass
    class Extra:
        mode: str
        speed: int = 3
        other: bool = False

    check(Right)
    with pytest.raises(TypeError, match=r"^WrongType.speed: expected the type <class 'int'> "
                                        r"of its switch, got <class 'float'>$"):
        check(WrongType)
    with pytest.raises(TypeError, match=r"^WrongDefault.speed: expected the default 3 of its "
                                        r"switch, got 4$"):
        check(WrongDefault)
    with pytest.raises(TypeError, match=r"^Extra: expected a declared switch for each field, "
                                        r"got \['other'\] without one$"):
        check(Extra)


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

"""Bad input, fuzzed: every config and command line either runs or fails before any
work, in one line naming the field.

Hypothesis mutates the small config (wrong types, out-of-range values, unknown keys,
sections that are not mappings) and builds command lines from the run flags and
``--set`` overrides; each goes through ``digenrl run --check``, which validates exactly
what a run validates before it starts a cluster. An accepted config must print as YAML
that loads back to itself and give task graphs the driver accepts; a rejected one must
end with exit status 2 and one ``digenrl run: error:`` line naming a field that was
changed, with no traceback.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import os
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from digenrl.commands.cli import main
from digenrl.checks import sub_path
from digenrl.config import ConfigError, RunConfig, config_from_dict, config_to_dict
from digenrl.graph.build import GraphContext
from digenrl.graph.structure import rollout_nodes, train_nodes
from digenrl.run.runner import RLWorkload
from digenrl.schedulers.policy import TaskInfo, validate_task

from conftest import SMALL, pipeline_config, small_config

#: Every field of the small config, explicit.
BASE = config_to_dict(small_config())
SECTIONS = [k for k, v in BASE.items() if isinstance(v, dict)]
FIELDS = [f"{s}.{f}" for s in SECTIONS for f in BASE[s]] + [
    k for k, v in BASE.items() if not isinstance(v, dict)]

WEIRD = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70),
    st.sampled_from([2 ** 31, -(2 ** 40), 10 ** 30]),
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.text(max_size=8),
    st.sampled_from(["auto", "1e-3", "4GiB", "lots", ":0", ":99999", "tcp://127.0.0.1:1",
                     "nowhere", "colocated", "digenrl", "drop", "batch", "clip",
                     "simple_animals", ".", "/no/such/folder"]),
    st.lists(st.integers(-1, 40), max_size=4),
    st.lists(st.text(max_size=5), max_size=3),
    st.dictionaries(st.text(max_size=6), st.floats(allow_nan=True), max_size=2),
)


def leading_field(message: str) -> str:
    return message.split(": ", 1)[0]


def names_a_changed_field(message: str, changed: set[str]) -> bool:
    """The message's field is one that was changed, the section or a part of one, or
    the message names a changed field (a check that ties two fields together)."""
    field = leading_field(message)
    return any(n == field or n.startswith(field + ".") or field.startswith(n + ".")
               or field.startswith(n + "[") or n in message or repr(n) in message
               for n in changed)


def assert_runnable_before_work(cfg: RunConfig) -> None:
    """What an accepted config must get through before any cluster work: its step
    sizes, and the first iterations' graphs as the driver checks them."""
    ctx = GraphContext.from_config(cfg)
    sigmas = ctx.rollout.sigmas
    assert all(math.isfinite(s) for s in sigmas) and list(sigmas) == sorted(sigmas, reverse=True)
    if cfg.denoise_tasks_per_iteration > 2_000:
        return  # valid, merely large: building its graphs here would only take long
    w = RLWorkload(cfg)
    options = cfg.schedule.options()
    for i in range(min(cfg.iterations, 3)):
        plan = w.plan(i)
        for node in rollout_nodes(w.layout, plan) + train_nodes(w.layout, plan):
            assert validate_task(TaskInfo.from_meta(node.key, node.meta), options) is None


def run_check(argv: list[str]) -> tuple[int, str, str]:
    """``digenrl run --check ...``: exit status, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["run", "--check", *argv])
        except SystemExit as e:  # argparse refusing a flag's value
            code = e.code
    return code, out.getvalue(), err.getvalue()


def assert_one_line_naming(code: int, out: str, err: str, changed: set[str]) -> None:
    assert code == 2, (code, err)
    assert "Traceback" not in err, err
    [line] = [x for x in err.splitlines() if "error:" in x]
    assert line.startswith("digenrl run: error: "), line
    message = line[len("digenrl run: error: "):]
    if message.startswith("argument "):  # argparse names the flag
        message = message[len("argument "):]
    assert names_a_changed_field(message, changed), (message, changed)


def assert_accepted(out: str) -> RunConfig:
    printed = yaml.safe_load(out)
    cfg = config_from_dict(printed)
    assert config_to_dict(cfg) == printed
    assert_runnable_before_work(cfg)
    return cfg


# ---------------------------------------------------------------------- configs

mutations = st.lists(st.one_of(
    st.tuples(st.just("set"), st.sampled_from(FIELDS), WEIRD),
    st.tuples(st.just("unknown"), st.sampled_from(["", *SECTIONS]),
              st.text(min_size=1, max_size=8)),
    st.tuples(st.just("section"), st.sampled_from(SECTIONS),
              WEIRD.filter(lambda v: not isinstance(v, dict) and v is not None)),
), min_size=1, max_size=3)

_counter = itertools.count()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=mutations)
def test_fuzzed_configs_run_or_fail_naming_the_field(folder, changes):
    data = yaml.safe_load(yaml.safe_dump(BASE))
    changed: set[str] = set()
    for kind, where, value in changes:
        if kind == "set":
            section, _, name = where.rpartition(".")
            node = data if not section else data.get(section)
            if not isinstance(node, dict):
                continue  # an earlier change replaced the section
            node[name] = value
        elif kind == "unknown":
            node = data if not where else data.get(where)
            valid = set(BASE if not where else BASE[where])
            if not isinstance(node, dict) or value in valid:
                continue
            node[value] = 1
            where = sub_path(where, value)  # how the config names a key
        else:
            data[where] = value
        changed.add(where)
    path = folder / f"config-{os.getpid()}-{next(_counter)}.yaml"
    path.write_text(yaml.safe_dump(data))
    code, out, err = run_check([str(path)])
    if code == 0:
        assert_accepted(out)
    else:
        assert_one_line_naming(code, out, err, changed | {"config"})


# ------------------------------------------------------------------ command lines

YAML_VALUES = st.one_of(
    st.sampled_from(["1", "-1", "0", "2", "2.5", "3e-4", ".nan", ".inf", "true", "null",
                     "[8, 16]", "{a: 1}", "abc", "'4GiB'", "[", "colocated", "drop", "''"]),
    st.text(max_size=6))

FLAGS = {
    "--mode": (st.sampled_from(["colocated", "disaggregated", "digenrl", "fast", ""]),
               "schedule.mode"),
    "--iterations": (st.one_of(st.integers(-2, 5).map(str), st.text(max_size=3)), "iterations"),
    "--seed": (st.one_of(st.integers(-2, 2 ** 70).map(str), st.text(max_size=3)), "seed"),
    "--rollout-workers": (st.integers(-1, 3).map(str), "cluster.rollout_workers"),
    "--trainer-workers": (st.integers(-1, 3).map(str), "cluster.trainer_workers"),
    "--max-staleness": (st.integers(-2, 10).map(str), "schedule.max_staleness"),
    "--reward": (st.sampled_from(["jpeg_compressibility", "brightness=2,colorfulness=0.5",
                                  "nope", "a=b", ",", "brightness=nan", ""]),
                 "reward.components"),
    "--scheduler": (st.sampled_from(["tcp://127.0.0.1:1", "nowhere", "abc:xyz", "127.0.0.1:1"]),
                    "cluster.scheduler"),
}
SWITCHES = {"--gpus": "cluster.gpus", "--gap": "schedule.gap", "--no-gap": "schedule.gap",
            "--tsp": "schedule.tsp", "--no-tsp": "schedule.tsp", "--tag": "schedule.tag",
            "--no-tag": "schedule.tag"}


@st.composite
def command_lines(draw):
    argv: list[str] = []
    changed: set[str] = set()
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flag", "switch", "set", "set-raw"]))
        if kind == "flag":
            flag = draw(st.sampled_from(sorted(FLAGS)))
            values, field = FLAGS[flag]
            argv += [flag, draw(values)]
            changed |= {flag, field}
        elif kind == "switch":
            flag = draw(st.sampled_from(sorted(SWITCHES)))
            argv.append(flag)
            changed |= {flag, SWITCHES[flag]}
        elif kind == "set":
            field = draw(st.one_of(st.sampled_from(FIELDS),
                                   st.text(alphabet="abcxyz.", min_size=1, max_size=8)))
            argv += ["--set", f"{field}={draw(YAML_VALUES)}"]
            changed |= {"--set", field}
        else:
            raw = draw(st.text(max_size=8))
            argv += ["--set", raw]
            key = raw.partition("=")[0].strip()
            changed |= {"--set", key} if key else {"--set"}
    return argv, changed


@pytest.fixture(scope="module")
def small_yaml(folder) -> Path:
    path = folder / "small.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    return path


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(line=command_lines())
def test_fuzzed_command_lines_run_or_fail_naming_the_field(small_yaml, line):
    argv, changed = line
    code, out, err = run_check([str(small_yaml), *argv])
    if code == 0:
        assert_accepted(out)
    else:
        assert_one_line_naming(code, out, err, changed)


def test_check_starts_no_cluster_and_prints_the_resolved_config(small_yaml, tmp_path):
    # The scheduler named does not exist: a run would fail to connect; --check does not.
    code, out, err = run_check([str(small_yaml), "--scheduler", "tcp://127.0.0.1:1",
                                "--out", str(tmp_path / "new.zarr"), "--iterations", "7"])
    assert code == 0, err
    cfg = assert_accepted(out)
    assert cfg == small_config(**{"iterations": 7, "cluster.scheduler": "tcp://127.0.0.1:1"})
    assert not (tmp_path / "new.zarr").exists()
    # ... and it checks the store as a run would, before any work.
    (tmp_path / "taken.zarr").mkdir()
    code, _, err = run_check([str(small_yaml), "--out", str(tmp_path / "taken.zarr")])
    assert code == 2 and "out: expected a path that does not exist yet" in err


@pytest.mark.parametrize("sets,changed", [
    (["algorithm.name=diffusion_nft", "algorithm.dynamics=cps"], {"algorithm.dynamics"}),
    (["algorithm.sde_steps=[0,1,2,3,4,5,6,7,8]"], {"algorithm.sde_steps"}),
    (["algorithm.name=dpo", "data.samples_per_prompt=1"], {"data.samples_per_prompt"}),
    (["algorithm.name=awm", "algorithm.guard=true"], {"algorithm.guard"}),
])
def test_a_wrong_algorithm_combination_is_refused_in_one_line(small_yaml, sets, changed):
    """Before any cluster: the scheduler named does not exist, and the refusal comes
    first, naming the field."""
    argv = [str(small_yaml), "--scheduler", "tcp://127.0.0.1:1"]
    for s in sets:
        argv += ["--set", s]
    assert_one_line_naming(*run_check(argv), changed)


def test_bad_source_images_and_editing_prompts_fail_naming_file_and_line(small_yaml,
                                                                         tiny_pipelines,
                                                                         tmp_path):
    """A missing source image, one that does not decode, image lines for a model that
    edits none, a source area for it, and a Qwen-Image-Edit folder without image lines:
    each one line naming the field (and the file and line) from ``digenrl run --check``, before any cluster
    starts."""
    from conftest import source_picture, write_prompt_lines

    (tmp_path / "broken.png").write_bytes(b"not a picture")
    good = {"prompt": "make it red", "image": source_picture(16, 16, 0)}
    cases = {
        "missing": ([good, {"prompt": "make it blue", "image": "gone.png"}],
                    r"line 2 of .*: expected an existing image file at 'gone.png', got "
                    r".*gone.png \(No such file or directory\)"),
        "broken": ([{"prompt": "make it blue", "image": "../broken.png"}],
                   r"line 1 of .*: expected an image PIL decodes at '../broken.png', got "
                   r".*broken.png \(not an image format PIL reads\)"),
        "not-editing": ([{"prompt": "a cat"}, good],
                        r"line 2 of .*: expected no source image for the built-in model "
                        r"\(it does not edit images\), got 1"),
    }
    for name, (lines, message) in cases.items():
        path = write_prompt_lines(tmp_path / name, lines)
        code, out, err = run_check([str(small_yaml), "--set", f"data.prompt_file={path}"])
        assert_one_line_naming(code, out, err, {"data.prompt_file"})
        assert re.search("data.prompt_file: " + message + "$", err.strip()), (name, err)

    # A source area for a model that edits no images, and one of no pixels.
    for area, message in (("4096", r"expected null for the built-in model \(it does not "
                                   r"edit images\), got 4096"),
                          ("0", r"expected an integer >= 1, got 0")):
        code, out, err = run_check([str(small_yaml), "--set", f"model.source_area={area}"])
        assert_one_line_naming(code, out, err, {"model.source_area"})
        assert re.search("model.source_area: " + message + "$", err.strip()), (area, err)

    # (A pipeline folder's config: the small YAML's tiny-model sizes do not go with it.)
    plain = write_prompt_lines(tmp_path / "plain", [{"prompt": "make it red"}])
    with pytest.raises(ConfigError, match=r"^data.prompt_file: expected lines that name "
                                          r"source images \(\"image\"\) for a "
                                          r"QwenImageEditPipeline folder, which edits "
                                          r"images, got .*plain/prompts.jsonl without any$"):
        pipeline_config(tiny_pipelines["qwenimage_edit"], "qwenimage_edit",
                        **{"data.prompt_file": plain})

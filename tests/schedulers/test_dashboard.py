"""The digenrl page of the Dask dashboard, loaded in headless Chromium (with a task's
story); the task stream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from digenrl.run.cluster import start_cluster
from digenrl.config import ClusterConfig
from digenrl.run.runner import Runner
from digenrl.schedulers.palette import KIND_COLOURS

from chromium import CHROMIUM, INSTALL_HINT, Browser
from conftest import small_config

ARTEFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
KINDS = ("denoise", "decode", "reward", "advantage", "grad", "reduce", "optimize")

READY = """(() => {
  if (!window.Bokeh || !Bokeh.documents.length) return null;
  const doc = Bokeh.documents[0];
  const status = doc.get_model_by_name('digenrl-status');
  const pools = doc.get_model_by_name('digenrl-pools');
  const reward = doc.get_model_by_name('digenrl-reward');
  if (!status || !status.text.includes('policy version')) return null;
  // Bokeh 3 renders into shadow roots: count the page's views laid out with a size.
  const views = Bokeh.index.all_views ? [...Bokeh.index.all_views()] : [];
  const rendered = views.filter(v => (v.model.name || '').startsWith('digenrl-')
    && v.el.getBoundingClientRect().width > 0 && v.el.getBoundingClientRect().height > 0)
    .map(v => v.model.name);
  return JSON.stringify({status: status.text, pools: pools.source.data,
                         rewards: reward.renderers.length, rendered: rendered});
})()"""


@pytest.fixture(scope="module")
def dashboard_run(tmp_path_factory):
    from distributed import get_task_stream

    handle = start_cluster(ClusterConfig(dashboard_address="127.0.0.1:0"))
    try:
        # As the dashboard's task stream does, this installs the task-stream plugin.
        with get_task_stream(client=handle.client):
            Runner(small_config(**{"iterations": 2}),
                   str(tmp_path_factory.mktemp("d") / "r.zarr"), cluster=handle).run()
        yield handle
    finally:
        handle.close()


@pytest.mark.skipif(CHROMIUM is None, reason=INSTALL_HINT)
def test_the_digenrl_page_renders_pools_and_policy_version(dashboard_run):
    link = dashboard_run.dashboard_link
    assert link
    base = link.rsplit("/", 1)[0]
    browser = Browser()
    try:
        seen = browser.visit(f"{base}/digenrl", READY)
    finally:
        browser.close()
    ARTEFACTS.mkdir(exist_ok=True)
    (ARTEFACTS / "dashboard-digenrl.png").write_bytes(seen["png"])
    assert seen["value"], f"the page never showed the run (errors: {seen['errors']})"
    page = json.loads(seen["value"])
    assert "policy version</b> 2" in page["status"]
    assert sorted(page["pools"]["pool"]) == ["rollout", "trainer"]
    assert page["pools"]["workers"] == [1, 1]
    for name in ("root", "status", "pools", "utilisation", "held", "staleness", "reward"):
        assert f"digenrl-{name}" in page["rendered"], (name, page["rendered"])
    assert seen["errors"] == []
    assert seen["png"][:8] == b"\x89PNG\r\n\x1a\n" and len(seen["png"]) > 20_000


STORY = """(() => {
  if (!window.Bokeh || !Bokeh.documents.length) return null;
  const why = Bokeh.documents[0].get_model_by_name('digenrl-why');
  const key = Bokeh.documents[0].get_model_by_name('digenrl-why-key');
  return why && why.text.includes('grad of iteration')
    ? JSON.stringify({text: why.text, key: key.value}) : null;
})()"""


@pytest.mark.skipif(CHROMIUM is None, reason=INSTALL_HINT)
def test_the_page_tells_the_story_of_a_task_named_in_its_address(dashboard_run):
    base = dashboard_run.dashboard_link.rsplit("/", 1)[0]
    browser = Browser()
    try:
        seen = browser.visit(f"{base}/digenrl?key=grad,1,0,0", STORY)
    finally:
        browser.close()
    assert seen["value"], f"the page never told the story (errors: {seen['errors']})"
    page = json.loads(seen["value"])
    assert page["key"] == "grad,1,0,0"
    assert "(&#x27;grad&#x27;, 1, 0, 0): grad of iteration 1" in page["text"]
    assert any(f"{verb} to " in page["text"] for verb in ("released", "lent"))
    assert seen["errors"] == []


def test_a_story_is_told_for_a_waiting_task_a_finished_one_and_none_for_a_stranger():
    from digenrl.schedulers.dashboard import task_story
    from digenrl.schedulers.options import MODES, ScheduleOptions
    from digenrl.schedulers.plugin import DigenRLSchedulerPlugin
    from digenrl.schedulers.policy import SchedulingPolicy, TaskInfo

    plugin = DigenRLSchedulerPlugin()     # (not started: no scheduler is needed here)
    plugin.policy = p = SchedulingPolicy(ScheduleOptions(mode="digenrl", **MODES["digenrl"]))
    p.add_worker("r0", "rollout-0", "rollout", 1)
    p.version = 0
    waiting = TaskInfo(("denoise", 3, 0, 0), "denoise", "rollout", 3, 2, True, timestep=0,
                       chunk=0)
    p.add_tasks([waiting])
    p.task_ready(waiting.key)
    text = task_story(plugin, "denoise,3,0,0")
    assert text.splitlines()[:2] == ["('denoise', 3, 0, 0): denoise of iteration 3 (policy "
                                     "version 2)", "  now held"]
    assert "held: staleness -- iteration 3 waits for version 2 (published: 0)" in text
    plugin.telemetry.recent["('grad', 0, 0, 0)"] = {
        "key": "('grad', 0, 0, 0)", "kind": "grad", "iteration": 0, "policy_version": 0,
        "worker_name": "trainer-0", "decisions": ""}
    assert task_story(plugin, "(grad, 0, 0, 0)").startswith(
        "('grad', 0, 0, 0): grad of iteration 0 (policy version 0)\n  ran on trainer-0")
    assert task_story(plugin, "grad,7,0,0") == (
        "grad,7,0,0: no such task among those the scheduler holds or the last 1 that "
        "finished")


@pytest.mark.skipif(CHROMIUM is None, reason=INSTALL_HINT)
def test_the_page_is_in_the_dashboard_navigation(dashboard_run):
    from urllib.request import urlopen

    base = dashboard_run.dashboard_link.rsplit("/", 1)[0]
    status_html = urlopen(f"{base}/status").read().decode()
    assert 'href="digenrl"' in status_html


def test_task_stream_shows_each_kind_in_its_own_colour(dashboard_run):
    def stream(dask_scheduler):
        from distributed.diagnostics.task_stream import rectangles

        plugin = dask_scheduler.plugins["task-stream"]
        rect = rectangles(list(plugin.buffer))
        return list(zip(rect["name"], rect["color"]))

    pairs = dashboard_run.client.run_on_scheduler(stream)
    colours = {}
    for name, colour in pairs:
        kind = name.split("-")[0] if "-" in name else name
        colours.setdefault(kind, set()).add(colour)
    for kind in KINDS:
        assert colours.get(kind) == {KIND_COLOURS[kind]}, (kind, colours.get(kind))
    assert len({KIND_COLOURS[k] for k in KINDS}) == len(KINDS)


def test_every_task_kind_has_a_colour_of_its_own():
    from digenrl.vocabulary import KINDS as ALL_KINDS

    assert set(ALL_KINDS) <= set(KIND_COLOURS)
    assert len({KIND_COLOURS[k] for k in ALL_KINDS}) == len(ALL_KINDS)

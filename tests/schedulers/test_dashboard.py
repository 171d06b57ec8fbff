"""The digenrl page of the Dask dashboard, loaded in headless Chromium; the task stream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from digenrl.cluster import start_cluster
from digenrl.config import ClusterConfig
from digenrl.runner import Runner
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

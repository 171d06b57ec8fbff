"""The ``digenrl`` page of the Dask dashboard (Bokeh, like the dashboard's own pages).

It shows, updating live: the run and its schedule, the current policy version, the
workers of each pool and what they are doing, pool utilisation and trainer-assisted
generation over time, the tasks held back and why, the staleness of the samples trained
so far, and the reward curve; and, for a task key typed in (``/digenrl?key=...``
fills it in), the task's story: the policy's decisions on it with their rules and
reasons (:func:`task_story`, what ``digenrl why`` prints from a store). :func:`install` adds the page to a running scheduler's
dashboard (and its navigation bar), so it works whether the plugin was preloaded into
``dask scheduler`` or registered by ``digenrl run``.
"""

from __future__ import annotations

import html
import logging
import weakref
from functools import partial
from typing import Any

from digenrl.schedulers.palette import KIND_COLOURS
from digenrl.schedulers.policy import HELD_REASONS
from digenrl.schedulers.policy.trail import key_parts, story, trail_text
from digenrl.vocabulary import COLOCATED, ROLLOUT, TRAINER

__all__ = ["install", "ROUTE", "DigenRLPage", "task_story"]

logger = logging.getLogger(__name__)

ROUTE = "/digenrl"
#: The reward curve's column in the page's data source (each iteration's mean reward).
REWARD_CURVE = "reward"
POOL_COLOURS = {ROLLOUT: "#1f77b4", TRAINER: "#d62728", COLOCATED: "#9467bd"}


class DigenRLPage:
    """The Bokeh models of the page and their update from the plugin's state."""

    def __init__(self, scheduler, plugin_name: str = "digenrl", key: str = ""):
        from bokeh.layouts import column, row
        from bokeh.models import ColumnDataSource, FactorRange, Range1d
        from bokeh.models.widgets import DataTable, Div, TableColumn, TextInput
        from bokeh.plotting import figure

        self.scheduler = scheduler
        self.plugin_name = plugin_name
        self.status = Div(name="digenrl-status", sizing_mode="stretch_width")
        self.pools_source = ColumnDataSource({"pool": [], "workers": [], "busy": [],
                                              "tag": [], "rat": [], "slots": []})
        self.pools = DataTable(
            source=self.pools_source, name="digenrl-pools", height=110, width=420,
            index_position=None,
            columns=[TableColumn(field="pool", title="pool"),
                     TableColumn(field="workers", title="workers"),
                     TableColumn(field="busy", title="busy GPUs"),
                     TableColumn(field="tag", title="TAG (trainers generating)"),
                     TableColumn(field="rat", title="RAT (rollout workers training)"),
                     TableColumn(field="slots", title="task slots")])
        self.util_source = ColumnDataSource({"time": []})
        self.util = figure(title="pool utilisation (busy GPUs / GPUs), TAG and RAT", height=260,
                           sizing_mode="stretch_width", x_axis_type="datetime",
                           y_range=Range1d(start=0, end=1.05), name="digenrl-utilisation",
                           tools="")
        self.util_lines: set[str] = set()
        self.held_source = ColumnDataSource({"reason": list(HELD_REASONS),
                                             "tasks": [0] * len(HELD_REASONS)})
        self.held = figure(title="tasks ready but held, by reason", height=240, width=380,
                           x_range=FactorRange(factors=list(HELD_REASONS)), name="digenrl-held",
                           tools="")
        self.held.vbar(x="reason", top="tasks", width=0.7, source=self.held_source,
                       color="#ff7f0e")
        self.stale_source = ColumnDataSource({"staleness": [], "samples": []})
        self.stale = figure(title="staleness of trained samples", height=240, width=380,
                            name="digenrl-staleness", tools="")
        self.stale.vbar(x="staleness", top="samples", width=0.7, source=self.stale_source,
                        color="#9467bd")
        self.stale.xaxis.axis_label = "trained version - behaviour version"
        self.reward_source = ColumnDataSource({"iteration": [], REWARD_CURVE: []})
        self.reward = figure(title="reward (mean per iteration)", height=240,
                             sizing_mode="stretch_width", name="digenrl-reward", tools="")
        self.reward.line(x="iteration", y=REWARD_CURVE, source=self.reward_source, line_width=2,
                         color="#2ca02c")
        self.reward.scatter(x="iteration", y=REWARD_CURVE, source=self.reward_source, size=5,
                            color="#2ca02c")
        legend = " ".join(
            f'<span style="background:{c};color:white;padding:1px 6px;border-radius:3px;'
            f'margin-right:4px">{html.escape(k)}</span>' for k, c in KIND_COLOURS.items())
        self.kinds = Div(text=f"<b>task kinds</b> (task stream colours): {legend}",
                         name="digenrl-kinds", sizing_mode="stretch_width")
        self.why_key = TextInput(title="why: a task's story (its key, e.g. "
                                       "('grad', 3, 1, 2) or grad,3,1,2)", value=key,
                                 name="digenrl-why-key", width=420)
        self.why = Div(name="digenrl-why", sizing_mode="stretch_width")
        self.why_key.on_change("value", lambda attr, old, new: self.update_story())
        self.root = column(self.status, self.kinds, row(self.pools, self.held, self.stale),
                           self.util, self.reward, self.why_key, self.why,
                           sizing_mode="stretch_width", name="digenrl-root")
        self._last_timeline = 0.0

    # ------------------------------------------------------------------ update

    def _plugin(self):
        return self.scheduler.plugins.get(self.plugin_name)

    def update(self) -> None:
        plugin = self._plugin()
        if plugin is None or plugin.policy is None:
            self.status.text = ("<h3>DigenRL</h3><p>No digenrl run is active on this "
                                "scheduler.</p>")
            return
        state = plugin.state()
        self.status.text = _status_html(state)
        pools = state.get("pools", {})
        self.pools_source.data = {
            "pool": list(pools), "workers": [p["workers"] for p in pools.values()],
            "busy": [p["busy"] for p in pools.values()],
            "tag": [p["tag"] for p in pools.values()],
            "rat": [p.get("rat", 0) for p in pools.values()],
            "slots": [p["slots"] for p in pools.values()]}
        held = state.get("held", {})
        self.held_source.data = {"reason": list(HELD_REASONS),
                                 "tasks": [held.get(r, 0) for r in HELD_REASONS]}
        counts = plugin.telemetry.staleness_counts
        self.stale_source.data = {"staleness": sorted(counts),
                                  "samples": [counts[k] for k in sorted(counts)]}
        metrics = plugin.telemetry.metrics
        self.reward_source.data = {
            "iteration": [m["iteration"] for m in metrics],
            REWARD_CURVE: [m.get("reward_mean", float("nan")) for m in metrics]}
        self._update_timeline(plugin)
        self.update_story()

    def update_story(self) -> None:
        """Tell the story of the task whose key is typed in (nothing when none is)."""
        key = self.why_key.value.strip()
        plugin = self._plugin()
        text = task_story(plugin, key) if key and plugin is not None else ""
        self.why.text = f"<pre>{html.escape(text)}</pre>" if text else ""

    def _update_timeline(self, plugin) -> None:
        timeline = plugin.telemetry.timeline
        samples = [s for s in timeline if s["time"] > self._last_timeline]
        if not samples:
            return
        self._last_timeline = samples[-1]["time"]
        pools = sorted({p for s in timeline for p in s["pools"]})
        data: dict[str, list] = {"time": [s["time"] * 1000 for s in timeline]}
        for pool in pools:
            data[pool] = [_ratio(s["pools"].get(pool), "busy") for s in timeline]
            data[f"{pool}_tag"] = [_ratio(s["pools"].get(pool), "tag") for s in timeline]
            data[f"{pool}_rat"] = [_ratio(s["pools"].get(pool), "rat") for s in timeline]
        for pool in pools:
            if pool not in self.util_lines:
                colour = POOL_COLOURS.get(pool, "#333333")
                # Wider, translucent lines first so coinciding pools stay visible.
                wide = pool != TRAINER
                self.util.step(x="time", y=pool, source=self.util_source, color=colour,
                               legend_label=pool, mode="after", line_width=5 if wide else 2,
                               alpha=0.5 if wide else 1.0)
                if pool == TRAINER:
                    self.util.step(x="time", y=f"{pool}_tag", source=self.util_source,
                                   color=colour, line_dash="dashed", mode="after",
                                   legend_label="trainers generating (TAG)")
                if pool == ROLLOUT:
                    self.util.step(x="time", y=f"{pool}_rat", source=self.util_source,
                                   color=colour, line_dash="dotted", mode="after",
                                   legend_label="rollout workers training (RAT)")
                self.util_lines.add(pool)
        self.util_source.data = data


def task_story(plugin, key: str) -> str:
    """The story of the task ``key`` (as the store prints keys, or plainly) of the run
    ``plugin`` schedules: a task the policy holds now, with its state and the decisions
    so far, or one of the last tasks that finished (:attr:`Telemetry.recent`)."""
    want = key_parts(key)
    telemetry, policy = plugin.telemetry, plugin.policy
    t0 = telemetry.started
    if policy is not None:
        info = next((i for k, i in list(policy.tasks.items()) if key_parts(str(k)) == want),
                    None)
        if info is not None and info.state != "done":
            w = policy.workers.get(info.where or "")
            return story({"key": str(info.key), "kind": info.kind,
                          "iteration": info.iteration, "policy_version": info.policy_version,
                          "state": info.state, "worker_name": w.name if w is not None else "",
                          "ready": info.ready_since, "eligible": info.eligible_since,
                          "decisions": trail_text(info.trail)}, t0)
    record = next((r for k, r in reversed(list(telemetry.recent.items()))
                   if key_parts(k) == want), None)
    if record is None:
        return (f"{key}: no such task among those the scheduler holds or the last "
                f"{len(telemetry.recent)} that finished")
    return story(record, t0)


def _ratio(pool: dict | None, field: str) -> float:
    if not pool or not pool.get("workers"):
        return 0.0
    return pool.get(field, 0) / pool["workers"]


def _status_html(state: dict[str, Any]) -> str:
    opts = state.get("options", {})
    switches = ", ".join(f"{k.upper()} {'on' if opts.get(k) else 'off'}"
                         for k in ("gap", "tsp", "tag", "rat"))
    pools = state.get("pools", {})
    workers = ", ".join(f"{p['workers']} {html.escape(name)}" for name, p in pools.items())
    warnings = "".join(f"<li>{html.escape(w)}</li>" for w in state.get("warnings", []))
    rejected = state.get("rejected", {})
    return (
        f"<h3>DigenRL run {html.escape(str(state.get('run')))}"
        f"{'' if state.get('active') else ' (finished)'}</h3>"
        f"<p><b>policy version</b> {state.get('policy_version')} &nbsp; "
        f"<b>mode</b> {html.escape(str(opts.get('mode')))} ({switches}, max staleness "
        f"{opts.get('max_staleness')}) &nbsp; <b>workers</b> {workers or 'none'} &nbsp; "
        f"<b>tasks completed</b> {state.get('records', 0)}</p>"
        + (f"<p><b>warnings</b></p><ul>{warnings}</ul>" if warnings else "")
        + (f"<p><b>rejected tasks</b>: {len(rejected)}</p>" if rejected else ""))


def _doc(plugin_name: str, scheduler, extra, doc) -> None:
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    key = doc.session_context.request.arguments.get("key") if doc.session_context else None
    page = DigenRLPage(scheduler, plugin_name, key[0].decode() if key else "")
    page.update()
    doc.title = "Dask: DigenRL"
    doc.add_root(page.root)
    doc.add_periodic_callback(page.update, 500)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


_INSTALLED: "weakref.WeakSet" = weakref.WeakSet()


def install(scheduler, plugin_name: str = "digenrl") -> bool:
    """Add the page to ``scheduler``'s HTTP server and the dashboard's navigation bar.

    Dask builds its dashboard pages when the scheduler is constructed; this adds one
    more Bokeh application to the running server, so it works after start-up too (a
    dashboard served under a custom ``--dashboard-prefix`` is not supported). Returns
    False when the scheduler has no HTTP server or bokeh is missing.
    """
    if scheduler in _INSTALLED:
        return True
    if getattr(scheduler, "http_application", None) is None:
        return False
    try:
        from distributed.dashboard.core import BokehApplication
        from distributed.dashboard.scheduler import template_variables
        from tornado.ioloop import IOLoop
    except ImportError:  # bokeh is not installed
        return False
    variables = template_variables(scheduler)
    if "digenrl" not in variables["pages"]:
        variables["pages"].append("digenrl")
    app = BokehApplication({ROUTE: partial(_doc, plugin_name)}, scheduler, prefix="/",
                           template_variables=variables)
    scheduler.http_application.add_application(app)
    app.initialize(IOLoop.current())
    _INSTALLED.add(scheduler)
    return True

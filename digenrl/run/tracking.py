"""Experiment trackers: TensorBoard, Weights & Biases and MLflow, each through its own
library (``tracking.backends``).

The store is the run's record; a tracker shows what the store committed. Its life:

* :func:`check_trackers` (from :func:`digenrl.run.world.check_world`): each tracker's
  library is installed and a ``tracking.dir`` the config names is a folder that can be
  written.
* :meth:`Tracker.start` (the runner, before any cluster starts): a tracker run per
  backend -- or, for a resumed run, the tracker runs the store's ``tracking`` attribute
  names, reopened -- and the resolved config as its hyperparameters. A tracker that
  cannot start raises :class:`~digenrl.config.ConfigError` naming the field.
* :meth:`Tracker.log_iteration` (the driver, right after it committed an iteration):
  what the trackers show of the iteration is taken from its rows (:class:`IterationLog`:
  the ``metrics`` row at step = iteration, each held-out evaluation at step = the
  evaluated policy version, a captioned grid of a few samples) and handed to a thread
  per backend through a short queue, so the driver never waits for a tracker. A
  tracker that fails is a warning, once; one that falls so far behind that its queue
  is full misses iterations, with a warning, once.
* :meth:`Tracker.close` (the runner, at the end, however the run ended): each thread
  logs what is queued and the tracker run is finished.

Videos are logged as a strip of frames (as the store keeps an evaluated video): both
``wandb.Video`` and TensorBoard's ``add_video`` need a video encoder (moviepy or
imageio) that digenrl does not otherwise need.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import yaml

from digenrl.config import ConfigError, RunConfig, TrackingConfig, config_to_dict
from digenrl.store import (EVAL_GROUP, REWARD_COLUMN, evaluation_means, evaluation_reward_means,
                           frame_strip, read_attrs)

__all__ = ["Tracker", "IterationLog", "Grid", "check_trackers", "tracking_dir",
           "BACKENDS", "ATTRIBUTE", "QUEUE_LENGTH"]

logger = logging.getLogger("digenrl")

#: The store attribute holding the run's tracker runs, by tracker.
ATTRIBUTE = "tracking"
#: Iterations a tracker's thread may have waiting before the driver stops queueing
#: more for it (each holds the iteration's metrics and a few images).
QUEUE_LENGTH = 8
#: Seconds :meth:`Tracker.close` waits for a tracker's thread to log what is queued.
CLOSE_TIMEOUT = 120.0

#: Names the trackers show: the store's metrics row (``metrics/NAME``), the held-out
#: evaluation (its x: the evaluated policy version) and the sample grids.
METRIC_PREFIX = "metrics/"
EVAL_REWARD = "eval/reward_mean"
#: Each reward's own mean over a held-out evaluation (``eval/rewards/ocr``: the held-out
#: OCR accuracy), at the same step.
EVAL_REWARD_OF = "eval/rewards/{}"
EVAL_VERSION = "eval/version"
ITERATION = "iteration"
SAMPLES = "samples"
EVAL_SAMPLES = "eval/samples"


# ------------------------------------------------------------------ what is logged


@dataclass
class Grid:
    """A few samples with their prompts and rewards, as a tracker shows them."""

    title: str
    images: np.ndarray            # (n, H, W, 3) uint8; a video as a strip of frames
    prompts: list[str]
    rewards: np.ndarray
    valid: np.ndarray
    _picture: np.ndarray | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def captions(self) -> list[str]:
        """Each sample's prompt and reward."""
        return [f"{p}\nreward {r:.4f}" if ok else f"{p}\n(no reward)"
                for p, r, ok in zip(self.prompts, self.rewards, self.valid)]

    def picture(self) -> np.ndarray:
        """The samples in one captioned picture ``(H, W, 3)`` (as ``digenrl report``
        draws a grid), drawn once whichever tracker's thread asks first."""
        with self._lock:
            if self._picture is None:
                from digenrl.figures.plots import grid_image

                self._picture = grid_image(self.images, self.prompts, self.rewards,
                                           self.valid, self.title)
            return self._picture


@dataclass
class Evaluation:
    """One held-out evaluation stored with an iteration."""

    version: int
    reward_mean: float
    prompts: int
    grid: Grid | None = None
    #: Each reward's own mean over the evaluation (its ``reward_NAME`` column).
    rewards: dict[str, float] = field(default_factory=dict)

    def scalars(self) -> dict[str, float]:
        """The evaluation's tracked values: the weighted reward's mean and each reward's."""
        return {EVAL_REWARD: self.reward_mean,
                **{EVAL_REWARD_OF.format(n): m for n, m in self.rewards.items()}}


@dataclass
class IterationLog:
    """What the trackers show of one committed iteration."""

    iteration: int
    #: The store's metrics row, its finite values (a NaN has no point on a curve).
    metrics: dict[str, float]
    evaluations: list[Evaluation]
    samples: Grid | None = None

    @classmethod
    def from_rows(cls, i: int, groups: Mapping[str, Mapping[str, np.ndarray]],
                  tracking: TrackingConfig) -> "IterationLog":
        """Iteration ``i``'s log from the rows the driver committed (``groups``: the
        store's groups, each its columns)."""
        metrics = {name: float(v) for name, v in groups.get("metrics", {}).items()
                   if math.isfinite(float(v))}
        rows = groups.get(EVAL_GROUP, {})
        per_reward = evaluation_reward_means(rows)
        evaluations = [Evaluation(v, mean, count,
                                  _eval_grid(rows, v, tracking.images)
                                  if tracking.image_every > 0 else None, per_reward[v])
                       for v, mean, count in evaluation_means(rows)]
        samples = (_sample_grid(i, groups.get("samples") or {}, tracking.images)
                   if tracking.logs_images(i) else None)
        return cls(i, metrics, evaluations, samples)


def _sample_grid(i: int, rows: Mapping[str, np.ndarray], count: int) -> Grid | None:
    """``count`` of iteration ``i``'s samples, evenly spread (none when the store keeps
    no images)."""
    pictures = rows.get("video", rows.get("image"))
    if pictures is None or not len(pictures):
        return None
    n = len(pictures)
    pick = np.unique(np.linspace(0, n - 1, min(count, n)).round().astype(int))
    return Grid(f"iteration {i}: {len(pick)} of {n} samples", frame_strip(pictures[pick]),
                [str(p) for p in rows["prompt"][pick]], np.asarray(rows[REWARD_COLUMN][pick]),
                np.asarray(rows["valid"][pick]))


def _eval_grid(rows: Mapping[str, np.ndarray], version: int, count: int) -> Grid | None:
    """The first ``count`` held-out prompts' samples of evaluated ``version``."""
    if "image" not in rows:
        return None
    from digenrl.figures.plots import EVAL_GRID_TITLE

    mine = np.flatnonzero(rows["version"] == version)
    mine = mine[np.argsort(rows["prompt_index"][mine], kind="stable")][:count]
    return Grid(EVAL_GRID_TITLE.format(version=version), rows["image"][mine],
                [str(p) for p in rows["prompt"][mine]], np.asarray(rows[REWARD_COLUMN][mine]),
                np.asarray(rows["valid"][mine]))


def flat_config(config: RunConfig) -> dict[str, Any]:
    """The resolved config as ``section.field`` -> a number, a bool or a string (a list,
    mapping or null as its JSON): the hyperparameters of a tracker run."""
    out: dict[str, Any] = {}

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping) and value and all(isinstance(k, str) for k in value):
            for k, v in value.items():
                visit(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(value, (bool, int, float, str)):
            out[prefix] = value
        else:
            out[prefix] = json.dumps(value)

    visit("", config_to_dict(config))
    return out


# ---------------------------------------------------------------------- the backends


@dataclass
class Start:
    """What a backend starts from."""

    config: RunConfig
    #: The folder the trackers write in (made).
    dir: Path
    #: The tracker run's name.
    name: str
    #: The store the run writes.
    out: str
    #: The iteration the run starts at (past 0: a resumed run).
    iteration: int
    #: The tracker run the store names for this backend (a resumed run's), if any.
    stored: dict[str, Any] | None


class Backend:
    """One tracker: started in the runner's thread, logged to from its own thread."""

    #: The name in ``tracking.backends`` (and the package extra installing it).
    name: str
    #: The module its library installs.
    library: str

    def start(self, s: Start) -> dict[str, Any]:
        """Open a tracker run (reopen ``s.stored``); returns what reopens it."""
        raise NotImplementedError

    def log(self, entry: IterationLog) -> None:
        raise NotImplementedError

    def finish(self, ok: bool) -> None:
        raise NotImplementedError


class TensorBoard(Backend):
    """``torch.utils.tensorboard.SummaryWriter`` writing event files in a run folder of
    its own (``DIR/tensorboard/NAME-TIME``); a resumed run appends to that folder."""

    name = "tensorboard"
    library = "tensorboard"

    def start(self, s: Start) -> dict[str, Any]:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        if s.stored is not None:
            log_dir = Path(s.stored["log_dir"])
            if not log_dir.is_dir():
                raise ValueError(f"the run's TensorBoard folder {str(log_dir)!r} is gone")
        else:
            log_dir = _fresh(s.dir / "tensorboard" / f"{s.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        self.writer = SummaryWriter(str(log_dir))
        if s.stored is None:
            file_writer = self.writer.file_writer
            assert file_writer is not None      # (made with the SummaryWriter)
            for summary in hparams(flat_config(s.config), {}):
                file_writer.add_summary(summary)
        # The config the run follows from this iteration on (a resumed run may extend it).
        self.writer.add_text("config", _markdown_yaml(s.config), s.iteration)
        self.writer.flush()
        return {"log_dir": str(log_dir.resolve())}

    def log(self, entry: IterationLog) -> None:
        w, i = self.writer, entry.iteration
        for name, value in entry.metrics.items():
            w.add_scalar(METRIC_PREFIX + name, value, i)
        for e in entry.evaluations:
            for name, value in e.scalars().items():
                w.add_scalar(name, value, e.version)
            if e.grid is not None:
                w.add_image(EVAL_SAMPLES, e.grid.picture(), e.version, dataformats="HWC")
        if entry.samples is not None:
            w.add_image(SAMPLES, entry.samples.picture(), i, dataformats="HWC")
        w.flush()

    def finish(self, ok: bool) -> None:
        self.writer.close()


class WandB(Backend):
    """``wandb.init`` (``resume="must"`` with the stored run id for a resumed run);
    each iteration's metrics against ``iteration``, each evaluation against
    ``eval/version`` (W&B's ``define_metric``), samples as captioned ``wandb.Image``s."""

    name = "wandb"
    library = "wandb"

    def start(self, s: Start) -> dict[str, Any]:
        import wandb

        t = s.config.tracking
        kwargs: dict[str, Any] = dict(
            project=t.project, name=s.name, dir=str(s.dir.resolve()), mode=t.wandb_mode,
            # Another W&B run of the process (the caller's own) is left as it is.
            reinit="create_new",
            # digenrl's log goes to its own handlers; W&B keeps the metrics.
            settings=wandb.Settings(console="off"))
        if s.stored is None:
            kwargs["config"] = config_to_dict(s.config)
        else:
            kwargs.update(id=s.stored["id"], project=s.stored["project"], resume="must",
                          dir=s.stored.get("dir", kwargs["dir"]))
        self.run = wandb.init(**kwargs)
        if s.stored is not None:
            self.run.config.update(config_to_dict(s.config), allow_val_change=True)
        self.run.define_metric(ITERATION)
        self.run.define_metric(METRIC_PREFIX + "*", step_metric=ITERATION)
        self.run.define_metric(SAMPLES, step_metric=ITERATION)
        self.run.define_metric(EVAL_VERSION)
        self.run.define_metric("eval/*", step_metric=EVAL_VERSION)
        return {"id": self.run.id, "project": self.run.project, "dir": kwargs["dir"]}

    def log(self, entry: IterationLog) -> None:
        import wandb

        row: dict[str, Any] = {ITERATION: entry.iteration}
        row.update({METRIC_PREFIX + k: v for k, v in entry.metrics.items()})
        if entry.samples is not None:
            row[SAMPLES] = _wandb_images(wandb, entry.samples)
        self.run.log(row)
        for e in entry.evaluations:
            row = {EVAL_VERSION: e.version, **e.scalars()}
            if e.grid is not None:
                row[EVAL_SAMPLES] = _wandb_images(wandb, e.grid)
            self.run.log(row)

    def finish(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


def _wandb_images(wandb, grid: Grid) -> list:
    return [wandb.Image(image, caption=caption)
            for image, caption in zip(grid.images, grid.captions())]


#: MLflow's longest parameter value (longer ones are cut; config.yaml holds them whole).
MLFLOW_PARAM_LENGTH = 6000
#: Parameters in one MLflow batch, at most.
MLFLOW_BATCH = 100


class MLflow(Backend):
    """``mlflow.tracking.MlflowClient``: a run in the ``tracking.project`` experiment
    (reopened by its id for a resumed run), at ``tracking.mlflow_uri`` or a SQLite
    database in the tracking folder; the config as parameters and ``config.yaml``,
    samples as step-keyed images."""

    name = "mlflow"
    library = "mlflow"

    def start(self, s: Start) -> dict[str, Any]:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        t = s.config.tracking
        if s.stored is not None:
            uri = s.stored["uri"]
        elif t.mlflow_uri is not None:
            uri = t.mlflow_uri
        else:
            uri = "sqlite:///" + str((s.dir / "mlflow.db").resolve())
        self.client = client = MlflowClient(tracking_uri=uri)
        if s.stored is not None:
            run = client.get_run(s.stored["run_id"])
            client.update_run(run.info.run_id, status="RUNNING")
        else:
            experiment = client.get_experiment_by_name(t.project)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:
                artifacts = (None if t.mlflow_uri is not None
                             else (s.dir / "mlflow-artifacts").resolve().as_uri())
                experiment_id = client.create_experiment(t.project, artifact_location=artifacts)
            run = client.create_run(experiment_id, run_name=s.name,
                                    tags={"digenrl.store": os.path.abspath(s.out)})
        self.run_id = run.info.run_id
        # Parameters never change in MLflow: a resumed run adds those it lacks only.
        have = run.data.params
        params = [Param(k, str(v)[:MLFLOW_PARAM_LENGTH])
                  for k, v in flat_config(s.config).items() if k not in have]
        for a in range(0, len(params), MLFLOW_BATCH):
            client.log_batch(self.run_id, params=params[a:a + MLFLOW_BATCH])
        client.log_text(self.run_id, yaml.safe_dump(config_to_dict(s.config), sort_keys=False),
                        "config.yaml")
        return {"run_id": self.run_id, "uri": uri}

    def log(self, entry: IterationLog) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(METRIC_PREFIX + k, v, now, entry.iteration)
                   for k, v in entry.metrics.items()]
        metrics += [Metric(name, value, now, e.version)
                    for e in entry.evaluations for name, value in e.scalars().items()]
        self.client.log_batch(self.run_id, metrics=metrics)
        if entry.samples is not None:
            self.client.log_image(self.run_id, entry.samples.picture(), key=SAMPLES,
                                  step=entry.iteration)
        for e in entry.evaluations:
            if e.grid is not None:
                self.client.log_image(self.run_id, e.grid.picture(), key=EVAL_SAMPLES,
                                      step=e.version)

    def finish(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


#: Every tracker by its name in ``tracking.backends`` (:data:`digenrl.config.TRACKERS`).
BACKENDS: dict[str, type[Backend]] = {b.name: b for b in (TensorBoard, WandB, MLflow)}


def _fresh(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``, ... when it is taken."""
    k, candidate = 1, path
    while candidate.exists():
        k += 1
        candidate = path.with_name(f"{path.name}-{k}")
    return candidate


def _markdown_yaml(config: RunConfig) -> str:
    text = yaml.safe_dump(config_to_dict(config), sort_keys=False)
    return "".join("    " + line for line in text.splitlines(keepends=True))


# ------------------------------------------------------------------------- checks


def tracking_dir(tracking: TrackingConfig, out: str) -> Path:
    """The folder the trackers write in: ``tracking.dir``, or ``STORE-tracking`` next to
    the store (as ``digenrl report`` writes ``STORE-report``)."""
    if tracking.dir is not None:
        return Path(tracking.dir).expanduser()
    return Path(str(out).rstrip("/") + "-tracking")


def _unwritable(path: Path) -> str | None:
    """Why the trackers cannot write in folder ``path`` (made if missing), or None."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        return f"{str(p)!r} is not a folder"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{str(p)!r} cannot be written"
    return None


def check_trackers(tracking: TrackingConfig) -> None:
    """Each tracker's library is installed, and a ``tracking.dir`` named is a folder
    that can be made and written; raises :class:`ConfigError` naming the field."""
    for i, name in enumerate(tracking.backends):
        library = BACKENDS[name].library
        if importlib.util.find_spec(library) is None:
            raise ConfigError(f"tracking.backends[{i}]: expected a tracker whose library is "
                              f"installed, got {name!r} ({library} is not installed: pip "
                              f"install 'digenrl[{name}]')")
    if tracking.backends and tracking.dir is not None:
        why = _unwritable(tracking_dir(tracking, ""))
        if why is not None:
            raise ConfigError(f"tracking.dir: expected a folder the trackers can write, got "
                              f"{tracking.dir!r} ({why})")


def _one_line(e: BaseException) -> str:
    text = " ".join(part.strip() for part in str(e).splitlines() if part.strip())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# --------------------------------------------------------------------- the threads


class _Worker:
    """A backend's thread and its queue of iterations to log."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.queue: queue.Queue[IterationLog | None] = queue.Queue(QUEUE_LENGTH)
        self.failed: list[int] = []
        self.first_error = ""
        self.dropped: list[int] = []
        self.thread = threading.Thread(target=self._loop, daemon=True,
                                       name=f"digenrl-tracking-{backend.name}")
        self.thread.start()

    def put(self, entry: IterationLog) -> None:
        try:
            self.queue.put_nowait(entry)
        except queue.Full:
            self.dropped.append(entry.iteration)
            if len(self.dropped) == 1:
                logger.warning("tracking: %s is %d iterations behind; iteration %d and any "
                               "later one while it is this far behind are not logged to it "
                               "(the store has them)", self.backend.name, QUEUE_LENGTH,
                               entry.iteration)

    def _loop(self) -> None:
        while (entry := self.queue.get()) is not None:
            try:
                self.backend.log(entry)
            except Exception as e:  # a tracker's failure never stops the run
                self.failed.append(entry.iteration)
                if len(self.failed) == 1:
                    self.first_error = _one_line(e)
                    logger.warning("tracking: %s failed to log iteration %d (%s); the run "
                                   "goes on, the store has every iteration",
                                   self.backend.name, entry.iteration, self.first_error)

    def close(self, ok: bool, timeout: float) -> None:
        """Log what is queued, then finish the tracker run (left unfinished when the
        thread is still busy after ``timeout`` seconds)."""
        name = self.backend.name
        try:
            self.queue.put(None, timeout=timeout)
            self.thread.join(timeout)
        except queue.Full:
            pass
        if self.thread.is_alive():
            logger.warning("tracking: %s still logging after %.0f s; %d iterations left "
                           "unlogged", name, timeout, self.queue.qsize())
            return
        missed = sorted(self.failed + self.dropped)
        if missed:
            logger.warning("tracking: %s lacks iterations %s%s", name, missed,
                           f" (first error: {self.first_error})" if self.first_error else "")
        try:
            self.backend.finish(ok)
        except Exception as e:
            logger.warning("tracking: %s could not finish its run (%s)", name, _one_line(e))


# --------------------------------------------------------------------- the tracker


class Tracker:
    """The run's trackers (one :class:`Backend` each, on its own thread)."""

    def __init__(self, tracking: TrackingConfig, workers: list[_Worker],
                 runs: dict[str, dict[str, Any]]):
        self.tracking = tracking
        self.workers = workers
        #: Each tracker's run, by tracker (what the store keeps under :data:`ATTRIBUTE`):
        #: the ones started now and those a resumed run's store named before.
        self.runs = runs
        self._failed = False

    @classmethod
    def start(cls, config: RunConfig, out: str, *, iteration: int = 0,
              resume: bool = False) -> "Tracker":
        """The trackers of ``config.tracking`` started (none when it names none), for a
        run writing ``out`` from ``iteration``; a resumed run reopens the tracker runs its
        store names. Raises :class:`ConfigError` naming the field when one cannot start
        (those started before it are finished). As a context manager, the tracker is
        closed on leaving, ``ok`` when no exception leaves."""
        tracking = config.tracking
        if not tracking.backends:
            return cls(tracking, [], {})
        check_trackers(tracking)
        if tracking.image_every > 0:
            import digenrl.figures.plots  # noqa: F401  (matplotlib loads now, not in the driver's loop)
        folder = tracking_dir(tracking, out)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            shown = (repr(tracking.dir) if tracking.dir is not None
                     else f"null (next to the store: {str(folder)!r})")
            raise ConfigError(f"tracking.dir: expected a folder the trackers can write, got "
                              f"{shown} ({_one_line(e)})") from None
        stored: dict[str, dict] = dict(read_attrs(out).get(ATTRIBUTE) or {}) if resume else {}
        name = tracking.name or Path(str(out).rstrip("/")).stem
        runs = dict(stored)
        workers: list[_Worker] = []
        try:
            for backend_name in tracking.backends:
                backend = BACKENDS[backend_name]()
                before = stored.get(backend_name)
                try:
                    runs[backend_name] = backend.start(Start(config, folder, name, out,
                                                             iteration, before))
                except Exception as e:
                    raise ConfigError(_start_failure(tracking, backend_name, before, e)) from e
                logger.info("tracking: %s %s", backend_name,
                            json.dumps(runs[backend_name]))
                workers.append(_Worker(backend))
        except ConfigError:
            for w in workers:
                w.close(ok=False, timeout=CLOSE_TIMEOUT)
            raise
        return cls(tracking, workers, runs)

    def log_iteration(self, i: int, groups: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        """Iteration ``i`` is committed with ``groups`` (the rows of each store group):
        hand what the trackers show of it to their threads. Never raises: the run goes
        on whatever a tracker does."""
        if not self.workers:
            return
        try:
            entry = IterationLog.from_rows(i, groups, self.tracking)
        except Exception as e:
            if not self._failed:
                self._failed = True
                logger.warning("tracking: iteration %d could not be read for the trackers "
                               "(%s)", i, _one_line(e))
            return
        for w in self.workers:
            w.put(entry)

    def close(self, ok: bool = True, timeout: float = CLOSE_TIMEOUT) -> None:
        """Log what is queued and finish every tracker run (``ok``: the run finished,
        else it stopped)."""
        for w in self.workers:
            w.close(ok, timeout)

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        self.close(ok=kind is None)


def _start_failure(tracking: TrackingConfig, name: str, stored: dict | None,
                   e: BaseException) -> str:
    """The one line saying why tracker ``name`` could not start, naming the field."""
    why = _one_line(e)
    if stored is not None:
        return (f"tracking.backends: {name} could not reopen the run's tracker run "
                f"{json.dumps(stored)} ({why})")
    if name == "mlflow" and tracking.mlflow_uri is not None:
        return f"tracking.mlflow_uri: MLflow could not open {tracking.mlflow_uri!r} ({why})"
    return f"tracking.backends: {name} could not start ({why})"


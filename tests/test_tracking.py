"""Experiment trackers (digenrl/run/tracking.py): a run logged to TensorBoard, W&B (offline)
and MLflow (a local SQLite database), stopped and resumed, read back with each tracker's
own reader and compared with the store; trackers that cannot start stop the run before
any cluster, and one that fails or falls behind mid-run costs the store nothing."""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from conftest import small_config
from digenrl.config import TRACKERS, ConfigError, config_from_dict
from digenrl.store import open_run, read_attrs
from digenrl.run.tracking import BACKENDS, QUEUE_LENGTH, Backend, Tracker, _Worker

#: The run every reading test shares: three iterations, stopped after the second and
#: resumed; version 2 evaluated (stored with iteration 1); a two-sample grid every
#: iteration.
ITERATIONS = 3
STOP_AFTER = 1
EVALUATED = 2


def installed(name: str) -> bool:
    return importlib.util.find_spec(BACKENDS[name].library) is not None


def need(name: str) -> None:
    if not installed(name):
        pytest.skip(f"{BACKENDS[name].library} is not installed here "
                    f"(pip install 'digenrl[{name}]')")


def tracked_config(tmp: Path, backends, **overrides):
    settings = {"tracking.backends": list(backends), "tracking.dir": str(tmp / "tracking"),
                "tracking.image_every": 1, "tracking.images": 2,
                "eval.every": EVALUATED, "iterations": ITERATIONS}
    if "wandb" in backends:
        settings["tracking.wandb_mode"] = "offline"  # (no network here)
    return small_config(**{**settings, **overrides})


class Stopped(Exception):
    pass


@dataclass
class Tracked:
    out: Path
    dir: Path
    #: The store's tracker runs after the first part and after the resumed one.
    runs_before: dict
    runs: dict
    #: The store's reward_mean per iteration, and the mean of evaluated version 2.
    reward_mean: np.ndarray
    eval_mean: float


@pytest.fixture(scope="module")
def tracked(cluster_1x1, tmp_path_factory) -> Tracked:
    """One run logged to every tracker installed, stopped after iteration 1 (by the
    driver's callback, after that iteration was committed and handed to the trackers)
    and resumed to the end."""
    from digenrl.run.runner import Runner

    tmp = tmp_path_factory.mktemp("tracked")
    backends = [name for name in TRACKERS if installed(name)]
    if not backends:
        pytest.skip("no tracker library is installed here (pip install 'digenrl[test]')")
    out = tmp / "run.zarr"

    def stop(summary):
        if summary.iteration == STOP_AFTER:
            raise Stopped

    with pytest.raises(Stopped):
        Runner(tracked_config(tmp, backends), str(out), cluster=cluster_1x1,
               on_iteration=stop).run()
    runs_before = read_attrs(out)["tracking"]
    Runner(tracked_config(tmp, backends), str(out), resume=True, cluster=cluster_1x1).run()
    ds = open_run(out)
    e = ds["eval"]
    mine = (e.version.values == EVALUATED) & e.valid.values
    return Tracked(out, tmp / "tracking", runs_before, read_attrs(out)["tracking"],
                   ds["metrics"].reward_mean.values, float(e.reward.values[mine].mean()))


def test_every_tracker_the_config_names_has_a_backend():
    assert set(BACKENDS) == set(TRACKERS)


def test_the_store_keeps_each_tracker_run_and_a_resumed_run_keeps_the_same(tracked):
    assert tracked.runs == tracked.runs_before
    assert set(tracked.runs) == {name for name in TRACKERS if installed(name)}


def test_tensorboard_shows_the_stores_curves_as_one_run(tracked):
    need("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = Path(tracked.runs["tensorboard"]["log_dir"])
    assert log_dir.parent == tracked.dir / "tensorboard"
    # Two writers (the run and its resumption) appended to the one run folder.
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 2
    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0})
    ea.Reload()
    curve = ea.Scalars("metrics/reward_mean")
    assert [s.step for s in curve] == list(range(ITERATIONS))
    # (TensorBoard keeps a scalar as float32.)
    np.testing.assert_allclose([s.value for s in curve], tracked.reward_mean, rtol=1e-6)
    assert [(s.step, pytest.approx(s.value, rel=1e-6)) for s in ea.Scalars("eval/reward_mean")] \
        == [(EVALUATED, tracked.eval_mean)]
    assert [i.step for i in ea.Images("samples")] == list(range(ITERATIONS))
    assert [i.step for i in ea.Images("eval/samples")] == [EVALUATED]
    assert ea.Images("samples")[0].width > ea.Images("samples")[0].height > 64


def wandb_records(run_dir: Path) -> list[dict]:
    """The records of an offline W&B run, read by wandb's own reader of its transaction
    log (``wandb leet inspect --json``)."""
    done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json",
                           str(run_dir)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_wandb_shows_the_stores_curves_as_one_run(tracked):
    need("wandb")
    run_id = tracked.runs["wandb"]["id"]
    assert tracked.runs["wandb"]["dir"] == str(tracked.dir.resolve())
    # One offline folder per process that wrote the run, both under the same run id.
    folders = sorted((tracked.dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(folders) == 2
    rows, resumed = [], []
    for folder in folders:
        records = wandb_records(folder)
        (run,) = [r["run"] for r in records if r["type"] == "run"]
        assert run["run_id"] == run_id and run["project"] == "digenrl"
        resumed.append(bool(run.get("resume")))
        rows += [r["history"]["item"] for r in records if r["type"] == "history"]
    assert resumed == [False, True]
    curve = [r for r in rows if "metrics/reward_mean" in r]
    assert [r["iteration"] for r in curve] == list(range(ITERATIONS))
    np.testing.assert_allclose([r["metrics/reward_mean"] for r in curve], tracked.reward_mean,
                               rtol=1e-12)
    evals = [r for r in rows if "eval/reward_mean" in r]
    assert [(r["eval/version"], pytest.approx(r["eval/reward_mean"], rel=1e-12))
            for r in evals] == [(EVALUATED, tracked.eval_mean)]
    # A captioned image per sample of the grid: its prompt and its reward.
    assert all(r["samples.count"] == 2 and len(r["samples.captions"]) == 2 for r in curve)
    assert "reward " in curve[0]["samples.captions"][0]
    assert evals[0]["eval/samples.count"] == 2


def test_mlflow_shows_the_stores_curves_as_one_run(tracked):
    need("mlflow")
    from mlflow.tracking import MlflowClient

    record = tracked.runs["mlflow"]
    assert record["uri"] == "sqlite:///" + str((tracked.dir / "mlflow.db").resolve())
    client = MlflowClient(tracking_uri=record["uri"])
    run = client.get_run(record["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    curve = client.get_metric_history(record["run_id"], "metrics/reward_mean")
    assert [m.step for m in curve] == list(range(ITERATIONS))
    np.testing.assert_allclose([m.value for m in curve], tracked.reward_mean, rtol=1e-12)
    assert [(m.step, pytest.approx(m.value, rel=1e-12)) for m in
            client.get_metric_history(record["run_id"], "eval/reward_mean")] \
        == [(EVALUATED, tracked.eval_mean)]
    # The resolved config as parameters (and whole, as config.yaml).
    assert run.data.params["train.learning_rate"] == "0.001"
    assert run.data.params["tracking.backends"].startswith("[")
    images = [a.path for a in client.list_artifacts(record["run_id"], "images")]
    steps = sorted(int(p.split("+step+")[1].split("+")[0]) for p in images
                   if p.startswith("images/samples+") and p.endswith(".png"))
    assert steps == list(range(ITERATIONS))
    assert "config.yaml" in [a.path for a in client.list_artifacts(record["run_id"])]


# ------------------------------------------------------------ trackers that fail


def run_cli(tmp_path, capsys, *settings) -> tuple[int, list[str]]:
    """``digenrl run`` against a scheduler nobody runs: only what fails before any
    cluster is reached can answer."""
    from digenrl.commands.cli import main

    args = ["run", "--out", str(tmp_path / "run.zarr"), "--scheduler", "tcp://127.0.0.1:1",
            "--no-progress"]
    for s in settings:
        args += ["--set", s]
    code = main(args)
    return code, [line for line in capsys.readouterr().err.splitlines()
                  if "digenrl run: error" in line]


def test_a_tracker_without_its_library_stops_the_run_before_any_cluster(
        tmp_path, capsys, monkeypatch):
    # (None in sys.modules: what Python itself says of a module that cannot be imported.)
    monkeypatch.setitem(sys.modules, "wandb", None)
    code, err = run_cli(tmp_path, capsys, "tracking.backends=[tensorboard, wandb]")
    assert code == 2 and len(err) == 1, err
    assert err[0].endswith("tracking.backends[1]: expected a tracker whose library is "
                           "installed, got 'wandb' (wandb is not installed: pip install "
                           "'digenrl[wandb]')")
    assert not (tmp_path / "run.zarr").exists()


def test_a_tracking_folder_that_cannot_be_written_stops_the_run_before_any_cluster(
        tmp_path, capsys):
    need("tensorboard")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, err = run_cli(tmp_path, capsys, "tracking.backends=[tensorboard]",
                        f"tracking.dir={blocker / 'tracking'}")
    assert code == 2 and len(err) == 1, err
    assert "tracking.dir: expected a folder the trackers can write" in err[0]
    assert "is not a folder" in err[0]
    assert not (tmp_path / "run.zarr").exists()


def test_an_mlflow_uri_that_does_not_open_stops_the_run_before_any_cluster(tmp_path, capsys):
    need("mlflow")
    code, err = run_cli(tmp_path, capsys, "tracking.backends=[mlflow]",
                        "tracking.mlflow_uri=nosuch://tracker")
    assert code == 2 and len(err) == 1, err
    assert "tracking.mlflow_uri: MLflow could not open 'nosuch://tracker'" in err[0]
    assert not (tmp_path / "run.zarr").exists()


def test_bad_tracking_settings_are_refused_in_one_line():
    cases = {
        "tracking.backends[0]: expected one of ['mlflow', 'tensorboard', 'wandb'], got 'tb'":
            {"backends": ["tb"]},
        "tracking.backends: expected each tracker once, got ['wandb', 'wandb']":
            {"backends": ["wandb", "wandb"]},
        "tracking.backends: expected a list, got 'wandb'": {"backends": "wandb"},
        "tracking.mlflow_uri: expected null while tracking.backends names no mlflow, got "
        "'sqlite:///x.db'": {"backends": ["wandb"], "mlflow_uri": "sqlite:///x.db"},
        "tracking.wandb_mode: expected one of ['offline', 'online'], got 'disabled'":
            {"backends": ["wandb"], "wandb_mode": "disabled"},
        "tracking.image_every: expected an integer >= 0 (0: no images), got -1":
            {"image_every": -1},
    }
    for message, tracking in cases.items():
        with pytest.raises(ConfigError) as e:
            config_from_dict({"tracking": tracking})
        assert str(e.value) == message


def metrics_rows(reward: float) -> dict:
    return {"metrics": {"reward_mean": np.float64(reward)}}


def test_a_tracker_failing_mid_run_warns_once_and_the_others_log_on(tracked, tmp_path,
                                                                    caplog):
    """The MLflow run is deleted while the run goes on (someone deleted it in MLflow's
    UI): every later iteration fails to log to it; one warning says so, and TensorBoard
    logs every iteration. (MLflow at a URI the config names: the shared run's database.)"""
    need("mlflow")
    need("tensorboard")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tracked_config(tmp_path, ["tensorboard", "mlflow"],
                         **{"tracking.mlflow_uri": tracked.runs["mlflow"]["uri"]})
    tracker = Tracker.start(cfg, str(tmp_path / "run.zarr"))
    record = tracker.runs["mlflow"]
    assert record["uri"] == tracked.runs["mlflow"]["uri"]
    assert record["run_id"] != tracked.runs["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=record["uri"])
    tracker.log_iteration(0, metrics_rows(0.5))
    deadline = time.monotonic() + 60
    while not client.get_metric_history(record["run_id"], "metrics/reward_mean"):
        assert time.monotonic() < deadline, "iteration 0 never reached MLflow"
        time.sleep(0.05)
    client.delete_run(record["run_id"])
    with caplog.at_level(logging.WARNING, logger="digenrl"):
        for i in range(1, 4):
            tracker.log_iteration(i, metrics_rows(0.5 + i))
        tracker.close()
    failures = [r.getMessage() for r in caplog.records if "failed to log" in r.getMessage()]
    assert len(failures) == 1 and failures[0].startswith(
        "tracking: mlflow failed to log iteration 1 (MlflowException: ")
    assert any(r.getMessage().startswith("tracking: mlflow lacks iterations [1, 2, 3]")
               for r in caplog.records)
    ea = EventAccumulator(tracker.runs["tensorboard"]["log_dir"])
    ea.Reload()
    assert [s.step for s in ea.Scalars("metrics/reward_mean")] == [0, 1, 2, 3]


class Slow(Backend):
    """A tracker that takes as long to log an iteration as the test lets it (what a
    tracker behind a stalled network does): it tests the queue in front of a tracker,
    not a tracker."""

    name = "slow"
    library = "json"

    def __init__(self):
        self.entered = threading.Event()
        self.go_on = threading.Event()
        self.logged: list[int] = []
        self.finished: bool | None = None

    def log(self, entry) -> None:
        self.entered.set()
        self.go_on.wait()
        self.logged.append(entry.iteration)

    def finish(self, ok: bool) -> None:
        self.finished = ok


def test_a_tracker_that_falls_behind_never_holds_up_the_driver(caplog):
    from digenrl.run.tracking import IterationLog

    backend = Slow()
    worker = _Worker(backend)
    entries = [IterationLog(i, {"reward_mean": float(i)}, []) for i in range(QUEUE_LENGTH + 4)]
    worker.put(entries[0])
    assert backend.entered.wait(30)  # the tracker is busy with iteration 0
    with caplog.at_level(logging.WARNING, logger="digenrl"):
        putting = threading.Thread(target=lambda: [worker.put(e) for e in entries[1:]])
        putting.start()
        putting.join(30)
        assert not putting.is_alive()  # every put returned while the tracker is stuck
        backend.go_on.set()
        worker.close(ok=True, timeout=30)
    assert backend.logged == list(range(QUEUE_LENGTH + 1)) and backend.finished is True
    behind = [r.getMessage() for r in caplog.records if "behind" in r.getMessage()]
    assert behind == [f"tracking: slow is {QUEUE_LENGTH} iterations behind; iteration "
                      f"{QUEUE_LENGTH + 1} and any later one while it is this far behind "
                      f"are not logged to it (the store has them)"]


def test_what_the_trackers_show_of_an_iteration():
    """The metrics row's finite values; a video's samples as strips of frames, evenly
    spread over the iteration and captioned with prompt and reward; each evaluation's
    mean and its first held-out samples."""
    from digenrl.store import STRIP_FRAMES
    from digenrl.run.tracking import IterationLog

    tracking = small_config(**{"tracking.images": 3, "tracking.image_every": 2}).tracking
    n, frames, h, w = 8, 9, 4, 5
    videos = np.arange(n * frames * h * w * 3, dtype=np.uint8).reshape(n, frames, h, w, 3)
    rows = {
        "metrics": {"reward_mean": np.float64(0.25), "ratio_dev": np.float64(np.nan)},
        "samples": {"video": videos, "image": videos[:, frames // 2],
                    "prompt": np.array([f"prompt {s // 2}" for s in range(n)]),
                    "reward": np.linspace(0, 1, n), "valid": np.arange(n) != 7},
        "eval": {"version": np.array([3, 3, 3, 3], np.int32),
                 "prompt_index": np.array([2, 0, 3, 1], np.int32),
                 "prompt": np.array(["c", "a", "d", "b"]), "reward": np.array([1., 2., 3., 4.]),
                 "reward_ocr": np.array([0.5, 1., 0., 0.25]),
                 "reward_ranked": np.full(4, np.nan),  # a group reward: not evaluated
                 "valid": np.array([True, True, False, True]),
                 "image": np.zeros((4, h, w, 3), np.uint8)},
    }
    log = IterationLog.from_rows(4, rows, tracking)
    assert log.metrics == {"reward_mean": 0.25}
    grid = log.samples
    assert grid.images.shape == (3, h, STRIP_FRAMES * w, 3)
    assert np.array_equal(grid.images[1][:, :w], videos[4, 0])  # samples 0, 4, 7: first frame
    assert grid.captions() == ["prompt 0\nreward 0.0000", "prompt 2\nreward 0.5714",
                               "prompt 3\n(no reward)"]
    (e,) = log.evaluations
    assert (e.version, e.reward_mean, e.prompts) == (3, pytest.approx(7 / 3), 4)
    # Each reward's own mean over the valid rows (an OCR reward's: held-out accuracy).
    assert e.scalars() == {"eval/reward_mean": pytest.approx(7 / 3),
                           "eval/rewards/ocr": pytest.approx(1.75 / 3)}
    assert e.grid.prompts == ["a", "b", "c"]   # the first held-out prompts, by index
    picture = e.grid.picture()
    assert picture.dtype == np.uint8 and picture.ndim == 3 and picture.shape[2] == 3
    # Iteration 5 is no multiple of image_every: no sample grid.
    assert IterationLog.from_rows(5, rows, tracking).samples is None

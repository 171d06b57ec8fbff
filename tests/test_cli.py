"""The command line: flags reach the config; bad input fails before any work."""

import pytest

from digenrl.commands.cli import build_parser, config_from_args, main

#: No scheduler listens here: reaching it would be a connection error, not a field error.
UNREACHABLE = "tcp://127.0.0.1:1"


def test_flags_override_the_config():
    args = build_parser().parse_args([
        "run", "--out", "x.zarr", "--mode", "disaggregated", "--iterations", "7",
        "--seed", "9", "--reward", "jpeg_incompressibility=2,colorfulness=0.5",
        "--rollout-workers", "3", "--trainer-workers", "2", "--max-staleness", "2",
        "--no-tag", "--gap", "--set", "train.kl_beta=0.01", "--set", "schedule.stale_groups=1"])
    cfg = config_from_args(args)
    assert cfg.schedule.mode == "disaggregated" and cfg.iterations == 7 and cfg.seed == 9
    assert cfg.reward.components == {"jpeg_incompressibility": 2.0, "colorfulness": 0.5}
    assert (cfg.cluster.rollout_workers, cfg.cluster.trainer_workers) == (3, 2)
    opts = cfg.schedule.options()
    assert (opts.max_staleness, opts.tag, opts.gap, opts.tsp) == (2, False, True, False)
    assert cfg.train.kl_beta == 0.01 and cfg.schedule.stale_groups == 1


@pytest.mark.parametrize("argv,message", [
    (["--reward", "nonsense"], "reward.components: expected one of"),
    (["--mode", "fast"], "schedule.mode: expected one of"),
    (["--set", "data.samples_per_prompt=1"], "data.samples_per_prompt: expected an integer >= 2, got 1"),
    (["--set", "sampler.num_steps=1"], "sampler.num_steps: expected an integer from 2 to 1000"),
    (["--set", "rollout.chunk_size=3"], "rollout.chunk_size: expected a divisor or a multiple"),
    (["--rollout-workers", "0"], "cluster.rollout_workers: expected an integer >= 1, got 0"),
    (["--set", "model.path=/no/such/folder"], "model.path: expected an existing folder"),
    (["--set", "nonsense"], "--set: expected SECTION.FIELD=VALUE, got 'nonsense'"),
    (["--reward", "a=b"], "--reward: expected NAME or NAME=WEIGHT"),
])
def test_bad_input_fails_before_any_work(tmp_path, capsys, argv, message):
    out = tmp_path / "run.zarr"
    # Each case also names an unreachable scheduler: had the run started any cluster
    # work, the error would be about the connection, not the field.
    code = main(["run", "--out", str(out), "--scheduler", UNREACHABLE, *argv]
                if "--rollout-workers" not in argv else ["run", "--out", str(out), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err
    assert not out.exists()


def test_an_unreachable_scheduler_is_a_clear_error(tmp_path, capsys):
    code = main(["run", "--out", str(tmp_path / "r.zarr"), "--scheduler", UNREACHABLE,
                 "--set", "cluster.connect_timeout=1"])
    err = capsys.readouterr().err
    assert code == 2 and "cluster.scheduler: expected a reachable Dask scheduler" in err


def test_a_timed_out_connection_to_the_runs_scheduler_is_a_lost_scheduler():
    from digenrl.commands.cli import _lost_scheduler

    timed_out = OSError("Timed out trying to connect to tcp://127.0.0.1:8786 after 10 s")
    try:  # as the driver meets it: raised while handling another error
        try:
            raise RuntimeError("commit")
        except RuntimeError:
            raise timed_out
    except OSError as e:
        chained = RuntimeError("outer")
        chained.__cause__ = e
    assert _lost_scheduler(chained, "tcp://127.0.0.1:8786")
    assert _lost_scheduler(timed_out, "127.0.0.1:8786")
    # Another address (a reward server, a worker), or no scheduler given: not the loss.
    assert not _lost_scheduler(timed_out, "tcp://127.0.0.1:9999")
    assert not _lost_scheduler(timed_out)


def test_futures_cancelled_together_for_the_lost_scheduler_are_a_lost_scheduler():
    """``distributed.wait`` on futures the client cancelled when it lost its scheduler
    raises one error for all of them (as the driver meets it when only a checkpoint is
    left to wait for); another reason for cancelling is not the loss."""
    from distributed.client import (CancelledFuturesGroup, FutureCancelledError,
                                    FuturesCancelledError)

    from digenrl.commands.cli import _lost_scheduler

    def cancelled(reason):
        errors = [FutureCancelledError(("checkpoint", 4), reason, "Client lost the connection")]
        return FuturesCancelledError([CancelledFuturesGroup(errors, reason)])

    assert _lost_scheduler(cancelled("scheduler-connection-lost"))
    assert not _lost_scheduler(cancelled("unknown"))


def test_check_names_the_defaults_of_the_dynamics_a_config_runs(caplog):
    """``digenrl run --check`` says which defaults a run gets: Flow-GRPO's with the dynamics
    the config names (docs/algorithm.md, "Each algorithm's defaults")."""
    config = "workflows/configs/tiny.yaml"
    said = "flow_grpo's defaults with {} dynamics (a config that leaves them unset gets " \
           "these): train.learning_rate {}"
    with caplog.at_level("INFO", logger="digenrl"):
        assert main(["run", config, "--check", "--set", "algorithm.dynamics=cps"]) == 0
        assert main(["run", config, "--check"]) == 0
    assert said.format("cps", "0.0025") in caplog.messages, caplog.messages
    assert said.format("flow", "0.0015") in caplog.messages, caplog.messages

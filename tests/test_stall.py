"""A run that cannot progress says so: once no GPU task has finished for the configured
``schedule.stall_timeout`` and the progress watchdog has nothing left to try, ``digenrl
run`` stops with one line naming what it waits for, exit status 1, and a store that
``--resume`` finishes."""

from __future__ import annotations

from distributed.core import Status

from digenrl.store import committed_iterations, open_run

from conftest import assert_complete
from test_driver_loss import resume
from test_signals import start_run

#: Short, so the test is quick; long enough for a tiny model's slowest step on a
#: loaded machine.
STALL = 6.0
#: Two more than the driver keeps in the scheduler at once (the oldest iteration it has
#: not collected and two more, with one-step staleness), so that work is left when the
#: workers pause once it has collected the first, however far the pipeline ran ahead.
ITERATIONS = 5


def wait_for_iteration(proc, i: int) -> list[str]:
    """Read the run's log until the driver has collected iteration ``i`` (its line);
    returns the lines read."""
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if f" iteration {i}/" in line:
            return lines
    raise AssertionError("the run ended first: " + "".join(lines))


def _pause(dask_worker, paused: bool) -> None:
    """Pause (or resume) the worker as its memory monitor does, with the monitor kept
    from resuming it (its memory is low)."""
    mm = dask_worker.memory_manager
    if paused:
        mm._digenrl_pause_fraction = mm.memory_pause_fraction
        mm.memory_pause_fraction = False
        dask_worker.status = Status.paused
    else:
        mm.memory_pause_fraction = getattr(mm, "_digenrl_pause_fraction",
                                           mm.memory_pause_fraction)
        dask_worker.status = Status.running


def test_a_run_whose_workers_are_all_paused_stops_and_says_what_it_waits_for(
        cluster_1x1, tmp_path):
    client = cluster_1x1.client
    proc, out, address = start_run(tmp_path, cluster_1x1, {"schedule": {"stall_timeout": STALL}},
                                   iterations=ITERATIONS)
    try:
        head = wait_for_iteration(proc, 1)
        client.run(_pause, paused=True)
        _, err = proc.communicate(timeout=120)
        err = "".join(head) + err
    finally:
        client.run(_pause, paused=False)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err
    assert "Traceback" not in err
    done = assert_complete(open_run(out))
    assert 1 <= done == committed_iterations(out) < ITERATIONS
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"digenrl run: error: run stalled at iteration {done}: no GPU "
                           f"task finished for "), err
    assert f"(stall timeout {STALL:.0f} s)" in last
    assert "waiting for: (" in last
    assert "workers: rollout-0 paused, trainer-0 paused" in last, last
    assert last.endswith(f"; {out} holds {done} complete iteration{'s' if done != 1 else ''}"
                         f"; continue with: digenrl run --resume {out} --scheduler {address}")
    assert resume(out, cluster_1x1) == 0
    assert assert_complete(open_run(out)) == ITERATIONS

"""The peer benchmark (workflows/peer_flow_grpo.py) without a flow_grpo checkout: one
line that says why and how to get it, exit status 0, nothing run."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_without_a_checkout_the_peer_benchmark_skips_in_one_line(tmp_path):
    out = tmp_path / "peer"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "workflows" / "peer_flow_grpo.py"), "--flow-grpo",
         str(tmp_path / "missing"), "--out", str(out), "--variants", "flow_grpo-x2,digenrl"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("peer_flow_grpo: skipped: "), proc.stdout
    assert "ac4c86e" in lines[0] and "Traceback" not in proc.stderr
    assert not out.exists()  # nothing was run or written


def test_bad_rounds_are_refused_naming_the_flag(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "workflows" / "peer_flow_grpo.py"), "--out",
         str(tmp_path / "peer"), "--rounds", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "error: --rounds: expected an integer >= 1, got 0"), proc.stderr

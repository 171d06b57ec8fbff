"""mypy finds no error in ``digenrl/`` (``[tool.mypy]`` in pyproject.toml: the default
strictness, diffusers, transformers and peft taken as untyped).

It runs as one of the suite's tests, ``python -m mypy`` from the repository root in a
process of its own (its memory freed when it ends), so that the type check shares the
suite's processes with the other files instead of running alone before them;
``tests/conftest.py`` hands this file out first, since it takes over a minute."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.first
def test_mypy_finds_no_error_in_the_package():
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL)
    report = done.stdout + done.stderr
    assert done.returncode == 0, "python -m mypy failed:\n" + report[-20000:]
    assert "Success: no issues found" in done.stdout, report

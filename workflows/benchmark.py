"""Benchmark every mode and ablation on the same work: the script form of ``digenrl bench``.

    python workflows/benchmark.py workflows/configs/tiny.yaml --out runs/bench --iterations 12
"""

import sys

from digenrl.commands.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))

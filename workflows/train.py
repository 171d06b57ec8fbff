"""Post-training with the configured algorithm as a batch job: the script form of
``digenrl run``.

    python workflows/train.py workflows/configs/tiny.yaml --out runs/tiny.zarr

Takes the same flags as ``digenrl run``. Stages: load and validate the config (and check
it against the model, prompts and rewards it names), start or connect to the cluster,
train (writing the store iteration by iteration), summarise.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from digenrl.commands.cli import build_parser, config_from_args
from digenrl.run.cluster import start_cluster
from digenrl.config import ConfigError, config_to_dict
from digenrl.run.world import check_world
from digenrl.run.runner import Runner

log = logging.getLogger("digenrl.workflow")


def stage_config(argv):
    args = build_parser().parse_args(["run", *argv])
    config = config_from_args(args)
    check_world(config)  # before the cluster starts
    log.info("config: %s", json.dumps(config_to_dict(config)["schedule"]))
    return args, config


def stage_cluster(config):
    return start_cluster(config.cluster, pools=config.schedule.options().pools)


def stage_train(config, cluster, out: str, overwrite: bool):
    return Runner(config, out, overwrite=overwrite, cluster=cluster).run()


def stage_summary(result) -> None:
    first, last = result.iterations[0], result.iterations[-1]
    log.info("reward %.4f -> %.4f over %d iterations; store: %s", first.reward_mean,
             last.reward_mean, len(result.iterations), Path(result.store).resolve())


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    try:
        args, config = stage_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"flow_grpo: error: {e}", file=sys.stderr)
        return 2
    cluster = stage_cluster(config)
    try:
        result = stage_train(config, cluster, args.out, args.overwrite)
    finally:
        cluster.close()
    stage_summary(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

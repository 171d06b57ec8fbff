"""flow_grpo's own training loop beside digenrl, on the same cores, folder and workload.

    python workflows/peer_flow_grpo.py --flow-grpo ~/src/flow_grpo \\
        --peer-python ~/venvs/flow_grpo/bin/python --out runs/peer --iterations 8

flow_grpo (https://github.com/yifan123/flow_grpo) is the peer a user compares digenrl
with on a small cluster: a co-located, synchronous data-parallel loop. This script runs
its unmodified ``scripts/train_sd3.py`` (2 processes under torchrun, its multi-GPU mode,
gloo on CPUs; and 1 process) and digenrl's modes on one random-weight SD3 pipeline folder
with the compute of digenrl's built-in default (a 4.66M-parameter transformer, 64 image
and 205 text tokens), with the same workload on both sides: 4 prompts x 4 images per
iteration, 8 SDE steps at noise level 0.7, the first 4 trained, one AdamW step per
iteration, full weights in float32, the JPEG-compressibility reward. It prints
images per second over the steady state (the end of iteration 1's optimizer step to the
end of the last one's) and each system's ratio to the first variant (flow_grpo's
two-process loop by default). The systems run one after another on the same cores, so a
neighbour's load during one of them moves its figure: ``--rounds N`` runs the variants in
turn N times and prints the medians, each ratio taken within its round.

Nothing of flow_grpo is vendored. Get it and the environment it runs in (its own
requirements pin old versions; these are the ones it runs with here, on CPUs)::

    git clone https://github.com/yifan123/flow_grpo ~/src/flow_grpo
    git -C ~/src/flow_grpo checkout ac4c86e
    python3 -m venv ~/venvs/flow_grpo
    ~/venvs/flow_grpo/bin/pip install torch==2.13.0 "diffusers>=0.42,<0.43" \\
        "transformers>=5,<6" accelerate absl-py ml_collections wandb peft sentencepiece

Without a checkout (or its environment) the script says so in one line and exits 0.
flow_grpo runs unmodified: its optimizer steps are timed from outside, by a
``sitecustomize`` module put on its ``PYTHONPATH`` that registers torch's global
optimizer-step hook; with ``--reward-delay S`` the same module makes each call of
flow_grpo's JPEG reward wait ``S`` seconds first (a judge-like reward that answers after
a delay), and digenrl scores the same reward behind the same delay
(``workflows/peer_rewards.py``).
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from digenrl.testing.pipelines import save_sd3_default_compute

logger = logging.getLogger("digenrl.peer")

#: The workload both sides run.
PROMPTS_PER_ITERATION = 4
SAMPLES_PER_PROMPT = 4
IMAGES_PER_ITERATION = PROMPTS_PER_ITERATION * SAMPLES_PER_PROMPT
NUM_STEPS = 8
TRAINED_STEPS = 4
NOISE_LEVEL = 0.7
RESOLUTION = 64
#: Samples one forward pass holds on both sides (a digenrl chunk, a flow_grpo batch).
BATCH = 4
LEARNING_RATE = 1.5e-3
#: T5 tokens of a prompt's encoding (flow_grpo's SD3 script always uses 128).
MAX_SEQUENCE_LENGTH = 128
#: The flow_grpo commit this benchmark runs (the figures in docs/performance.md are of it).
FLOW_GRPO_COMMIT = "ac4c86e"
#: What flow_grpo's training script imports (besides itself).
PEER_IMPORTS = ("torch", "diffusers", "transformers", "accelerate", "absl", "ml_collections",
                "wandb", "peft")

PEER_VARIANTS = {"flow_grpo-x2": 2, "flow_grpo-x1": 1}
DIGENRL_VARIANTS = ("digenrl", "colocated", "disaggregated")
DEFAULT_VARIANTS = ("flow_grpo-x2", "digenrl", "colocated")

# The config flow_grpo reads (ml_collections), written next to the run: its own base
# config with the workload above.
_PEER_CONFIG = '''\
import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "base", os.path.join(os.environ["PEER_FLOW_GRPO"], "config", "base.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)


def get_config(name=None):
    c = base.get_config()
    c.pretrained.model = os.environ["PEER_MODEL"]
    c.dataset = os.environ["PEER_DATA"]
    c.logdir = c.save_dir = os.environ["PEER_OUT"]
    c.use_lora = False
    c.mixed_precision = "no"
    c.resolution = {resolution}
    c.eval_freq = c.save_freq = 10 ** 9
    c.sample.num_steps = c.sample.eval_num_steps = {num_steps}
    c.sample.guidance_scale = 1.0
    c.sample.noise_level = {noise_level}
    c.sample.num_image_per_prompt = {samples_per_prompt}
    c.sample.train_batch_size = c.sample.test_batch_size = {batch}
    c.sample.num_batches_per_epoch = int(os.environ["PEER_BATCHES"])
    c.sample.global_std = False
    c.train.batch_size = {batch}
    c.train.gradient_accumulation_steps = int(os.environ["PEER_BATCHES"])
    c.train.cfg = False
    c.train.timestep_fraction = {fraction}
    c.train.learning_rate = {learning_rate}
    c.train.beta = 0.0
    c.prompt_fn = "general_ocr"
    c.reward_fn = {{"jpeg_compressibility": 1.0}}
    c.per_prompt_stat_tracking = True
    return c
'''

# Put on flow_grpo's PYTHONPATH: times each optimizer step, and delays its JPEG reward.
_SITECUSTOMIZE = '''\
import os

if os.environ.get("PEER_STEPS"):
    import time

    from torch.optim.optimizer import register_optimizer_step_post_hook

    def _note_step(optimizer, args, kwargs):
        with open(os.environ["PEER_STEPS"] + "." + os.environ.get("RANK", "0"), "a") as f:
            f.write(repr(time.time()) + "\\n")

    register_optimizer_step_post_hook(_note_step)

    _delay = float(os.environ.get("PEER_REWARD_DELAY", "0"))
    if _delay > 0:
        import flow_grpo.rewards as _rewards

        _jpeg = _rewards.jpeg_compressibility

        def jpeg_compressibility():
            fn = _jpeg()

            def _delayed(*args, **kwargs):
                time.sleep(_delay)
                return fn(*args, **kwargs)

            return _delayed

        _rewards.jpeg_compressibility = jpeg_compressibility
'''


# --------------------------------------------------------------------- the folder


def write_prompts(folder: Path) -> Path:
    """The prompts both sides draw from: flow_grpo's ``train.txt`` / ``test.txt`` layout,
    and digenrl's prompt file (the same ``train.txt``)."""
    from digenrl.prompts import PROMPT_SETS

    folder.mkdir(parents=True, exist_ok=True)
    prompts = PROMPT_SETS["simple_animals"]
    (folder / "train.txt").write_text("\n".join(prompts) + "\n")
    (folder / "test.txt").write_text("\n".join(prompts[:BATCH]) + "\n")
    return folder


# --------------------------------------------------------------------- measuring


def steady_images_per_s(step_times: list[float], iterations: int) -> float:
    """Images per second between the end of iteration 1's optimizer step and the end of
    iteration ``iterations``'s (the first is start-up on both sides)."""
    t = sorted(step_times)[:iterations]
    if len(t) < iterations or iterations < 2:
        return float("nan")
    return IMAGES_PER_ITERATION * (iterations - 1) / (t[-1] - t[0])


def check_peer(flow_grpo: Path | None, python: str) -> str | None:
    """Why flow_grpo cannot run here (None when it can)."""
    if flow_grpo is None:
        return "no flow_grpo checkout given (--flow-grpo)"
    if not (flow_grpo / "scripts" / "train_sd3.py").is_file():
        return f"no flow_grpo checkout at {flow_grpo} (scripts/train_sd3.py is missing)"
    probe = subprocess.run([python, "-c", "import " + ", ".join(PEER_IMPORTS)],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["it does not run"])[-1]
        return f"{python} cannot run flow_grpo ({last})"
    return None


def run_flow_grpo(flow_grpo: Path, python: str, processes: int, folder: Path,
                  data: Path, out: Path, iterations: int, reward_delay: float) -> list[float]:
    """flow_grpo's ``scripts/train_sd3.py`` until it has taken ``iterations`` optimizer
    steps; returns when each ended (rank 0)."""
    out.mkdir(parents=True, exist_ok=True)
    config = out / "peer_config.py"
    config.write_text(_PEER_CONFIG.format(
        resolution=RESOLUTION, num_steps=NUM_STEPS, noise_level=NOISE_LEVEL,
        samples_per_prompt=SAMPLES_PER_PROMPT, batch=BATCH,
        fraction=TRAINED_STEPS / NUM_STEPS, learning_rate=LEARNING_RATE))
    hook = out / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    steps = out / "steps"
    for old in out.glob("steps.*"):
        old.unlink()
    env = {**os.environ, "PEER_FLOW_GRPO": str(flow_grpo), "PEER_MODEL": str(folder),
           "PEER_DATA": str(data), "PEER_OUT": str(out / "logs"), "PEER_STEPS": str(steps),
           "PEER_BATCHES": str(IMAGES_PER_ITERATION // (BATCH * processes)),
           "PEER_REWARD_DELAY": str(reward_delay), "WANDB_MODE": "disabled",
           "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": str(2 // processes),
           "PYTHONPATH": os.pathsep.join([str(hook), str(flow_grpo)])}
    script = ["scripts/train_sd3.py", f"--config={config}:get"]
    cmd = ([python, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
            "--standalone", *script] if processes > 1 else [python, *script])
    with open(out / "flow_grpo.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=flow_grpo, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        rank0 = Path(f"{steps}.0")
        try:
            while proc.poll() is None:
                if rank0.exists() and len(rank0.read_text().split()) >= iterations:
                    break
                time.sleep(0.5)
            else:
                raise RuntimeError(f"flow_grpo exited with status {proc.returncode} before "
                                   f"{iterations} optimizer steps: see {out / 'flow_grpo.log'}")
        finally:
            if proc.poll() is None:   # it trains forever: stop its whole process group
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
    return [float(t) for t in rank0.read_text().split()]


def run_digenrl(mode: str, folder: Path, data: Path, out: Path, iterations: int,
                reward_delay: float) -> list[float]:
    """digenrl in ``mode`` on its default local cluster (one rollout and one trainer
    worker process); returns when each optimizer step ended. Without a reward delay (a
    setting of this process's environment) the config it ran is written beside its store
    as ``MODE.yaml``, which ``workflows/overhead.py`` takes to show where the run's CPU
    goes."""
    import yaml

    from digenrl.config import config_from_dict
    from digenrl.run.runner import Runner
    from digenrl.store import open_run
    from digenrl.vocabulary import OPTIMIZE

    reward = "jpeg_compressibility"
    if reward_delay > 0:
        import peer_rewards

        os.environ["PEER_REWARD_DELAY"] = str(reward_delay)  # (the workers inherit it)
        reward = peer_rewards.NAME
    settings = {
        "seed": 0, "iterations": iterations,
        "model": {"path": str(folder.resolve()), "height": RESOLUTION, "width": RESOLUTION,
                  "max_sequence_length": MAX_SEQUENCE_LENGTH},
        "sampler": {"num_steps": NUM_STEPS, "noise_level": NOISE_LEVEL, "guidance_scale": 1.0,
                    "timestep_fraction": TRAINED_STEPS / NUM_STEPS},
        "data": {"prompt_file": str((data / "train.txt").resolve()),
                 "prompts_per_iteration": PROMPTS_PER_ITERATION,
                 "samples_per_prompt": SAMPLES_PER_PROMPT},
        "rollout": {"chunk_size": BATCH},
        "reward": {"components": {reward: 1.0}},
        "train": {"learning_rate": LEARNING_RATE},
        "schedule": {"mode": mode},
        "cluster": {"rollout_workers": 1, "trainer_workers": 1, "dashboard_address": None},
    }
    config = config_from_dict(settings)
    store = out / f"{mode}.zarr"
    if reward_delay == 0:
        (out / f"{mode}.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    Runner(config, str(store), overwrite=True).run()
    tasks = open_run(store)["tasks"].to_dataframe()
    return sorted(tasks[tasks.kind == OPTIMIZE].stop.astype(float).tolist())


# --------------------------------------------------------------------- the table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flow-grpo", type=Path, default=None,
                   help=f"a flow_grpo checkout (measured at commit {FLOW_GRPO_COMMIT})")
    p.add_argument("--peer-python", default=sys.executable,
                   help="the Python of flow_grpo's environment (default: this one)")
    p.add_argument("--out", type=Path, required=True, help="a folder for the runs")
    p.add_argument("--iterations", type=int, default=8, help="iterations of each run (>= 3)")
    p.add_argument("--reward-delay", type=float, default=0.0,
                   help="seconds each reward call waits before it scores (both sides)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"of {', '.join([*PEER_VARIANTS, *DIGENRL_VARIANTS])}")
    p.add_argument("--rounds", type=int, default=1,
                   help="times each variant runs, the variants in turn in each round; the "
                        "table gives each system's median images/s and its median ratio "
                        "to the first system within a round")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(PEER_VARIANTS) - set(DIGENRL_VARIANTS))
    if unknown or args.iterations < 3 or args.reward_delay < 0 or args.rounds < 1:
        p.error(f"--variants: unknown {unknown}" if unknown else
                f"--iterations: expected an integer >= 3, got {args.iterations}"
                if args.iterations < 3 else
                f"--rounds: expected an integer >= 1, got {args.rounds}" if args.rounds < 1
                else f"--reward-delay: expected seconds >= 0, got {args.reward_delay}")
    peer = [v for v in variants if v in PEER_VARIANTS]
    if peer:
        why = check_peer(args.flow_grpo, args.peer_python)
        if why is not None:
            print(f"peer_flow_grpo: skipped: {why} (see this script's docstring for how to "
                  f"get flow_grpo at commit {FLOW_GRPO_COMMIT})")
            return 0
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    folder = out / "sd3-default-compute"
    if not (folder / "model_index.json").is_file():
        shutil.rmtree(folder, ignore_errors=True)
        save_sd3_default_compute(folder)
    data = write_prompts(out / "prompts")
    rounds: list[dict[str, float]] = []  # each round's images/s by system
    for r in range(args.rounds):
        rates: dict[str, float] = {}
        for name in variants:
            logger.info("round %d: running %s", r + 1, name)
            if name in PEER_VARIANTS:
                times = run_flow_grpo(args.flow_grpo.resolve(), args.peer_python,
                                      PEER_VARIANTS[name], folder.resolve(), data.resolve(),
                                      (out / name).resolve(), args.iterations,
                                      args.reward_delay)
            else:
                times = run_digenrl(name, folder, data, out, args.iterations,
                                    args.reward_delay)
            rates[name] = steady_images_per_s(times, args.iterations)
            logger.info("%s: %.3f images/s", name, rates[name])
        rounds.append(rates)
    with open(out / "peer.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["round", "system", "images_per_s", "ratio"])
        for r, rates in enumerate(rounds):
            for name, rate in rates.items():
                w.writerow([r + 1, name, rate, rate / rates[variants[0]]])
    print(f"{'system':<16}{'images/s':>10}{'ratio':>8}   (reward delay {args.reward_delay} s,"
          f" {args.iterations} iterations, steady state from iteration 2"
          + (f"; medians of {args.rounds} rounds" if args.rounds > 1 else "") + ")")
    for name in variants:
        rate = float(np.median([rates[name] for rates in rounds]))
        ratio = float(np.median([rates[name] / rates[variants[0]] for rates in rounds]))
        print(f"{name:<16}{rate:>10.3f}{ratio:>8.2f}")
    return 0 if all(np.isfinite(list(rates.values())).all() for rates in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())

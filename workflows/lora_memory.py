"""Peak memory of a trainer worker and bytes shipped per policy version: LoRA against
full fine-tuning, on a FLUX-shaped transformer small enough for a CPU.

    python workflows/lora_memory.py [--rank 16] [--width 512] [--dtype float32]

Each mode runs in a fresh process doing what a trainer worker does for one version:
build the transformer (``digenrl.models.lora.build_policy``, frozen weights cast to
``--dtype``), take one micro-step's gradient through the family's ``predict_velocity``
and one AdamW step (``digenrl.tasks.train.adamw_update``) on the trainable tensors. It
reports the process's peak resident memory and the bytes of the trainable tensors (what
a policy version carries), then the LoRA / full ratios in one table.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path


def save_transformer(folder: Path, width: int) -> None:
    """A FLUX.1-shaped transformer (double and single stream blocks, guidance embedding)
    and the ``model_index.json`` that names its family."""
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    heads = width // 64
    FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=4,
        attention_head_dim=64, num_attention_heads=heads, joint_attention_dim=width,
        pooled_projection_dim=width // 2, guidance_embeds=True,
        axes_dims_rope=(8, 28, 28)).save_pretrained(folder / "transformer")
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))


def one_version(folder: str, rank: int, dtype: str, width: int) -> dict:
    """In this process: one trainer micro-step and optimizer step; memory and bytes."""
    import torch

    from digenrl.config import ModelConfig, TrainConfig
    from digenrl.models.lora import build_policy, cast_for_forward, trainable_parameters, \
        trainable_spec
    from digenrl.models import predict_velocity
    from digenrl.models.base import Conditioning
    from digenrl.tasks.train import adamw_update

    # Only the transformer is loaded: no folder validation (it has no VAE or encoders).
    model = ModelConfig(path=folder, height=256, width=256, dtype=dtype)
    train = TrainConfig(lora_rank=rank)
    spec = trainable_spec(model, train)
    module = cast_for_forward(build_policy(model, spec, 0), model, spec)
    params = trainable_parameters(module)
    master = {n: p.detach().float().clone() for n, p in params.items()}
    n, g = 2, torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, 32, 32, generator=g)
    cond = Conditioning(("",) * n, {"embeds": torch.randn(n, 64, width, generator=g),
                                    "pooled": torch.randn(n, width // 2, generator=g)})
    v = predict_velocity(model, module, x, 0.5, cond, 3.5)
    grads = torch.autograd.grad(v.square().mean(), list(params.values()))
    grads = {name: gr.float() for name, gr in zip(params, grads)}
    zeros = {name: torch.zeros_like(t) for name, t in master.items()}
    new, _, _ = adamw_update(master, zeros, {k: z.clone() for k, z in zeros.items()}, grads,
                             1, train)
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "version_bytes": sum(t.numel() * t.element_size() for t in new.values()),
            "transformer_parameters": sum(p.numel() for p in module.parameters()),
            "trainable_parameters": sum(t.numel() for t in new.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--width", type=int, default=512, help="hidden size (64 per head)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--one", nargs=2, metavar=("FOLDER", "RANK"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_version(args.one[0], int(args.one[1]), args.dtype, args.width)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        save_transformer(Path(tmp), args.width)
        rows = {}
        for label, rank in (("full", 0), (f"lora r={args.rank}", args.rank)):
            out = subprocess.run([sys.executable, __file__, "--one", tmp, str(rank),
                                  "--dtype", args.dtype, "--width", str(args.width)],
                                 check=True, capture_output=True, text=True).stdout
            rows[label] = json.loads(out.strip().splitlines()[-1])
    full, lora = rows["full"], rows[f"lora r={args.rank}"]
    print(f"FLUX-shaped transformer, width {args.width}, "
          f"{full['transformer_parameters'] / 1e6:.1f}M parameters, {args.dtype}")
    print(f"{'':14}{'trainable':>12}{'bytes/version':>16}{'peak RSS':>12}")
    for label, r in rows.items():
        print(f"{label:14}{r['trainable_parameters']:>12,}{r['version_bytes']:>16,}"
              f"{r['peak_rss_bytes'] / 2**20:>10.0f}MB")
    print(f"{'lora / full':14}{'':>12}{lora['version_bytes'] / full['version_bytes']:>16.4f}"
          f"{lora['peak_rss_bytes'] / full['peak_rss_bytes']:>12.3f}")


if __name__ == "__main__":
    main()

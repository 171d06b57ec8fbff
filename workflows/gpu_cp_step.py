"""Step time of a Wan2.1-T2V-14B-sized transformer on one CUDA GPU, plain and through
the context-parallel path (digenrl.tasks.ulysses) on a group of one.

Builds a diffusers ``WanTransformer3DModel`` with Wan2.1-T2V-14B's shape (40 layers, 40
heads x 128 = 5120 hidden, feed-forward 13824, text dim 4096, patch (1, 2, 2), 16 latent
channels in and out) with seeded random bf16 weights made directly on the GPU (the
parameters on the meta device first, then made and seeded there, the modules diffusers
keeps in float32 in float32: nothing is downloaded and no 14B-parameter CPU copy is
made), and times with CUDA events (``--warmup`` runs, then
the median of ``--iters``) one velocity prediction (no gradient) at batch 1 of each
``--sizes`` (frames x height x width in pixels: 81 x 480 x 832 is a 21 x 60 x 104
latent, 32760 tokens; 81 x 720 x 1280 is 21 x 90 x 160, 75600 tokens) with 512 text
tokens:

* ``plain``: the transformer as a run's rollout worker calls it;
* ``context-parallel, degree 1``: the same inside :func:`digenrl.tasks.ulysses.parallel`
  (what a context-parallel denoise step runs in) with Wan's plan on a process group of
  this one rank (NCCL, its store on 127.0.0.1) — diffusers 0.42.1's
  ``ContextParallelConfig`` refuses a degree of 1 (``ring_degree`` or ``ulysses_degree``
  must be above 1), and the table then says so instead of a time.

The attention backend (``--backend``): ``flash`` (the flash-attn package) where it is
installed, else ``native`` (PyTorch's scaled_dot_product_attention, whose own kernel
choice is its flash kernel on this shape); the header says which ran. TFLOP/s: the cost
profiles' estimate ``2 x parameters x tokens + 4 n^2 d L`` (n image tokens; self-attention
only, the cross-attention's 512 text tokens are left out) over the seconds per step. Peak
GiB: ``torch.cuda.max_memory_allocated`` during the size's runs.

It needs torch and diffusers (and digenrl's source beside it, not its other
dependencies: no Dask). ``--tiny`` runs the same code on the CPU (gloo, a 2-layer model with a small shape and
latent) in seconds: a smoke test where there is no GPU. Without CUDA and without
``--tiny`` it exits with status 2 and one line.

    python workflows/gpu_cp_step.py                      # 14B, 480p and 720p: ~2 minutes
    python workflows/gpu_cp_step.py --tiny --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]   # gpu_step_time beside it; digenrl above it
from gpu_step_time import materialize, on_meta, time_it  # noqa: E402

#: Wan2.1-T2V-14B's transformer config (its folder's transformer/config.json).
WAN_14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128,
               in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824,
               num_layers=40, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
               eps=1e-6, rope_max_seq_len=1024)
#: --tiny: the same code on a 2-layer model of a small shape.
TINY = dict(WAN_14B, num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=16,
            ffn_dim=64, num_layers=2)
#: WanPipeline's VAE: 4x fewer frames ((f - 1) / 4 + 1) and 8x fewer pixels per side.
TEMPORAL, SPATIAL = 4, 8


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="81x480x832,81x720x1280",
                   help="frames x height x width in pixels, comma-separated")
    p.add_argument("--text-tokens", type=int, default=512)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3, help="timed repetitions (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="auto", choices=["auto", "flash", "native"],
                   help="attention backend (auto: flash where flash-attn is installed, "
                        "else native)")
    p.add_argument("--tiny", action="store_true",
                   help="a 2-layer model of a small shape on the CPU, 9 x 64 x 64, 8 text "
                        "tokens: the same code in seconds")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if args.tiny:
        args.sizes, args.text_tokens = "9x64x64", 8
    try:
        args.sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",") if s]
        assert args.sizes and all(len(s) == 3 and min(s) > 0 for s in args.sizes)
    except (ValueError, AssertionError):
        p.error(f"--sizes: expected FRAMESxHEIGHTxWIDTH[,...], got {args.sizes!r}")
    return args


def latent(size: tuple[int, int, int]) -> tuple[int, int, int]:
    frames, height, width = size
    return ((frames - 1) // TEMPORAL + 1, height // SPATIAL, width // SPATIAL)


def build_model(shape: dict, device: str, seed: int, torch):
    """A WanTransformer3DModel of ``shape`` on ``device``, seeded random weights made
    there (bf16; float32 where the class keeps them so), its rotary tables computed."""
    from diffusers import WanTransformer3DModel
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    model = on_meta(lambda: WanTransformer3DModel(**shape), torch)
    return materialize(model, device, seed, torch)


def choose_backend(model, wanted: str) -> str:
    """Set the attention backend: ``flash`` where the flash-attn package imports (or
    asked for), else ``native``. Returns the one set."""
    if wanted in ("auto", "flash"):
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            if wanted == "flash":
                raise SystemExit("gpu_cp_step.py: --backend flash needs the flash-attn "
                                 "package, which this Python cannot import")
        else:
            model.set_attention_backend("flash")
            return "flash"
    model.set_attention_backend("native")
    return "native"


def inputs(shape: dict, size, text_tokens: int, device: str, seed: int, torch) -> dict:
    f, h, w = latent(size)
    g = torch.Generator(device=device).manual_seed(seed)
    bf = torch.bfloat16
    return dict(
        hidden_states=torch.randn(1, shape["in_channels"], f, h, w, generator=g,
                                  device=device, dtype=bf),
        timestep=torch.full((1,), 500.0, device=device, dtype=bf),
        encoder_hidden_states=torch.randn(1, text_tokens, shape["text_dim"], generator=g,
                                          device=device, dtype=bf),
        return_dict=False)


def one_rank_group(backend: str, torch):
    """A process group of this one rank (its TCP store on 127.0.0.1) and its device
    mesh of the context-parallel path's dimensions."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from digenrl.tasks.ulysses import MESH_DIMS

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=0, world_size=1)
    return init_device_mesh("cuda" if backend == "nccl" else "cpu", (1, 1),
                            mesh_dim_names=MESH_DIMS)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        print("gpu_cp_step.py: needs a CUDA GPU, and torch.cuda.is_available() is False "
              f"(torch {torch.__version__}); run it on a machine with an NVIDIA GPU, or "
              "with --tiny for the CPU smoke test", file=sys.stderr)
        return 2
    from digenrl.tasks.ulysses import parallel

    device = "cuda" if cuda else "cpu"
    shape = TINY if args.tiny else WAN_14B
    model = build_model(shape, device, args.seed, torch)
    backend = choose_backend(model, args.backend)
    params = sum(p.numel() for p in model.parameters())
    mesh = one_rank_group("nccl" if cuda else "gloo", torch)
    plan = type(model)._cp_plan
    d = shape["num_attention_heads"] * shape["attention_head_dim"]
    where = (f"{torch.cuda.get_device_properties(0).name}, CUDA {torch.version.cuda}"
             if cuda else "CPU (--tiny)")
    import diffusers

    print(f"device: {where}, torch {torch.__version__}, diffusers {diffusers.__version__}; "
          f"attention backend: {backend}")
    print(f"model: WanTransformer3DModel, {shape['num_layers']} layers x "
          f"{shape['num_attention_heads']} heads x {shape['attention_head_dim']}, "
          f"{params:.4g} parameters, bf16; batch 1, {args.text_tokens} text tokens")

    rows = []
    for size in args.sizes:
        f, h, w = latent(size)
        p = shape["patch_size"]
        n = (f // p[0]) * (h // p[1]) * (w // p[2])
        flops = 2.0 * params * n + 4.0 * n * n * d * shape["num_layers"]
        x = inputs(shape, size, args.text_tokens, device, args.seed, torch)

        def forward(x=x):
            with torch.inference_mode():
                model(**x)

        for path in ("plain", "context-parallel, degree 1"):
            row = dict(size=list(size), tokens=n, path=path, flops=flops)
            rows.append(row)
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                if path == "plain":
                    s = time_it(forward, args.warmup, args.iters, torch, cuda)
                else:
                    with parallel(model, plan, mesh):
                        s = time_it(forward, args.warmup, args.iters, torch, cuda)
            except ValueError as e:   # (diffusers refuses the configuration)
                row["refused"] = str(e).splitlines()[0]
                continue
            except torch.OutOfMemoryError:
                row["refused"] = "out of GPU memory"
                continue
            row.update(seconds=s, tflops=flops / s / 1e12,
                       peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)
        del x, forward    # (the next size's inputs need the memory)
    dist.destroy_process_group()

    print(f"\n{'size':28} {'path':28} {'s/step':>8} {'TFLOP/s':>8} {'peak GiB':>8}")
    for r in rows:
        what = f"{'x'.join(map(str, r['size']))} ({r['tokens']} tokens)"
        if "refused" in r:
            print(f"{what:28} {r['path']:28} refused: {r['refused']}")
            continue
        peak = f"{r['peak_gib']:8.1f}" if r["peak_gib"] is not None else f"{'-':>8}"
        print(f"{what:28} {r['path']:28} {r['seconds']:8.3f} {r['tflops']:8.1f} {peak}")
    print("\nTFLOP/s: 2 x parameters x tokens + 4 n^2 d L (self-attention) per step over "
          "its seconds.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=where, torch=torch.__version__,
                           diffusers=diffusers.__version__, backend=backend, params=params,
                           layers=shape["num_layers"], text_tokens=args.text_tokens,
                           rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

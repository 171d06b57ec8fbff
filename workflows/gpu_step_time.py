"""Step time of a FLUX.1-dev-sized transformer on one CUDA GPU.

Builds a diffusers ``FluxTransformer2DModel`` with FLUX.1-dev's shape (19 double and 38
single blocks, 24 heads x 128, 11.9e9 parameters) and seeded random bf16 weights
(nothing is downloaded), then times with CUDA events, after warm-ups, the median of
``--iters`` repetitions of:

* the denoising forward pass (one velocity prediction, no gradient) at batch 1 and 4;
* forward + backward at batch 1, without and with gradient checkpointing. No optimizer
  step: AdamW's fp32 state for 11.9e9 parameters (~95 GB) does not fit next to the
  model on one 80 GB GPU, and a trainer shards it across GPUs anyway.

At 1024x1024 a sample is 4096 image tokens (a 128x128 latent, 2x2 patches) plus 512
text tokens. FLOPs are given two ways: the cost profiles' estimate,
``2 x parameters x tokens + 4 n^2 d L`` (digenrl/sim/profiles/flux12b-16gpu.yaml), and the
matrix products actually executed (every Linear layer's rows x in x out x 2, counted
with hooks, plus the same attention term), which is lower because the adaLN modulation
layers (3.2e9 parameters) run once per sample, not per token, and each double block's
image and text weights see only their own tokens.

Attention: diffusers hands ``scaled_dot_product_attention`` permuted views of q, k and
v. With torch 2.11.0+cu130 (cuDNN 9.19) on an H100, the model's backward pass then
failed (``CUBLAS_STATUS_EXECUTION_FAILED`` or an illegal memory access) whichever
attention kernel ``--sdpa`` selected; under ``CUDA_LAUNCH_BLOCKING=1`` the failing kernel
was cuDNN attention's backward. The same call outside the model passed. Copying q, k, v
and the output gradient to contiguous memory (``--sdpa-contiguous``, the default) made
it pass and costs ~5% of the forward time (docs/gpu.md).

    python workflows/gpu_step_time.py                  # FLUX.1-dev size, ~2 minutes
    python workflows/gpu_step_time.py --layers 2 --single-layers 4 --iters 3   # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


#: --sdpa choices: names of torch.nn.attention.SDPBackend members.
SDPA = {"auto": None, "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
        "cudnn": "CUDNN_ATTENTION", "math": "MATH"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=19, help="double-stream blocks (19)")
    p.add_argument("--single-layers", type=int, default=38, help="single-stream blocks (38)")
    p.add_argument("--resolution", type=int, default=1024, help="image side in pixels")
    p.add_argument("--text-tokens", type=int, default=512)
    p.add_argument("--batch-sizes", default="1,4", help="forward batch sizes")
    p.add_argument("--train-batch", type=int, default=1, help="forward+backward batch size")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10, help="timed repetitions (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sdpa", default="auto", choices=sorted(SDPA),
                   help="attention kernel (default: PyTorch's choice)")
    p.add_argument("--blas", default="default", choices=["default", "cublas", "cublaslt"],
                   help="torch.backends.cuda.preferred_blas_library")
    p.add_argument("--sdpa-contiguous", action=argparse.BooleanOptionalAction, default=True,
                   help="give scaled_dot_product_attention contiguous inputs and a contiguous "
                        "output gradient (default; see the module docstring)")
    p.add_argument("--json", help="also write the results to this file")
    return p.parse_args(argv)


def contiguous_sdpa(torch) -> None:
    """Route every scaled_dot_product_attention call through contiguous q, k, v and a
    contiguous gradient of its output (diffusers passes permuted views)."""
    F = torch.nn.functional
    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, *args, **kwargs):
        out = original(query.contiguous(), key.contiguous(), value.contiguous(), *args, **kwargs)
        if out.requires_grad:
            out.register_hook(lambda g: g.contiguous())
        return out

    F.scaled_dot_product_attention = sdpa


def build_model(args, torch):
    """FLUX.1-dev's transformer shape with seeded random bf16 weights, built on the GPU.

    Created on the meta device and materialised on the GPU in bf16 (no 48 GB fp32
    copy); weights ~ N(0, 1/fan_in), biases zero, norm scales one."""
    from diffusers import FluxTransformer2DModel
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # the bf16 cast's "kept in float32: []" note

    with torch.device("meta"):   # (no buffers)
        model = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=args.layers,
            num_single_layers=args.single_layers, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
            guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    return materialize(model, "cuda", args.seed, torch)


def materialize(model, device, seed: int, torch):
    """A model whose parameters are on the meta device, with seeded random parameters
    made on ``device`` (no full-size copy anywhere else): ~ N(0, 1/fan_in), biases zero,
    norm scales one; in bf16, but those under the class's ``_keep_in_fp32_modules`` in
    float32, as ``from_pretrained(..., torch_dtype=torch.bfloat16)`` loads them. Its
    buffers (rotary tables, computed when the model was built: see :func:`on_meta`) are
    moved to ``device`` as they are."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for prefix, module in model.named_modules():
            for name, p in list(module._parameters.items()):
                if p is None:
                    continue
                full = f"{prefix}.{name}" if prefix else name
                fp32 = any(k in full.split(".") for k in keep)
                t = torch.empty(p.shape, device=device,
                                dtype=torch.float32 if fp32 else torch.bfloat16)
                if t.ndim >= 2:
                    t.normal_(0.0, t.shape[1] ** -0.5, generator=gen)
                elif name.endswith("bias"):
                    t.zero_()
                else:
                    t.fill_(1.0)
                module._parameters[name] = torch.nn.Parameter(t, requires_grad=p.requires_grad)
            for name, b in list(module._buffers.items()):
                if b is not None:
                    if b.is_meta:
                        raise ValueError(f"materialize: buffer {prefix}.{name} is on the meta "
                                         f"device (build the model with on_meta)")
                    module._buffers[name] = b.to(device)
    return model.eval()


def on_meta(build, torch):
    """``build()`` with every parameter created on the meta device (made later where it
    will live, by :func:`materialize`) and every buffer where torch makes it: buffers such
    as rotary tables are small and computed when the module is built."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        return build()
    finally:
        torch.nn.Module.register_parameter = register


def make_inputs(args, batch: int, torch):
    side = args.resolution // 16          # 8x VAE downsampling, then 2x2 patches
    n_img = side * side
    g = torch.Generator(device="cuda").manual_seed(args.seed + batch)
    dev, bf = "cuda", torch.bfloat16
    img_ids = torch.zeros(side, side, 3, device=dev)
    img_ids[..., 1] = torch.arange(side, device=dev)[:, None]
    img_ids[..., 2] = torch.arange(side, device=dev)[None, :]
    return dict(
        hidden_states=torch.randn(batch, n_img, 64, generator=g, device=dev, dtype=bf),
        encoder_hidden_states=torch.randn(batch, args.text_tokens, 4096, generator=g,
                                          device=dev, dtype=bf),
        pooled_projections=torch.randn(batch, 768, generator=g, device=dev, dtype=bf),
        timestep=torch.full((batch,), 0.5, device=dev, dtype=bf),
        guidance=torch.full((batch,), 3.5, device=dev, dtype=bf),
        img_ids=img_ids.reshape(-1, 3),
        txt_ids=torch.zeros(args.text_tokens, 3, device=dev),
        return_dict=False,
    )


def count_linear_flops(model, inputs, torch) -> float:
    """FLOPs of every Linear layer in one forward pass (2 x rows x in x out)."""
    total = [0.0]

    def hook(mod, inp, out):
        rows = inp[0].numel() // inp[0].shape[-1]
        total[0] += 2.0 * rows * mod.in_features * mod.out_features

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, torch.nn.Linear)]
    try:
        with torch.inference_mode():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return total[0]


def time_it(fn, warmup: int, iters: int, torch, cuda: bool = True) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs after ``warmup`` runs (CUDA events;
    with ``cuda`` false, the CPU's clock: a smoke test without a GPU)."""
    for _ in range(warmup):
        fn()
    if not cuda:
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_step_time.py: needs a CUDA GPU, and torch.cuda.is_available() is False "
              f"(torch {torch.__version__}); run it on a machine with an NVIDIA GPU and a "
              "CUDA build of PyTorch", file=sys.stderr)
        return 2

    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    if SDPA[args.sdpa] is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa_kernel(getattr(SDPBackend, SDPA[args.sdpa])).__enter__()  # for the whole run
    if args.sdpa_contiguous:
        contiguous_sdpa(torch)
    model = build_model(args, torch)
    params = sum(p.numel() for p in model.parameters())
    n_img = (args.resolution // 16) ** 2
    n = n_img + args.text_tokens
    blocks = args.layers + args.single_layers
    d = 24 * 128
    attn_flops = 4.0 * n * n * d * blocks        # QK^T and PV, per sample
    profile_flops = 2.0 * params * n + attn_flops
    counted_flops = count_linear_flops(model, make_inputs(args, 1, torch), torch) + attn_flops

    dev = torch.cuda.get_device_properties(0)
    print(f"device: {dev.name} ({dev.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}; attention: "
          f"{args.sdpa}{' (contiguous)' if args.sdpa_contiguous else ''}, BLAS: {args.blas}")
    print(f"model: FluxTransformer2DModel, {args.layers} double + {args.single_layers} single "
          f"blocks, {params / 1e9:.2f}e9 parameters, bf16; {args.resolution}x{args.resolution}: "
          f"{n_img} image + {args.text_tokens} text tokens")
    print(f"FLOPs per sample-forward: profile formula {profile_flops:.3e} "
          f"(2 x params x tokens {2.0 * params * n:.3e} + attention {attn_flops:.3e}); "
          f"executed {counted_flops:.3e}")

    rows = []

    def record(what, batch, seconds, fwd_equiv):
        per = seconds / batch
        rows.append(dict(what=what, batch=batch, seconds=seconds, per_sample=per,
                         profile_tflops=fwd_equiv * profile_flops / per / 1e12,
                         executed_tflops=fwd_equiv * counted_flops / per / 1e12,
                         peak_gib=torch.cuda.max_memory_allocated() / 2**30))

    for b in [int(x) for x in args.batch_sizes.split(",") if x]:
        inputs = make_inputs(args, b, torch)
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            s = time_it(lambda: model(**inputs), args.warmup, args.iters, torch)
        record("forward", b, s, 1.0)
        del inputs

    model.requires_grad_(True)
    model.train()
    inputs = make_inputs(args, args.train_batch, torch)

    def step():
        out = model(**inputs)[0]
        out.float().square().mean().backward()

    for ckpt in (False, True):
        what = "fwd+bwd, grad. checkpointing" if ckpt else "fwd+bwd"
        if ckpt:
            model.enable_gradient_checkpointing()
        else:
            model.disable_gradient_checkpointing()
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        error = None
        try:
            s = time_it(step, args.warmup, args.iters, torch)
        except torch.OutOfMemoryError:
            error = "out of GPU memory"
        except RuntimeError as e:  # a CUDA error leaves the context unusable: stop here
            error = f"failed: {str(e).splitlines()[0][:120]}"
        if error is not None:  # outside the except block, so the step's tensors are freed
            rows.append(dict(what=what, batch=args.train_batch, seconds=None, error=error))
            if not error.startswith("out of"):
                break
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            continue
        # Model FLOPs: backward = 2 forwards; a recomputed forward is not counted.
        record(what, args.train_batch, s, 3.0)
    if not any(r.get("error", "").startswith("failed") for r in rows):
        model.zero_grad(set_to_none=True)

    fwd1 = next((r for r in rows if r["what"] == "forward" and r["batch"] == 1
                 and r.get("seconds")), None)
    print()
    print(f"{'what':30} {'batch':>5} {'s/step':>8} {'s/sample':>9} {'train/fwd':>9} "
          f"{'TFLOP/s profile':>15} {'TFLOP/s executed':>16} {'peak GiB':>8}")
    for r in rows:
        if r.get("seconds") is None:
            print(f"{r['what']:30} {r['batch']:>5}   {r['error']}")
            continue
        ratio = (f"{r['per_sample'] / fwd1['per_sample']:.2f}"
                 if fwd1 and r["what"] != "forward" else "")
        print(f"{r['what']:30} {r['batch']:>5} {r['seconds']:8.3f} {r['per_sample']:9.3f} "
              f"{ratio:>9} {r['profile_tflops']:15.0f} {r['executed_tflops']:16.0f} "
              f"{r['peak_gib']:8.1f}")
    print("\ntrain/fwd: per-sample forward+backward time over the batch-1 forward time. "
          "TFLOP/s: FLOPs per sample (forward; x3 with backward) over seconds per sample.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=dev.name, torch=torch.__version__, params=params,
                           tokens=n, profile_flops=profile_flops,
                           executed_flops=counted_flops, rows=rows), f, indent=1)
    return 1 if any(r.get("error", "").startswith("failed") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""The instruction-editing families (Qwen-Image-Edit, FLUX.1 Kontext) on tiny saved
pipelines (digenrl/testing/pipelines.py): with the same source image, starting latents, steps and
guidance, the version-0 ODE sampler gives the diffusers pipeline's own latents; the
source image and the text encoders condition the samples; bad images are refused.

These tests give the family its images directly (``encode(prompts, negative,
images=...)``); tests/test_editing_runs.py runs with images named by prompt files."""

import numpy as np
import pytest
import torch
from PIL import Image

from digenrl.config import ConfigError
from digenrl.models import family, flow_sigmas
from digenrl.models.base import Conditioning, SourceImage
from digenrl.models.common import pack
from digenrl.models.qwen_processor import ImageTextProcessor
from digenrl.tasks import train
from digenrl.tasks.resident import resident
from digenrl.tasks.rollout import draw_normal
from digenrl.tasks.sde import sde_step

from conftest import pipeline_config, small_config
from digenrl.testing.pipelines import MODEL_SETTINGS, SAVERS

PIPELINES = {"qwenimage_edit": "QwenImageEditPipeline", "kontext": "FluxKontextPipeline"}
#: Qwen-Image-Edit's true classifier-free guidance; Kontext's guidance embedding.
GUIDANCE = {"qwenimage_edit": 2.5, "kontext": 3.5}
STEPS = 3


def source(height: int, width: int, seed: int) -> np.ndarray:
    """A smooth random picture, uint8 (height, width, 3)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (height // 8, width // 8, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(coarse).resize((width, height), Image.BILINEAR))


def edit_config(name, folder, **overrides):
    """small_config on the folder, with the checks of the folder a run makes (a run of
    a Qwen-Image-Edit folder also needs prompt lines naming source images)."""
    settings = {f"model.{k}": v for k, v in MODEL_SETTINGS[name].items()}
    cfg = small_config(**{"model.path": str(folder), "sampler.num_steps": STEPS,
                          "sampler.guidance_scale": GUIDANCE[name], **settings, **overrides})
    family(cfg.model).check_folder()
    family(cfg.model).check_size()
    return cfg


def version0(cfg):
    """The version-0 transformer (as the trainer's initial state publishes it, on a
    rollout worker) and the sigmas."""
    sigmas = flow_sigmas(cfg.sampler, cfg.model)
    spec = train.TrainSpec(cfg.model, cfg.sampler, cfg.train, cfg.seed, sigmas, normaliser=1)
    weights = train.publish(train.init_state(spec))
    return resident(cfg.model, cfg.seed).policy(weights), sigmas


def starting_noise(cfg, n: int) -> torch.Tensor:
    shape = family(cfg.model).latent_shape()
    return torch.stack([draw_normal(shape, cfg.seed, "edit-test", i) for i in range(n)])


def ode(cfg, x, cond, steps: int = STEPS) -> torch.Tensor:
    """digenrl's ODE sampler (noise level 0) from ``x`` under version 0."""
    model, sigmas = version0(cfg)
    fam = family(cfg.model)
    with torch.no_grad():
        for t in range(steps):
            v = fam.predict_velocity(model, x, sigmas[t], cond, cfg.sampler.guidance_scale)
            x = sde_step(x, v, sigmas[t], sigmas[t + 1], 0.0).next_latent
    return x


def encode(cfg, prompts, images):
    """The conditioning of ``prompts`` with their source ``images`` from the encoder a
    rollout worker holds (its text encoders, and the VAE for the sources)."""
    return resident(cfg.model, cfg.seed).encoder.encode(
        tuple(prompts), cfg.sampler.guidance_scale > 1.0, images=images)


def load_pipeline(name, folder):
    """The diffusers pipeline, float32; Qwen-Image-Edit's processor is
    ImageTextProcessor: transformers' Qwen2VLProcessor needs torchvision for its video
    processor (not installed here)."""
    import diffusers

    kw = {}
    if name == "qwenimage_edit":
        kw["processor"] = ImageTextProcessor.from_pretrained(folder / "processor")
    return getattr(diffusers, PIPELINES[name]).from_pretrained(folder, dtype=torch.float32, **kw)


def pipeline_latents(name, folder, cfg, prompt, image, x0, **extra) -> torch.Tensor:
    """The pipeline's packed latents for one prompt and source image from ``x0``
    (``extra``: more arguments of the pipeline's call)."""
    pipe = load_pipeline(name, folder)
    m = cfg.model
    kw = dict(image=Image.fromarray(image) if image is not None else None, prompt=[prompt],
              height=m.height, width=m.width, latents=pack(x0), num_inference_steps=STEPS,
              output_type="latent", **extra)
    if name == "qwenimage_edit":  # true classifier-free guidance
        kw.update(negative_prompt=m.negative_prompt, true_cfg_scale=cfg.sampler.guidance_scale)
    else:  # the image's area is the configured one (not the pipeline's 1024 x 1024)
        kw.update(guidance_scale=cfg.sampler.guidance_scale, max_area=m.height * m.width,
                  max_sequence_length=m.max_sequence_length)
    return pipe(**kw).images


@pytest.mark.parametrize("name", PIPELINES)
def test_the_ode_sampler_gives_the_edit_pipelines_latents(name, tiny_pipelines):
    """Kontext: two prompts with sources of different aspect ratios (other sizes, so
    other token counts) in one chunk; Qwen-Image-Edit (whose VAE encoding of a source of
    a megapixel is the slow part): one, with the negative prompt encoded with the image.
    Each sample equals the pipeline's for its prompt and source within float32
    rounding."""
    folder = tiny_pipelines[name]
    cfg = edit_config(name, folder)
    if name == "kontext":
        prompts, images = ("make it red", "a dog running"), [source(48, 64, 0), source(64, 40, 1)]
    else:
        prompts, images = ("make it red",), [source(48, 64, 0)]
    x0 = starting_noise(cfg, len(prompts))
    cond = encode(cfg, prompts, images)
    grids = cond.tensors["source_grid"].tolist()
    assert len(set(map(tuple, grids))) == len(prompts), grids  # a size per source
    if name == "qwenimage_edit":  # the negative prompt's encoding sees the image too
        assert cond.negative["embeds"].shape[0] == len(prompts)
    ours = pack(ode(cfg, x0, cond))
    for i, (prompt, image) in enumerate(zip(prompts, images)):
        theirs = pipeline_latents(name, folder, cfg, prompt, image, x0[i:i + 1])
        torch.testing.assert_close(ours[i:i + 1], theirs, rtol=1e-5, atol=1e-5)
    assert ours.abs().max() > 0.1  # something was computed


def test_a_source_area_resizes_each_source_to_about_that_many_pixels(tiny_pipelines):
    """model.source_area: each source resized to about that many pixels at its aspect
    ratio, each side on the packed latent grid (32 pixels with the tiny pipelines' 16 x
    VAEs), for both families. Kontext's samples are then its pipeline's given the
    resized source, which it takes at its own size (``_auto_resize=False``)."""
    images = [source(48, 64, 0), source(64, 40, 1)]
    # 64 x 64 pixels: 48 x 64 becomes 64 x 64 (2 x 2 packed tokens), 64 x 40 becomes
    # 96 x 64 (3 x 2).
    area = {"model.source_area": 64 * 64}
    for name in PIPELINES:
        cfg = edit_config(name, tiny_pipelines[name], **area)
        cond = encode(cfg, ("make it red", "make it blue"), images)
        assert cond.tensors["source_grid"].tolist() == [[2, 2], [3, 2]], name
        assert [len(t) for t in cond.tensors["source_tokens"]] == [6, 6]  # padded to 6

    folder = tiny_pipelines["kontext"]
    cfg = edit_config("kontext", folder, **area)
    fam = family(cfg.model)
    x0 = starting_noise(cfg, 2)
    ours = pack(ode(cfg, x0, encode(cfg, ("make it red", "make it blue"), images)))
    for i, (image, (h, w)) in enumerate(zip(images, [(64, 64), (96, 64)])):
        resized = np.asarray(fam.image_processor.resize(Image.fromarray(image), h, w))
        theirs = pipeline_latents("kontext", folder, cfg, ("make it red", "make it blue")[i],
                                  resized, x0[i:i + 1], _auto_resize=False)
        torch.testing.assert_close(ours[i:i + 1], theirs, rtol=1e-5, atol=1e-5)


def test_kontext_without_a_source_samples_as_its_pipeline_does(tiny_pipelines):
    """No source image: FluxKontextPipeline's ``image=None``, text to image (what a run
    on a Kontext folder samples when its prompt lines name no source images)."""
    folder = tiny_pipelines["kontext"]
    cfg = edit_config("kontext", folder)
    x0 = starting_noise(cfg, 1)
    cond = encode(cfg, ("a photo of a cat",), None)
    assert "source_tokens" not in cond.tensors
    theirs = pipeline_latents("kontext", folder, cfg, "a photo of a cat", None, x0)
    torch.testing.assert_close(pack(ode(cfg, x0, cond)), theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", PIPELINES)
def test_the_source_image_and_the_text_encoders_condition_the_samples(name, tiny_pipelines,
                                                                      tmp_path):
    """Another source image gives another step from the same latents; a folder
    differing only in its text encoders' weights (for Qwen-Image-Edit, the
    vision-language encoder that reads prompt and image together) gives another step
    from the same latents and source tokens."""
    folder = tiny_pipelines[name]
    cfg = edit_config(name, folder)
    prompt, a, b = "make it red", source(48, 64, 0), source(48, 64, 2)
    x0 = starting_noise(cfg, 1)
    cond = encode(cfg, (prompt,), [a])
    one = ode(cfg, x0, cond, steps=1)
    encoder = resident(cfg.model, cfg.seed).encoder
    if name == "qwenimage_edit":
        # The prompt's encoding with the other image (no VAE: the text encoder alone).
        with torch.no_grad():
            rows = encoder.encode_batch([(prompt, SourceImage.of(a)),
                                         (prompt, SourceImage.of(b))])
        assert not torch.equal(rows["embeds"][0], rows["embeds"][1])
    else:
        other = encode(cfg, (prompt,), [b])
        assert not torch.allclose(ode(cfg, x0, other, steps=1), one, atol=1e-4)

    other_folder = SAVERS[name](tmp_path / name, text_seed=7)
    cfg2 = edit_config(name, other_folder)
    text2 = resident(cfg2.model, cfg2.seed).encoder
    if name == "qwenimage_edit":
        with torch.no_grad():
            rows = text2.encode_batch([(prompt, SourceImage.of(a))])
            neg = text2.encode_batch([(cfg.model.negative_prompt, SourceImage.of(a))])
        cond2 = Conditioning(cond.prompts, {**cond.tensors, "embeds": rows["embeds"][0][None],
                                            "mask": rows["mask"][0][None]},
                             {"embeds": neg["embeds"][0][None], "mask": neg["mask"][0][None]})
    else:
        cond2 = encode(cfg2, (prompt,), [a])
        assert torch.equal(cond2.tensors["source_tokens"], cond.tensors["source_tokens"])
    assert not torch.allclose(ode(cfg2, x0, cond2, steps=1), one, atol=1e-4)
    # The transformers are the same: the difference is the text encoders'.
    ta, tb = (family(c.model).build_transformer(0).state_dict() for c in (cfg, cfg2))
    assert all(torch.equal(ta[k], tb[k]) for k in ta)


def test_gradients_flow_through_a_chunk_of_mixed_source_sizes(tiny_pipelines):
    """Samples whose sources differ in size go through the transformer in separate
    calls; the trainer's backward pass reaches the weights through each."""
    cfg = edit_config("kontext", tiny_pipelines["kontext"])
    images = [source(48, 64, 0), source(64, 40, 1)]
    cond = encode(cfg, ("make it red", "make it blue"), images)
    model, sigmas = version0(cfg)
    x = starting_noise(cfg, 2)
    grads = []
    for i in range(2):  # each sample's velocity alone, then the chunk's
        model.zero_grad()
        v = family(cfg.model).predict_velocity(model, x, sigmas[0], cond, 3.5)
        v[i].square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        assert grads[-1] and all(torch.isfinite(g).all() for g in grads[-1].values())
    name = "x_embedder.weight"
    assert grads[0][name].abs().sum() > 0 and grads[1][name].abs().sum() > 0
    assert not torch.equal(grads[0][name], grads[1][name])


def test_qwen_image_edit_needs_a_source_image(tiny_pipelines):
    """Its pipeline cannot sample without one: the encoder refuses, and so does the
    check of a run whose prompts name none, naming data.prompt_file."""
    cfg = edit_config("qwenimage_edit", tiny_pipelines["qwenimage_edit"])
    with pytest.raises(ValueError, match=r"^QwenImageEditPipeline: expected a source image "
                                         r"per prompt, got none$"):
        encode(cfg, ("make it red",), None)
    with pytest.raises(ConfigError, match=r"^data.prompt_file: expected a .jsonl prompt "
                                          r"file whose lines name source images "
                                          r"\(\"image\"\) for a QwenImageEditPipeline "
                                          r"folder, which edits images, got none \(prompts "
                                          r"without images\)$"):
        pipeline_config(tiny_pipelines["qwenimage_edit"], "qwenimage_edit")


def test_bad_source_images_are_refused(tiny_pipelines):
    cfg = edit_config("kontext", tiny_pipelines["kontext"])
    encoder = resident(cfg.model, cfg.seed).encoder
    with pytest.raises(ValueError, match=r"^images: expected one source image per prompt "
                                         r"\(2\), got 1$"):
        encoder.encode(("a", "b"), False, images=[source(48, 64, 0)])
    with pytest.raises(ValueError, match=r"^source image: expected uint8 pixels \(height, "
                                         r"width, 3\), got float32 of shape \(8, 8, 3\)$"):
        encoder.encode(("a",), False, images=[np.zeros((8, 8, 3), np.float32)])
    flux = pipeline_config(tiny_pipelines["flux"], "flux")
    with pytest.raises(ValueError, match=r"^FluxPipeline: expected no source images \(it is "
                                         r"not an editing pipeline\), got 1$"):
        resident(flux.model, flux.seed).encoder.encode(("a",), False, images=[source(48, 64, 0)])

"""Model families on tiny saved pipelines of each kind (digenrl/testing/pipelines.py): the
version-0 ODE sampler gives the diffusers pipeline's own images, conditioning comes
from the folder's text encoders, and a folder is checked before any work. (The
instruction-editing families, which take source images: tests/test_editing_families.py.)"""

import numpy as np
import pytest
import torch

from digenrl.config import ConfigError, ModelConfig, SamplerConfig
from digenrl.graph.build import GraphContext
from digenrl.models import decode_latents, family
from digenrl.models.common import pack
from digenrl.models.parts import tokenizer_of
from digenrl.tasks import rollout, train
from digenrl.tasks.resident import resident
from digenrl.tasks.sde import sde_step

from conftest import pipeline_config
from digenrl.testing.pipelines import MAX_SEQUENCE_LENGTH, SAVERS

#: The text-to-image and text-to-video families.
FAMILIES = ("sd3", "flux", "wan", "qwenimage", "hunyuanvideo")
PIPELINES = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline",
             "wan": "WanPipeline", "qwenimage": "QwenImagePipeline",
             "hunyuanvideo": "HunyuanVideoPipeline", "qwenimage_edit": "QwenImageEditPipeline",
             "kontext": "FluxKontextPipeline"}
VIDEO = ("wan", "hunyuanvideo")
#: Classifier-free guidance for SD3, Wan and Qwen-Image (its true_cfg_scale); FLUX's and
#: HunyuanVideo's guidance embedding.
GUIDANCE = {"sd3": 2.0, "flux": 3.5, "wan": 2.0, "qwenimage": 2.0, "hunyuanvideo": 6.0}
#: sampler.shift: the folder's scheduler shift where the pipeline uses it (HunyuanVideo's
#: 7; FLUX and Qwen-Image shift dynamically).
SHIFT = {"hunyuanvideo": 7.0}
PROMPTS = ("a photo of a cat", "a dog running in the park")


def ode_sample(cfg, prompts):
    """digenrl's sampler with noise_level = 0 (the ODE) under version-0 weights: the
    noise task's starting latents and conditioning, then each step's velocity and
    Euler step as the denoise task computes them. Returns (x0, final latents, the
    decoded uint8 pixels, the float pixels)."""
    ctx = GraphContext.from_config(cfg)
    spec = ctx.rollout
    start = rollout.encoded_noise(spec, 0, tuple(range(len(prompts))), tuple(prompts))
    weights = train.publish(train.init_state(ctx.train))
    models = resident(cfg.model, spec.model_seed)
    model = models.policy(weights)
    x = start.x
    with torch.no_grad():
        for t in range(cfg.sampler.num_steps):
            v = family(cfg.model).predict_velocity(model, x, spec.sigmas[t], start.cond,
                                                   cfg.sampler.guidance_scale)
            x = sde_step(x, v, spec.sigmas[t], spec.sigmas[t + 1], 0.0).next_latent
        pixels = family(cfg.model).decode(models.vae, x)
    return start.x, x, decode_latents(cfg.model, models.vae, x), pixels


def load_pipeline(name, folder):
    """The diffusers pipeline of the folder, float32. HunyuanVideo's byte-level Llama
    tokenizer is read as its tokenizer.json declares it, as the family reads it (with
    the class model_index.json names, transformers 5 replaces its pre-tokenizer with
    SentencePiece's: test_a_byte_level_llama_tokenizer_is_read_as_saved)."""
    import diffusers

    kw = {}
    if name == "hunyuanvideo":
        kw["tokenizer"] = tokenizer_of(folder, "tokenizer")
    return getattr(diffusers, PIPELINES[name]).from_pretrained(folder, dtype=torch.float32, **kw)


def pipeline_sample(name, folder, prompts, x0, cfg, output_type):
    pipe = load_pipeline(name, folder)
    packed = name in ("flux", "qwenimage")
    kw = dict(latents=pack(x0) if packed else x0, num_inference_steps=cfg.sampler.num_steps,
              max_sequence_length=MAX_SEQUENCE_LENGTH, output_type=output_type)
    m = cfg.model
    if name == "qwenimage":  # true classifier-free guidance
        kw.update(true_cfg_scale=cfg.sampler.guidance_scale, negative_prompt=m.negative_prompt)
    else:
        kw.update(guidance_scale=cfg.sampler.guidance_scale)
    if name != "sd3":
        kw.update(height=m.height, width=m.width)
    if name in VIDEO:
        kw.update(num_frames=m.num_frames)
        return pipe(list(prompts), **kw).frames
    return pipe(list(prompts), **kw).images


def family_config(name, folder, **overrides):
    """The config of a test on a tiny pipeline: its family's shift where it uses one."""
    shift = {"sampler.shift": SHIFT[name]} if name in SHIFT else {}
    return pipeline_config(folder, name, **shift, **overrides)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_ode_sampler_gives_the_pipelines_images(name, tiny_pipelines):
    """Same starting latents, steps, shift and guidance: digenrl's version-0 ODE sampler
    and the diffusers pipeline class on the same folder agree within float32 rounding,
    in the final latents and in the decoded pixels."""
    folder = tiny_pipelines[name]
    cfg = family_config(name, folder, **{"sampler.num_steps": 3,
                                         "sampler.guidance_scale": GUIDANCE[name]})
    x0, latents, images, pixels = ode_sample(cfg, PROMPTS)
    theirs = pipeline_sample(name, folder, PROMPTS, x0, cfg, "latent")
    if name in ("flux", "qwenimage"):
        latents = pack(latents)
    torch.testing.assert_close(latents, theirs, rtol=1e-5, atol=1e-5)
    assert latents.abs().max() > 0.1  # something was computed
    np_out = pipeline_sample(name, folder, PROMPTS, x0, cfg, "np")
    ours = ((pixels / 2 + 0.5).clamp(0, 1))
    ours = ours.permute(0, 2, 3, 1) if ours.ndim == 4 else ours.permute(0, 2, 3, 4, 1)
    np.testing.assert_allclose(ours.numpy(), np.asarray(np_out), rtol=0, atol=1e-5)
    assert images.dtype == np.uint8 and images.shape == np.asarray(np_out).shape
    assert np.abs(images.astype(int) - np.round(np.asarray(np_out) * 255)).max() <= 1


@pytest.mark.parametrize("name", FAMILIES)
def test_text_encoders_condition_the_samples(name, tiny_pipelines, tmp_path):
    """Two prompts give different conditioning; two folders differing only in their
    text encoders' weights give different samples from the same seed."""
    cfg = family_config(name, tiny_pipelines[name])
    cond = resident(cfg.model, 0).conditioning(PROMPTS, 1.0)
    assert cond.tensors["embeds"].shape[0] == 2
    assert not torch.equal(cond.tensors["embeds"][0], cond.tensors["embeds"][1])
    other = SAVERS[name](tmp_path / name, text_seed=7)
    cfg2 = family_config(name, other)
    _, a, _, _ = ode_sample(cfg, PROMPTS[:1])
    x0b, b, _, _ = ode_sample(cfg2, PROMPTS[:1])
    assert not torch.allclose(a, b, atol=1e-4)
    # The transformers are the same: the difference is the text encoders'.
    ta, tb = (family(c.model).build_transformer(0).state_dict() for c in (cfg, cfg2))
    assert all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.parametrize("name", PIPELINES)
def test_the_family_comes_from_model_index(name, tiny_pipelines):
    fam = family(ModelConfig(path=str(tiny_pipelines[name])))
    assert fam.pipeline_class == PIPELINES[name]
    assert fam.video == (name in VIDEO)
    assert fam.takes_images == (name in ("qwenimage_edit", "kontext"))


def test_an_unsupported_pipeline_class_is_refused(tiny_pipelines, tmp_path):
    import shutil

    folder = tmp_path / "other"
    shutil.copytree(tiny_pipelines["sd3"], folder)
    index = folder / "model_index.json"
    index.write_text(index.read_text().replace("StableDiffusion3Pipeline", "CogView4Pipeline"))
    with pytest.raises(ConfigError) as e:
        pipeline_config(folder, "sd3")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("model.path: ")
    assert "'CogView4Pipeline'" in msg and str(folder) in msg
    assert "FluxKontextPipeline / FluxPipeline / HunyuanVideoPipeline / QwenImageEditPipeline " \
        "/ QwenImagePipeline / StableDiffusion3Pipeline / WanPipeline" in msg


def test_a_folder_missing_a_part_is_refused(tiny_pipelines, tmp_path):
    import shutil

    folder = tmp_path / "partial"
    shutil.copytree(tiny_pipelines["flux"], folder)
    shutil.rmtree(folder / "text_encoder_2")
    with pytest.raises(ConfigError, match=r"^model.path: expected a FluxPipeline folder with "
                                          r"text_encoder_2/, got .* without it$"):
        pipeline_config(folder, "flux")


def test_a_prompt_the_tokenizer_cannot_encode_is_refused(tiny_pipelines):
    with pytest.raises(ConfigError, match=r"^data.prompts\[1\]: expected text the folder's "
                                          r"tokenizer \(T5Tokenizer\) can encode, got "
                                          r"'日本の猫' \(it has unknown tokens\)$"):
        pipeline_config(tiny_pipelines["wan"], "wan",
                        **{"data.prompts": ["a photo of a cat", "日本の猫"]})
    long = " ".join(["cat"] * 40)
    with pytest.raises(ConfigError, match=r"^data.prompts\[0\]: expected at most 16 tokens "
                                          r"of tokenizer_3 \(model.max_sequence_length\)"):
        pipeline_config(tiny_pipelines["sd3"], "sd3", **{"data.prompts": [long]})
    with pytest.raises(ConfigError, match=r"^model.negative_prompt: expected text"):
        pipeline_config(tiny_pipelines["sd3"], "sd3",
                        **{"model.negative_prompt": "日本", "sampler.guidance_scale": 2.0})


def test_an_image_size_off_the_latent_grid_is_refused(tiny_pipelines):
    with pytest.raises(ConfigError, match=r"^model.width: expected a multiple of 16 for this "
                                          r"WanPipeline folder \(VAE factor x patch\), got 40$"):
        pipeline_config(tiny_pipelines["wan"], "wan", **{"model.width": 40})


def test_sigmas_follow_the_pipelines_schedule(tiny_pipelines):
    """FLUX shifts by mu from the packed image length (dynamic shifting); SD3 and Wan by
    sampler.shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    s = SamplerConfig(num_steps=4, shift=3.0)
    flux = family(pipeline_config(tiny_pipelines["flux"], "flux").model).sigmas(s)
    sd3 = family(pipeline_config(tiny_pipelines["sd3"], "sd3").model).sigmas(s)
    ref = FlowMatchEulerDiscreteScheduler(shift=3.0)
    ref.set_timesteps(4)
    np.testing.assert_allclose(sd3, ref.sigmas.numpy())
    assert flux != sd3 and flux[0] == 1.0 and flux[-1] == 0.0


@pytest.mark.parametrize("case", ["class", "part", "prompt"])
def test_the_command_line_refuses_a_bad_folder_before_any_work(case, tiny_pipelines, tmp_path,
                                                                 capsys):
    """`digenrl run CONFIG --set model.path=DIR`: one line naming the field, exit 2, and
    no cluster contacted (the scheduler named is unreachable) nor store written."""
    import shutil

    from digenrl.commands.cli import main

    folder = tmp_path / "folder"
    shutil.copytree(tiny_pipelines["wan"], folder)
    argv = []
    if case == "class":
        index = folder / "model_index.json"
        index.write_text(index.read_text().replace("WanPipeline", "LTXPipeline"))
        field = "model.path: expected a pipeline folder of class"
    elif case == "part":
        shutil.rmtree(folder / "tokenizer")
        field = "model.path: expected a WanPipeline folder with tokenizer/"
    else:
        argv = ["--set", "data.prompts=[a cat, ça coûte]"]
        field = "data.prompts[1]: expected text the folder's tokenizer"
    out = tmp_path / "run.zarr"
    capsys.readouterr()  # what came before (a tiny pipeline saved on first use)
    code = main(["run", "workflows/configs/wan.yaml", "--out", str(out),
                 "--scheduler", "tcp://127.0.0.1:1", "--set", f"model.path={folder}",
                 "--set", "model.max_sequence_length=16", "--set", "cluster.gpus=false",
                 *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and field in err and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_config_loads_on_its_folder(name, tiny_pipelines):
    """workflows/configs/NAME.yaml validates against a folder of its family."""
    from digenrl.config import load_config

    cfg = load_config(f"workflows/configs/{name}.yaml",
                      {"model.path": str(tiny_pipelines[name]),
                       "model.max_sequence_length": 64})
    assert family(cfg.model).pipeline_class == PIPELINES[name]


def test_a_run_stored_before_the_model_fields_existed_still_resumes():
    """A stored config without the newer model and store fields compares as their
    defaults; a real difference is still refused."""
    from digenrl.config import config_to_dict
    from digenrl.run.runner import RLWorkload

    from conftest import small_config

    workload = RLWorkload(small_config())
    stored = config_to_dict(small_config())
    for name in ("height", "width", "num_frames", "negative_prompt", "max_sequence_length",
                 "text_encoder_dtype"):
        del stored["model"][name]
    del stored["store"]["save_videos"]
    workload.check_resume({"config": stored})
    stored["model"]["negative_prompt"] = "blurry"
    with pytest.raises(ConfigError, match=r"differs from the stored run's in \['model'\]"):
        workload.check_resume({"config": stored})


def test_a_byte_level_llama_tokenizer_is_read_as_saved(tiny_pipelines):
    """HunyuanVideo's tokenizer folder names a Llama tokenizer class over a byte-level
    BPE tokenizer.json (Llama-3's kind). transformers 5's LlamaTokenizer replaces that
    pre-tokenizer with SentencePiece's Metaspace, and its tokens differ from the file's;
    the family (its encoder and its prompt checks) reads the file as saved."""
    from tokenizers import Tokenizer
    from transformers import LlamaTokenizer

    folder = tiny_pipelines["hunyuanvideo"]
    text = "a photo of a cat, 123 dogs"
    saved = Tokenizer.from_file(str(folder / "tokenizer" / "tokenizer.json")).encode(text).ids
    fam = family(family_config("hunyuanvideo", folder).model)
    assert fam.tokenizer("tokenizer")(text).input_ids == saved
    assert tokenizer_of(folder, "tokenizer")(text).input_ids == saved
    assert LlamaTokenizer.from_pretrained(folder / "tokenizer")(text).input_ids != saved

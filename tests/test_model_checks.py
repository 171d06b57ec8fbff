"""Settings a model folder cannot take are refused before any work, each in one line
naming the field: a size past the transformer's rotary or positional table, a
tiny-model field given with a folder, images asked of a video model or videos of an
image model; and a reward model's processor folder is accepted in the layout the
pinned transformers saves and loads."""

import shutil

import numpy as np
import pytest

from digenrl.commands.cli import main
from digenrl.config import ConfigError, RewardModelConfig, load_config, tiny_model_fields
from digenrl.tasks.rewards import REWARDS, register_reward

from conftest import pipeline_config, source_picture, write_prompt_lines


def refused(capsys, argv) -> str:
    """``digenrl run`` with ``argv``: exit 2 and one line on stderr, no traceback (the
    scheduler named is unreachable: any cluster work would be another error)."""
    capsys.readouterr()  # what came before (a tiny pipeline saved on first use)
    code = main(["run", "--scheduler", "tcp://127.0.0.1:1", "--set", "cluster.gpus=false",
                 *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_a_tiny_model_field_with_a_pipeline_folder_is_refused(tiny_pipelines, tmp_path,
                                                              capsys):
    """The built-in model's config with a folder: its image_size would be ignored (the
    folder's default size taken instead), so it is refused."""
    out = tmp_path / "run.zarr"
    err = refused(capsys, ["workflows/configs/tiny.yaml", "--out", str(out),
                           "--set", f"model.path={tiny_pipelines['wan']}"])
    assert err.endswith("model.image_size: expected no tiny-model field together with "
                        "model.path (the folder's model has its own sizes: set model.height, "
                        "model.width, model.num_frames), got 64"), err
    assert not out.exists()
    with pytest.raises(ConfigError, match=r"^model.patch_size: expected no tiny-model field"):
        load_config(None, {"model.path": str(tiny_pipelines["flux"]), "model.patch_size": 2})
    assert "image_size" in tiny_model_fields() and "height" not in tiny_model_fields()


def test_a_folder_of_parts_keeps_its_hash_encoders_length(tmp_path):
    """A folder without model_index.json encodes prompts with the hash encoder, whose
    length prompt_tokens sets; its sizes are the folder's."""
    from test_models import save_tiny_pipeline

    save_tiny_pipeline(tmp_path)
    assert load_config(None, {"model.path": str(tmp_path),
                              "model.prompt_tokens": 6}).model.prompt_tokens == 6
    with pytest.raises(ConfigError, match=r"^model.image_size: expected no tiny-model field"):
        load_config(None, {"model.path": str(tmp_path), "model.image_size": 32})


def test_a_size_past_the_rotary_table_is_refused(tiny_pipelines, tmp_path, capsys):
    """The tiny Wan transformer's rotary table holds 32 patches a side (512 pixels, 125
    frames): the pipeline's default width 832 does not fit it; nor do more frames."""
    folder = tiny_pipelines["wan"]
    err = refused(capsys, ["workflows/configs/wan.yaml", "--out", str(tmp_path / "r.zarr"),
                           "--set", f"model.path={folder}", "--set", "model.width=null",
                           "--set", "model.max_sequence_length=16"])
    assert err.endswith("model.width: expected at most 512 for this WanPipeline folder (its "
                        "transformer's rotary table: rope_max_seq_len 32 patches), got null "
                        "(the pipeline's default 832)"), err
    with pytest.raises(ConfigError, match=r"^model.num_frames: expected at most 125 for this "
                                          r"WanPipeline folder .*, got 129$"):
        pipeline_config(folder, "wan", **{"model.num_frames": 129})
    pipeline_config(folder, "wan", **{"model.num_frames": 125, "model.width": 512})


def test_a_size_past_the_positional_or_text_table_is_refused(tiny_pipelines):
    """SD3's positional embedding holds pos_embed_max_size patches a side (the tiny
    one's: 8, of 8 pixels); Qwen-Image's prompt is at most its tokenizer length, and its
    text's rotary positions follow the image's."""
    with pytest.raises(ConfigError, match=r"^model.height: expected at most 64 pixels for "
                                          r"this StableDiffusion3Pipeline folder \(its "
                                          r"transformer's positional table: "
                                          r"pos_embed_max_size 8 patches\), got 128$"):
        pipeline_config(tiny_pipelines["sd3"], "sd3", **{"model.height": 128})
    qwen = tiny_pipelines["qwenimage"]
    with pytest.raises(ConfigError, match=r"^model.max_sequence_length: expected at most "
                                          r"1024 for a QwenImagePipeline folder, got 2000$"):
        pipeline_config(qwen, "qwenimage", **{"model.max_sequence_length": 2000})
    with pytest.raises(ConfigError, match=r"^model.width: expected at most 130576 pixels "
                                          r"for this QwenImagePipeline folder \(its rotary "
                                          r"table holds 4096 positions, "
                                          r"model.max_sequence_length 16 of them for the "
                                          r"prompt\), got 130592$"):
        pipeline_config(qwen, "qwenimage", **{"model.width": 130592})
    pipeline_config(qwen, "qwenimage", **{"model.width": 130576})  # the last that fits


def test_an_edit_past_qwen_images_rotary_table_is_refused(tiny_pipelines, tmp_path, capsys):
    """Qwen-Image-Edit's text (the prompt with its source image's vision tokens) takes
    the rotary positions after the larger half side of the image's and the source's
    grids: an output size, or a source area, past the table is refused in one line
    before any work, as Qwen-Image's is; the length checked is the encoder's."""
    folder = tiny_pipelines["qwenimage_edit"]
    edits = write_prompt_lines(tmp_path, [{"prompt": "make it red",
                                           "image": source_picture(48, 64, 0)}])
    out = tmp_path / "run.zarr"
    base = ["workflows/configs/qwenimage.yaml", "--out", str(out),
            "--set", f"model.path={folder}", "--set", f"data.prompt_file={edits}"]
    err = refused(capsys, [*base, "--set", "model.height=261184", "--set", "model.width=32"])
    assert err.endswith("model.height: expected at most 260640 pixels for this "
                        "QwenImageEditPipeline folder (its rotary table holds 4096 positions, "
                        "24 (the prompt of line 1 of " + edits + " with its source image's "
                        "vision tokens) of them for the prompt), got 261184"), err
    # A 4:3 source resized to the area of 262144 x 262144 pixels: 302688 pixels wide, a
    # grid of 9459 packed latents (of 32 pixels), 4729 positions a half side.
    err = refused(capsys, [*base, "--set", f"model.source_area={262144 ** 2}"])
    assert err.endswith("model.source_area: expected a source image and prompt that fit "
                        "this QwenImageEditPipeline folder's rotary table of 4096 positions "
                        "(the prompt of line 1 of " + edits + " with its source image's "
                        "vision tokens takes 24 of them after the source's 4729), got "
                        f"{262144 ** 2}"), err
    assert not out.exists()

    # The length checked is what the encoder keeps of the processor's tokens.
    from digenrl.models import family
    from digenrl.models.base import SourceImage

    cfg = pipeline_config(folder, "qwenimage_edit", **{"data.prompt_file": edits})
    fam = family(cfg.model)
    image = SourceImage.of(source_picture(48, 64, 0))
    ids = fam.processor(text=[fam.prompt_text("make it red", "processor")],
                        images=[fam.prompt_image(image)], return_tensors="pt")["input_ids"]
    assert fam.encoded_length("make it red", *fam.source_size(image)) == \
        ids.shape[1] - fam.dropped_tokens == 24


@pytest.fixture
def video_reward():
    @register_reward("frame_change_test", scores="video")
    def change(videos, prompts):
        return np.abs(np.diff(videos.astype(np.float64), axis=1)).mean(axis=(1, 2, 3, 4))

    yield "frame_change_test"
    REWARDS.pop("frame_change_test")


def test_images_of_a_video_model_and_videos_of_an_image_model_are_refused(tiny_pipelines,
                                                                          video_reward):
    with pytest.raises(ConfigError, match=r"^store.save_latents: expected false for a video "
                                          r"model"):
        pipeline_config(tiny_pipelines["hunyuanvideo"], "hunyuanvideo",
                        **{"store.save_latents": True})
    with pytest.raises(ConfigError, match=r"^model.num_frames: expected null for an image "
                                          r"model \(QwenImagePipeline\), got 5$"):
        pipeline_config(tiny_pipelines["qwenimage"], "qwenimage", **{"model.num_frames": 5})
    with pytest.raises(ConfigError, match=r"^store.save_videos: expected false for an image "
                                          r"model \(samples.video holds whole videos\), got "
                                          r"True$"):
        pipeline_config(tiny_pipelines["flux"], "flux", **{"store.save_videos": True})
    with pytest.raises(ConfigError, match=r"^reward.components: expected rewards that score "
                                          r"images for an image model, got 'frame_change_test' "
                                          r"\(it scores videos\)$"):
        pipeline_config(tiny_pipelines["sd3"], "sd3",
                        **{"reward.components": {video_reward: 1.0}})
    # A video model takes it.
    pipeline_config(tiny_pipelines["wan"], "wan", **{"reward.components": {video_reward: 1.0},
                                                     "store.save_videos": True})


def test_a_processor_saved_by_clip_processor_is_accepted_and_scores(tmp_path):
    """transformers 5's CLIPProcessor.save_pretrained writes processor_config.json (the
    image processor's settings inside it), not preprocessor_config.json: the config
    accepts the folder, and the reward scores the same with it as with the image
    processor and tokenizer saved on their own."""
    from transformers import CLIPImageProcessorPil, CLIPProcessor

    from clip_models import IMAGE_SIZE, save_tiny_clip
    from digenrl.tasks.reward_models import model_reward
    from digenrl.testing.pipelines import clip_tokenizer

    model = save_tiny_clip(tmp_path / "clip")
    processor = tmp_path / "processor"
    CLIPProcessor(image_processor=CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=clip_tokenizer(max_length=16)).save_pretrained(processor)
    assert (processor / "processor_config.json").is_file()
    assert not (processor / "preprocessor_config.json").exists()
    settings = RewardModelConfig(path=str(model), processor=str(processor), batch_size=2)
    settings.validate("reward.models.pick")
    images = np.random.default_rng(0).integers(0, 256, (2, IMAGE_SIZE, IMAGE_SIZE, 3),
                                               dtype=np.uint8)
    prompts = ["a photo of a cat", "a dog"]
    ours = model_reward("pick", settings)(images, prompts)
    alone = model_reward("pick", RewardModelConfig(path=str(model), batch_size=2))
    np.testing.assert_array_equal(ours, alone(images, prompts))
    shutil.rmtree(processor)
    with pytest.raises(ConfigError, match=r"^reward.models.pick.processor: expected an "
                                          r"existing folder"):
        settings.validate("reward.models.pick")


def test_a_guidance_distilled_qwen_image_transformer_is_refused(tiny_pipelines, tmp_path):
    """Qwen-Image's transformer may carry a guidance embedding (a distilled model); the
    family guides by true classifier-free guidance only, so such a folder is refused
    rather than sampled without its embedding."""
    import json

    folder = tmp_path / "qwen"
    shutil.copytree(tiny_pipelines["qwenimage"], folder)
    config = folder / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "guidance_embeds": True}))
    with pytest.raises(ConfigError, match=r"^model.path: expected a QwenImagePipeline folder "
                                          r"whose transformer has no guidance embedding, got "
                                          r".* with guidance_embeds$"):
        pipeline_config(folder, "qwenimage")

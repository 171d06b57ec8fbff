"""Instruction editing and per-line negative prompts in runs: prompt-file lines name
source images (``"image"``) and negative prompts (``"negative_prompt"``); the source
image conditions the line's samples and reaches the rewards beside the edit, the store
keeps each sample's source index, and ``digenrl report`` shows source and edit side by
side. A line's negative prompt changes its own group's samples and no other's."""

import numpy as np
import pytest
from PIL import Image

from digenrl.config import ConfigError
from digenrl.figures.plots import beside_sources
from digenrl.prompts import load_prompt_file
from digenrl.commands.report import write_report
from digenrl.run.runner import Runner
from digenrl.store import SOURCES_ATTRIBUTE, open_run, read_attrs

from conftest import (assert_complete, checked_config, pipeline_config, source_picture,
                      write_prompt_lines)
from source_rewards import closeness

EDITS = [("make it red", (48, 64), 0), ("make it blue", (64, 40), 1)]


@pytest.fixture(scope="module")
def editing_run(cluster_1x1, tiny_pipelines, tmp_path_factory):
    """One iteration of a FLUX.1 Kontext run on two prompt lines with source images
    of different sizes, rewarded by how close each edit stays to its source."""
    folder = tmp_path_factory.mktemp("editing")
    prompts = write_prompt_lines(folder, [
        {"prompt": p, "image": source_picture(*size, seed)} for p, size, seed in EDITS])
    cfg = pipeline_config(tiny_pipelines["kontext"], "kontext", **{
        # Sources of about 64 x 64 pixels (not the pipeline's megapixel): 64 x 64 and
        # 96 x 64, 4 and 6 tokens beside the edit's 16.
        "model.source_area": 64 * 64, "iterations": 1, "sampler.num_steps": 2,
        "data.prompt_file": prompts, "reward.components": {"source_closeness": 1.0}})
    out = folder / "run.zarr"
    Runner(cfg, str(out), cluster=cluster_1x1).run()
    return cfg, prompts, out


def test_an_editing_run_scores_each_edit_against_its_source(editing_run):
    cfg, prompts, out = editing_run
    ds = open_run(out)
    assert assert_complete(ds) == 1
    s = ds["samples"].isel(iteration=0)
    table = read_attrs(out)[SOURCES_ATTRIBUTE]
    lines = load_prompt_file(prompts)
    assert [t["path"] for t in table] == [i.images[0].path for i in lines.inputs]
    for k, prompt in enumerate(s.prompt.values):
        line = lines.prompts.index(str(prompt))
        assert int(s.source.values[k]) == line  # its own line's image
        source = np.asarray(Image.open(table[line]["path"]).convert("RGB"))
        # The reward received this sample's source image beside its edit.
        assert s.reward_source_closeness.values[k] == closeness(s.image.values[k], source)
    assert np.isfinite(s.reward.values).all()
    assert len(set(s.source.values.tolist())) == 2


def test_the_report_shows_each_source_beside_its_edit(editing_run, tmp_path):
    _, _, out = editing_run
    written, _ = write_report(out, tmp_path / "report")
    assert tmp_path / "report" / "edits.png" in written
    ds = open_run(out)
    s = ds["samples"].isel(iteration=0)
    pairs = beside_sources(s.image.values, s.source.values, read_attrs(out)[SOURCES_ATTRIBUTE])
    w = s.image.shape[2]
    assert np.array_equal(pairs[:, :, w:], s.image.values)  # the edit on the right
    for k in range(len(pairs)):  # its source, resized, on the left
        src = Image.open(read_attrs(out)[SOURCES_ATTRIBUTE][int(s.source.values[k])]["path"])
        expected = np.asarray(src.convert("RGB").resize((w, s.image.shape[1]), Image.BICUBIC))
        assert np.array_equal(pairs[k, :, :w], expected)


# ------------------------------------------------------------------ negative prompts

NEGATIVE = {"sampler.guidance_scale": 3.0, "iterations": 1}


def test_a_lines_negative_prompt_changes_its_own_groups_samples_only(cluster_1x1, tmp_path):
    """Two runs of the built-in model (classifier-free guidance) whose prompt files
    differ only in the second line's negative prompt: that line's samples differ, the
    other line's are the same bits."""
    runs = {}
    for name, negative in (("plain", {}), ("negative", {"negative_prompt": "a blurry photo"})):
        prompts = write_prompt_lines(tmp_path / name, [{"prompt": "a photo of a cat"},
                                                       {"prompt": "a photo of a dog",
                                                        **negative}])
        cfg = checked_config(**NEGATIVE, **{"data.prompt_file": prompts})
        Runner(cfg, str(tmp_path / name / "run.zarr"), cluster=cluster_1x1).run()
        runs[name] = open_run(tmp_path / name / "run.zarr")["samples"].isel(iteration=0)
    a, b = runs["plain"], runs["negative"]
    assert list(a.prompt.values) == list(b.prompt.values)
    for prompt in ("a photo of a cat", "a photo of a dog"):
        mine = a.prompt.values == prompt
        same = np.array_equal(a.image.values[mine], b.image.values[mine])
        assert same == (prompt == "a photo of a cat"), prompt


def test_a_negative_prompt_needs_classifier_free_guidance(tiny_pipelines, tmp_path):
    """A guidance-distilled family (FLUX.1) has no negative prompt, and without guidance
    none is used: each refused naming the file and line."""
    prompts = write_prompt_lines(tmp_path, [{"prompt": "a cat"},
                                            {"prompt": "a dog", "negative_prompt": "blur"}])
    with pytest.raises(ConfigError, match=r"^data.prompt_file: line 2 of .*prompts.jsonl: "
                                          r"expected no \"negative_prompt\" for a "
                                          r"FluxPipeline folder \(its guidance is an "
                                          r"embedding, without a negative prompt\), got "
                                          r"'blur'$"):
        pipeline_config(tiny_pipelines["flux"], "flux", **{"data.prompt_file": prompts})
    with pytest.raises(ConfigError, match=r"^data.prompt_file: line 2 of .*prompts.jsonl: "
                                          r"expected no \"negative_prompt\" while "
                                          r"sampler.guidance_scale is 1.0 \(no "
                                          r"classifier-free guidance\), got 'blur'$"):
        checked_config(**{"data.prompt_file": prompts})

"""The OCR reward (reward.models kind ocr) with RapidOCR's real models on text rendered
here with PIL: scores against flow_grpo's formula, the reader against RapidOCR's own
pipeline, its settings and every prompt it scores checked before any work starts (and
its extra missing, in a subprocess), a reward server serving the in-process scores, and
short runs on the tiny model storing the OCR column (beside another reward's) for
training and for each evaluated version."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image, ImageDraw, ImageFont

from digenrl.config import ConfigError
from digenrl.prompts import HELD_OUT_SETS, PROMPT_SETS
from digenrl.run.runner import Runner
from digenrl.store import open_run
from digenrl.tasks import reward_models
from digenrl.tasks.ocr import ocr_target, target_problem
from digenrl.tasks.reward_sources import resolve_rewards
from digenrl.tasks.rewards import evaluate_rewards

from conftest import SMALL, checked_config, small_config

pytest.importorskip("rapidocr", reason='the OCR reward\'s extra: pip install -e ".[ocr]"')

FONTS = Path("/usr/share/fonts/truetype/dejavu")
OCR = {"reward.components": {"ocr": 1.0}, "reward.models": {"ocr": {"kind": "ocr"}}}


def _font(name: str, size: int):
    path = FONTS / name
    if path.is_file():
        return ImageFont.truetype(str(path), size)
    return ImageFont.load_default(size=size)  # Pillow's own scalable font


def render(text: str, size: int, points: int, font: str, dark_on_light: bool) -> np.ndarray:
    """``text`` centred on a plain square, uint8 RGB."""
    ink, paper = ((20, 20, 30), (235, 232, 220)) if dark_on_light else \
        ((250, 245, 200), (25, 30, 60))
    image = Image.new("RGB", (size, size), paper)
    draw = ImageDraw.Draw(image)
    f = _font(font, points)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=f)
    draw.text(((size - right - left) / 2, (size - bottom - top) / 2), text, font=f, fill=ink)
    return np.asarray(image)


#: (text, image size, points, font, dark on light)
RENDERED = [("Open Late", 512, 56, "DejaVuSans.ttf", True),
            ("Fresh Bread", 512, 44, "DejaVuSerif-Bold.ttf", False),
            ("Coffee", 256, 36, "DejaVuSansMono.ttf", True),
            ("Hello World", 256, 26, "DejaVuSans-Bold.ttf", False)]
#: A different text for each, sharing few letters with it.
OTHER = ["Bakery", "Sunset", "Winter Sale", "Jump"]


def flow_grpo_reward(recognised: str, prompt: str) -> float:
    """flow_grpo/ocr.py's reward, as it computes it (docs/sources.md), on the recognised
    text: the prompt's quoted text against it, spaces removed, lowercase."""
    from rapidfuzz.distance import Levenshtein

    prompt = prompt.split('"')[1].replace(" ", "").lower()
    recognised = recognised.replace(" ", "").lower()
    dist = 0 if prompt in recognised else Levenshtein.distance(recognised, prompt)
    dist = min(dist, len(prompt))
    return 1 - dist / len(prompt)


@pytest.fixture(scope="module")
def ocr_spec():
    (spec, _), = resolve_rewards({"ocr": 1.0}, models=small_config(**OCR).reward.models)
    return spec


def _reader(spec):
    return reward_models.resident_reward_model(spec.fn.config).reader


def test_rendered_text_scores_high_against_its_prompt_and_low_against_another(ocr_spec):
    images = {size: np.stack([render(*r) for r in RENDERED if r[1] == size])
              for size in (512, 256)}
    texts = [r[0] for r in RENDERED]
    own = np.concatenate([ocr_spec(images[s], [f'A sign that says "{t}"' for t, sz, *_ in
                                               RENDERED if sz == s]) for s in (512, 256)])
    assert own.dtype == np.float64 and (own >= 0.9).all(), dict(zip(texts, own))
    other = np.concatenate([ocr_spec(images[s], [f'A sign that says "{o}"' for o, r in
                                                 zip(OTHER, RENDERED) if r[1] == s])
                            for s in (512, 256)])
    assert (other <= 0.5).all(), dict(zip(OTHER, other))
    # The scores are flow_grpo's formula of what the reader recognised.
    recognised = [t for s in (512, 256) for t in _reader(ocr_spec).read(images[s])]
    expected = [flow_grpo_reward(r, f'A sign that says "{t}"') for r, t in
                zip(recognised, texts)]
    assert own.tolist() == expected, (recognised, own)
    assert other.tolist() == [flow_grpo_reward(r, f'"{o}"') for r, o in
                              zip(recognised, OTHER)]
    # A blank image, and one of another size, read nothing: 0.
    blank = np.full((2, 384, 384, 3), 255, np.uint8)
    blank[1] = 0
    assert ocr_spec(blank, ['"Open Late"', '"Exit"']).tolist() == [0.0, 0.0]


def test_the_target_is_a_text_key_before_the_quoted_text(ocr_spec):
    image = render("Open Late", 256, 30, "DejaVuSans.ttf", True)[None]
    # A .jsonl line's "text" key wins over the prompt's quotes; the score counts a
    # target found inside longer recognised text as whole (case and spaces folded).
    total, per, valid, _ = evaluate_rewards(
        np.concatenate([image] * 3), ['"Closed"', "a sign", "“OPENLATE” and more"],
        range(3), [(ocr_spec, 1.0)], metadata=[{"text": "open"}, {"text": "Open Late"}, {}])
    assert per["ocr"].tolist() == [1.0, 1.0, 1.0] and valid.all()
    assert ocr_target('A sign that says "Open Late" and "Exit"') == "Open Late"
    assert ocr_target("A mug with “Coffee” on it") == "Coffee"
    assert target_problem("a cat")[1] == "'a cat'"
    assert target_problem('A sign ""')[0] == "quoted text other than spaces to render"
    assert target_problem("x", {"text": 3})[1] == "int 3"
    with pytest.raises(Exception, match=r"reward 'ocr' raised ValueError: sample 1 of the "
                                        r"batch: expected the text to render in double"):
        evaluate_rewards(np.concatenate([image] * 2), ['"a"', "no quotes"], range(2),
                         [(ocr_spec, 1.0)])


def test_the_reader_reads_what_rapidocrs_own_pipeline_reads(ocr_spec):
    """The reader (RapidOCR's detector and recogniser driven in passes) recognises what
    RapidOCR's own call does with the same settings, image by image and with a pass's
    detection stacked into one forward pass (what it does on a GPU)."""
    reader = _reader(ocr_spec)
    images = np.stack([render(*r) for r in RENDERED if r[1] == 256])
    # RapidOCR's own call of the reader's engine (it takes arrays as OpenCV's BGR).
    own = ["".join(reader.engine(np.ascontiguousarray(im[..., ::-1])).txts or ())
           for im in images]
    assert reader.read(images) == own == [r[0] for r in RENDERED if r[1] == 256]
    assert reader.read(images, stack=True) == own


@pytest.mark.parametrize("settings, message", [
    ({"path": "/models/x"}, "reward.models.ocr.path: expected no path for kind ocr (its "
                            "models ship in its library's wheel), got '/models/x'"),
    ({"head": "h.pth"}, "reward.models.ocr.head: expected null for kind ocr"),
    ({"dtype": "float16"}, "reward.models.ocr.dtype: expected float32 for kind ocr"),
])
def test_ocr_settings_are_checked_naming_the_field(settings, message):
    with pytest.raises(ConfigError) as e:
        small_config(**{"reward.components": {"ocr": 1.0},
                        "reward.models": {"ocr": {"kind": "ocr", **settings}}})
    assert str(e.value).startswith(message), str(e.value)


def _jsonl(path: Path, lines: list[dict]) -> str:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def test_every_prompt_an_ocr_reward_scores_names_its_text(tmp_path):
    """Training prompts (a file, a list, a built-in set) and held-out ones: a prompt
    without quoted text and no "text" key, an empty target and a "text" key that is no
    string are refused naming the file and the line, before any work."""
    txt = tmp_path / "p.txt"
    txt.write_text('A sign that says "Open"\nA cat on a mat\n')
    cases = [
        ({"data.prompt_file": str(txt)},
         f"data.prompt_file: line 2 of {txt}: expected the text to render in double quotes "
         f"(as in 'A sign that says \"Open Late\"') for the OCR reward 'ocr', got 'A cat on "
         f"a mat'"),
        ({"data.prompt_file": _jsonl(tmp_path / "q.jsonl", [{"prompt": "A cat"}])},
         f"data.prompt_file: line 1 of {tmp_path / 'q.jsonl'}: expected the text to render "
         f"in double quotes (as in 'A sign that says \"Open Late\"') or a \"text\" key for "
         f"the OCR reward 'ocr', got 'A cat'"),
        ({"data.prompt_file": _jsonl(tmp_path / "e.jsonl", [{"prompt": 'A "sign"'},
                                                           {"prompt": 'A sign " "'}])},
         f"data.prompt_file: line 2 of {tmp_path / 'e.jsonl'}: expected quoted text other "
         f"than spaces to render for the OCR reward 'ocr', got 'A sign \" \"'"),
        ({"data.prompt_file": _jsonl(tmp_path / "k.jsonl", [{"prompt": "a mug", "text": ""}])},
         f"data.prompt_file: line 1 of {tmp_path / 'k.jsonl'}: expected a \"text\" key "
         f"holding text other than spaces for the OCR reward 'ocr', got ''"),
        ({"data.prompt_set": "ocr", "eval.every": 1,
          "data.eval_prompt_file": _jsonl(tmp_path / "h.jsonl", [{"prompt": "x", "text": 7}])},
         f"data.eval_prompt_file: line 1 of {tmp_path / 'h.jsonl'}: expected a \"text\" key "
         f"holding the text to render (a string) for the OCR reward 'ocr', got int 7"),
        ({}, "data.prompt_set ('simple_animals', prompt 0): expected the text to render"),
        ({"data.prompts": ['"a"', "b"]}, "data.prompts[1]: expected the text to render"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError) as e:
            checked_config(**OCR, **overrides)
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    # A group reward ranking the OCR reward checks the same prompts.
    with pytest.raises(ConfigError, match=r"^data.prompt_set \('simple_animals'"):
        checked_config(**{"reward.models": {"ocr": {"kind": "ocr"}},
                          "reward.group": {"ranked": {"of": "ocr"}},
                          "reward.components": {"ranked": 1.0}})
    # The built-in set, its held-out prompts and a file of "text" keys are accepted.
    checked_config(**OCR, **{"data.prompt_set": "ocr", "eval.every": 1})
    checked_config(**OCR, **{"data.prompt_file": _jsonl(tmp_path / "ok.jsonl", [
        {"prompt": "a shop sign", "text": "Bakery"}])})


def test_the_ocr_prompt_set_and_its_held_out_texts():
    train, held = PROMPT_SETS["ocr"], HELD_OUT_SETS["ocr"]
    assert len(train) == len(set(train)) == 192 and len(held) == 8
    targets = {ocr_target(p) for p in train}
    assert len(targets) == 24
    assert not targets & {ocr_target(p) for p in held}  # held-out texts are unseen


def test_a_missing_extra_stops_a_run_and_a_server_in_one_line(tmp_path):
    """With rapidocr failing to import (a package of that name that raises ImportError
    first on the path), ``digenrl run --check`` and ``digenrl reward-server`` stop with
    one line naming the extra, before any cluster or server starts."""
    shadow = tmp_path / "shadow" / "rapidocr"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named rapidocr')\n")
    config = tmp_path / "ocr.yaml"
    base = {k: v for k, v in SMALL.items()}
    config.write_text(yaml.safe_dump({**base, "data": {**SMALL["data"], "prompt_set": "ocr"},
                                      "reward": {"components": {"ocr": 1.0},
                                                 "models": {"ocr": {"kind": "ocr"}}}}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path / "shadow"), str(Path(__file__).parent.parent)])}
    expected = ("reward.models.ocr.kind: expected the rapidocr package (the OCR reward's "
                "extra: pip install -e \".[ocr]\"), got an ImportError: No module named "
                "rapidocr")
    # One process (its imports take seconds) runs both commands in turn.
    code = ("import sys; from digenrl.commands.cli import main; "
            f"codes = [main(['run', {str(config)!r}, '--check']), "
            f"main(['reward-server', 'ocr', '--config', {str(config)!r}])]; "
            "print(codes)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.stdout.strip() == "[2, 2]", (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert [line.split(": error: ")[0] for line in lines] == ["digenrl run",
                                                              "digenrl reward-server"], lines
    assert all(line.endswith(expected) for line in lines), lines


def test_a_reward_server_serves_the_in_process_ocr_scores(ocr_spec, tmp_path):
    """``digenrl reward-server ocr --config``: the same images and prompts (one sample's
    target in its metadata's "text") get the in-process scores, the model loaded once."""
    from digenrl.serving.remote import RemoteReward

    from test_reward_server import Server

    images = np.stack([render(*r) for r in RENDERED if r[1] == 256] * 2)
    prompts = ['"Coffee"', '"Hello World"', '"Sunset"', "a mug"]
    metadata = [{}, {}, {}, {"text": "Hello"}]
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"reward": {"models": {"ocr": {"kind": "ocr",
                                                                "batch_size": 2}},
                                             "components": {"ocr": 1.0}}}))
    server = Server("ocr", "--config", str(config))
    try:
        served = RemoteReward("served", server.url, batch_size=3)(images, prompts, metadata)
        stats = server.stats(token=None)
    finally:
        server.kill()
    here = ocr_spec(images, prompts, metadata)
    assert here[[0, 1, 3]].tolist() == [1.0, 1.0, 1.0] and here[2] <= 0.5
    np.testing.assert_array_equal(served, here)
    assert (stats["images"], stats["model_loads"]) == (4, 1)


@pytest.mark.slow
def test_runs_with_the_ocr_reward_store_it_and_evaluate_it(cluster_1x1, tmp_path):
    """The tiny model on the ocr prompt set with OCR beside brightness, evaluated on the
    held-out texts every version: every OCR score in [0, 1], each reward's column stored
    (the total their weighted sum), and the evaluation's OCR accuracy per version."""
    from digenrl.commands.report import summarise

    tracking = "tensorboard" if importlib.util.find_spec("tensorboard") else None
    cfg = small_config(**{"iterations": 2, "data.prompt_set": "ocr", "eval.every": 1,
                          "eval.before_first": True,
                          "reward.components": {"ocr": 1.0, "brightness": 0.5},
                          "reward.models": {"ocr": {"kind": "ocr", "batch_size": 2}},
                          "tracking.backends": [tracking] if tracking else [],
                          "tracking.dir": str(tmp_path / "tracking"),
                          "tracking.image_every": 0})
    Runner(cfg, str(tmp_path / "run.zarr"), cluster=cluster_1x1).run()
    ds = open_run(tmp_path / "run.zarr")
    s = ds["samples"]
    ocr, bright = s.reward_ocr.values, s.reward_brightness.values
    assert ocr.shape == (2, 4) and ((ocr >= 0) & (ocr <= 1)).all()
    assert ((bright > 0) & (bright < 1)).all()
    np.testing.assert_allclose(s.reward.values, ocr + 0.5 * bright)
    e = ds["eval"]
    held = len(HELD_OUT_SETS["ocr"])
    assert e.version.values.tolist() == [0] * held + [1] * held + [2] * held
    assert e.prompt.values.tolist() == list(HELD_OUT_SETS["ocr"]) * 3
    accuracy = e.reward_ocr.values.reshape(3, held)
    assert ((accuracy >= 0) & (accuracy <= 1)).all()
    assert np.isfinite(e.reward_brightness.values).all()
    # The held-out accuracy per version in the report and the tracker, beside the total.
    per_version = accuracy.mean(axis=1)
    assert ("held-out reward_ocr (mean per policy version): " + ", ".join(
        f"v{v} {m:.4f}" for v, m in enumerate(per_version))) in summarise(ds).splitlines()
    if tracking:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        (folder,) = (tmp_path / "tracking" / "tensorboard").iterdir()
        ea = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        ea.Reload()
        assert [(s.step, pytest.approx(s.value, abs=1e-6))
                for s in ea.Scalars("eval/rewards/ocr")] == list(enumerate(per_version))
        assert len(ea.Scalars("eval/rewards/brightness")) == 3
    # The OCR model was loaded once on each worker that scored (training or held-out
    # samples), and nowhere else.
    t = ds["tasks"]
    scorers = set(t.worker.values[np.isin(t.kind.values, ["reward", "eval_reward"])].tolist())
    events = cluster_1x1.client.get_events(reward_models.EVENT_TOPIC)
    loaded = [e["worker"] for _, e in events if e["kind"] == "ocr"]
    assert scorers and sorted(loaded) == sorted(scorers), (loaded, scorers)



def test_the_ocr_workflow_config_passes_the_checks_of_a_run():
    """workflows/configs/ocr.yaml passes every check a run makes before its cluster (on
    the built-in model: the test pipelines' tokenizers know only the animal prompts):
    its reward, the target text of every training and held-out prompt."""
    from digenrl.config import load_config
    from digenrl.run.world import check_world

    cfg = load_config("workflows/configs/ocr.yaml")
    check_world(cfg)
    assert (cfg.data.samples_per_prompt, cfg.train.kl_beta, cfg.train.lora_rank) == (24, 0.04, 32)
    assert cfg.reward.models["ocr"].kind == "ocr" and cfg.eval.on


@pytest.mark.slow
def test_a_run_reads_each_target_from_its_prompt_file_lines(cluster_1x1, tmp_path):
    """OCR alone, on .jsonl prompt files whose prompts quote nothing: each line's "text"
    key reaches the reward in training and in evaluation (without it the reward would
    fail the run), every score in [0, 1]."""
    train = _jsonl(tmp_path / "train.jsonl", [{"prompt": f"a shop sign {i}", "text": w}
                                              for i, w in enumerate(["Open", "Sale", "Exit"])])
    held = _jsonl(tmp_path / "held.jsonl", [{"prompt": "a bakery sign", "text": "Fresh Bread"},
                                            {"prompt": "a mug", "text": "Coffee"}])
    cfg = checked_config(**OCR, **{"iterations": 2, "data.prompt_file": train,
                                   "data.eval_prompt_file": held, "eval.every": 2})
    Runner(cfg, str(tmp_path / "run.zarr"), cluster=cluster_1x1).run()
    ds = open_run(tmp_path / "run.zarr")
    s, e = ds["samples"], ds["eval"]
    assert s.valid.values.all() and e.valid.values.all()
    for scores in (s.reward_ocr.values, e.reward_ocr.values):
        assert ((scores >= 0) & (scores <= 1)).all()
    np.testing.assert_array_equal(s.reward.values, s.reward_ocr.values)
    assert e.version.values.tolist() == [2, 2]

"""Rewards that own a model (reward.models), on tiny CLIP models built here from configs:
their scores against a direct computation with the same modules, one load per process,
their settings checked before any work starts, a reward server serving one, and a short
run whose CLIP preference reward rises, the model loaded once per worker that scored;
a score's bits do not depend on the batch it is scored in."""

from __future__ import annotations

import json
import logging
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from digenrl.config import ConfigError, RewardModelConfig
from digenrl.run.runner import Runner
from digenrl.store import open_run
from digenrl.tasks import reward_models
from digenrl.tasks.reward_models import ModelReward, model_reward, reward_model_loads
from digenrl.tasks.reward_sources import resolve_rewards
from digenrl.tasks.rewards import evaluate_rewards

from clip_models import IMAGE_SIZE, PROJECTION, aesthetic_head_state, save_tiny_clip
from conftest import checked_config, small_config

IMAGES = np.random.default_rng(0).integers(0, 256, (5, IMAGE_SIZE, IMAGE_SIZE, 3),
                                           dtype=np.uint8)
PROMPTS = ["a photo of a cat", "a dog", "the fox", "an owl", "a cat"]


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    return save_tiny_clip(tmp_path_factory.mktemp("reward-models") / "clip")


@pytest.fixture(scope="module")
def head_files(clip_folder):
    """The same seeded head as .pth and .safetensors, and one of the wrong width."""
    root = clip_folder.parent
    state = aesthetic_head_state()
    torch.save(state, root / "head.pth")
    save_file(state, root / "head.safetensors")
    torch.save(aesthetic_head_state(PROJECTION + 1), root / "wide.pth")
    return {"pth": root / "head.pth", "safetensors": root / "head.safetensors",
            "wide": root / "wide.pth"}


def _direct_embeddings(folder, prompts=None):
    """The normalised CLIP image (and prompt) embeddings, computed here from the saved
    model with transformers' own processor and tokenizer."""
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel

    model = CLIPModel.from_pretrained(folder).eval()
    pixels = CLIPImageProcessor.from_pretrained(folder)(
        images=list(IMAGES), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        image = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)
        image = image / image.norm(dim=-1, keepdim=True)
        if prompts is None:
            return model, image, None
        tokens = AutoTokenizer.from_pretrained(folder)(prompts, padding=True,
                                                       return_tensors="pt")
        text = model.text_projection(model.text_model(**tokens).pooler_output)
        return model, image, text / text.norm(dim=-1, keepdim=True)


def test_the_clip_reward_is_pickscore_of_the_saved_model_loaded_once(clip_folder):
    config = RewardModelConfig(path=str(clip_folder), batch_size=2)
    (spec, weight), = resolve_rewards({"pick": 2.0}, models={"pick": config})
    assert (spec.name, spec.device, weight) == ("pick", "gpu", 2.0)
    assert isinstance(spec.fn, ModelReward) and spec.fn.loads == 0
    scores = spec(IMAGES, PROMPTS)
    model, image, text = _direct_embeddings(clip_folder, PROMPTS)
    expected = (model.logit_scale.exp() * (image * text).sum(-1)).detach().numpy()
    assert scores.dtype == np.float64 and scores.shape == (5,)
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-5)
    assert len(set(np.round(scores, 4))) == 5  # the prompts and images matter
    # Later calls, and another spec of the same settings, reuse the resident model.
    total, per, valid, problems = evaluate_rewards(IMAGES, PROMPTS, range(5),
                                                   resolve_rewards({"again": 1.0},
                                                                   models={"again": config}))
    np.testing.assert_array_equal(per["again"], scores)
    assert valid.all() and not problems
    assert spec.fn.loads == 1
    # Other settings are another model: bfloat16 loads once more and scores close by.
    half = model_reward("half", RewardModelConfig(path=str(clip_folder), dtype="bfloat16"))
    np.testing.assert_allclose(half(IMAGES, PROMPTS), scores, atol=0.1 * np.abs(scores).max())
    assert reward_models.resident_reward_model(half.fn.config).model.dtype == torch.bfloat16
    assert (half.fn.loads, spec.fn.loads) == (1, 1)


def test_the_consistency_reward_is_the_cosine_of_edit_and_source(clip_folder):
    """``clip_consistency``: each edit's CLIP image embedding against its source's (an
    ordinary reward by name, given the sources); an edit equal to its source scores 1;
    a sample without a source is an error."""
    config = RewardModelConfig(kind="clip_consistency", path=str(clip_folder), batch_size=2)
    (spec, _), = resolve_rewards({"keep": 1.0}, models={"keep": config})
    assert spec.takes_sources and spec.device == "gpu"
    sources = [IMAGES[(k + 1) % 5] for k in range(5)]
    sources[0] = IMAGES[0]
    total, per, valid, problems = evaluate_rewards(IMAGES, PROMPTS, range(5), [(spec, 1.0)],
                                                   sources=sources)
    _, image, _ = _direct_embeddings(clip_folder)
    expected = (image * image[[0, 2, 3, 4, 0]]).sum(-1).numpy()
    np.testing.assert_allclose(per["keep"], expected, rtol=1e-4, atol=1e-5)
    assert abs(per["keep"][0] - 1.0) < 1e-5 and (per["keep"][1:] < 0.9999).all()
    with pytest.raises(Exception, match=r"expected a source image for every sample"):
        evaluate_rewards(IMAGES, PROMPTS, range(5), [(spec, 1.0)])


@pytest.mark.parametrize("suffix", ["pth", "safetensors"])
def test_the_aesthetic_reward_is_laions_head_on_the_clip_embedding(clip_folder, head_files,
                                                                   suffix):
    config = RewardModelConfig(kind="aesthetic", path=str(clip_folder),
                               head=str(head_files[suffix]))
    spec = model_reward("aesthetic", config)
    before = reward_model_loads()
    scores = spec(IMAGES, PROMPTS[:1] * 5)
    _, image, _ = _direct_embeddings(clip_folder)
    layers = torch.nn.Sequential(
        torch.nn.Linear(PROJECTION, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128),
        torch.nn.Dropout(0.2), torch.nn.Linear(128, 64), torch.nn.Dropout(0.1),
        torch.nn.Linear(64, 16), torch.nn.Linear(16, 1)).eval()
    layers.load_state_dict({k.removeprefix("layers."): v
                            for k, v in aesthetic_head_state().items()})
    with torch.no_grad():
        expected = layers(image).squeeze(-1).numpy()
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-6)
    assert len(set(np.round(scores, 6))) == 5  # scores depend on the image (prompts do not)
    np.testing.assert_array_equal(spec(IMAGES, PROMPTS), scores)
    assert reward_model_loads() == before + 1 and spec.fn.loads == 1


@pytest.mark.parametrize("kind", ["clip", "aesthetic"])
def test_a_score_does_not_depend_on_the_batch_it_rides_in(clip_folder, head_files, kind):
    """Every forward pass is padded to batch_size rows (zero images, empty prompts, the
    prompts tokenized to full length): an image's score has the same bits scored alone,
    in calls of 2, 3 or 5 among shuffled neighbours (5: split over two passes), and all
    at once."""
    images = np.random.default_rng(1).integers(0, 256, (10, IMAGE_SIZE, IMAGE_SIZE, 3),
                                               dtype=np.uint8)
    prompts = ["a", "a photo of a cat", "a dog running in the park", "the fox", "an owl",
               "a red fox in the snow", "a cat", "a blue bird on a branch", "dog", ""]
    head = str(head_files["pth"]) if kind == "aesthetic" else None
    spec = model_reward(kind, RewardModelConfig(kind=kind, path=str(clip_folder), head=head,
                                                batch_size=4))
    alone = np.concatenate([spec(images[i:i + 1], prompts[i:i + 1]) for i in range(10)])
    assert len(set(alone.tolist())) == 10  # every image (and prompt) scores differently
    rng = np.random.default_rng(2)
    for size in (2, 3, 5):
        for _ in range(3):
            order = rng.permutation(10)
            for a in range(0, 10, size):
                rows = order[a:a + size]
                np.testing.assert_array_equal(spec(images[rows], [prompts[i] for i in rows]),
                                              alone[rows], err_msg=f"calls of {size}")
    np.testing.assert_array_equal(spec(images, prompts), alone)


def _settings(folder, **kw):
    return {"reward.components": {"pick": 1.0}, "reward.models": {"pick": {"path": str(folder),
                                                                          **kw}}}


@pytest.mark.parametrize("change, message", [
    (lambda f, h: {"path": str(f / "nothing")},
     "reward.models.pick.path: expected an existing folder (a CLIPModel folder), got '{f}/nothing'"),
    (lambda f, h: {"path": str(h["pth"].parent)},
     "reward.models.pick.path: expected a CLIPModel folder holding config.json, got '{p}'"),
    (lambda f, h: {"processor": str(h["pth"].parent)},
     "reward.models.pick.processor: expected a CLIP processor folder holding "
     "preprocessor_config.json or processor_config.json, got '{p}'"),
    (lambda f, h: {"dtype": "float8"},
     "reward.models.pick.dtype: expected one of ['bfloat16', 'float16', 'float32'], got 'float8'"),
    (lambda f, h: {"kind": "pickscore"},
     "reward.models.pick.kind: expected one of ['aesthetic', 'clip', 'clip_consistency', 'ocr'], "
     "got 'pickscore'"),
    (lambda f, h: {"batch_size": 0},
     "reward.models.pick.batch_size: expected an integer >= 1, got 0"),
    (lambda f, h: {"head": str(h["pth"])},
     "reward.models.pick.head: expected null (only an aesthetic reward has a head)"),
    (lambda f, h: {"kind": "aesthetic"},
     "reward.models.pick.head: expected a path to the aesthetic head's weights"),
    (lambda f, h: {"kind": "aesthetic", "head": str(f / "none.pth")},
     "reward.models.pick.head: expected an existing file, got '{f}/none.pth'"),
    (lambda f, h: {"kind": "aesthetic", "head": str(f / "config.json")},
     "reward.models.pick.head: expected a file ending in one of ['.safetensors', '.pth', "
     "'.pt'], got '{f}/config.json'"),
    (lambda f, h: {"size": 3}, "reward.models.pick.size: unknown field"),
])
def test_model_settings_are_checked_naming_the_field(clip_folder, head_files, change,
                                                     message):
    with pytest.raises(ConfigError) as e:
        small_config(**_settings(clip_folder, **change(clip_folder, head_files)))
    expected = message.format(f=clip_folder, p=head_files["pth"].parent)
    assert str(e.value).startswith(expected), str(e.value)
    assert "\n" not in str(e.value)


def test_a_clip_folder_without_weights_or_tokenizer_is_refused(clip_folder, tmp_path):
    (tmp_path / "config.json").write_text((clip_folder / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"^reward.models.pick.path: expected a CLIPModel "
                                          r"folder holding model.safetensors or "):
        small_config(**_settings(tmp_path))
    (tmp_path / "preprocessor_config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^reward.models.pick.processor: expected a CLIP "
                                          r"processor folder holding tokenizer.json or "
                                          r"vocab.json"):
        small_config(**_settings(clip_folder, processor=str(tmp_path)))


def test_names_of_model_rewards_are_checked(clip_folder):
    with pytest.raises(ConfigError, match=r"^reward.models.brightness: expected a name that "
                                          r"is not a registered reward's"):
        checked_config(**{"reward.models": {"brightness": {"path": str(clip_folder)}}})
    with pytest.raises(ConfigError, match=r"^reward.models.x: expected a name that is not "
                                          r"also under reward.remote"):
        small_config(**{"reward.remote": {"x": {"url": "http://h/"}},
                        "reward.models": {"x": {"path": str(clip_folder)}}})


@pytest.mark.parametrize("head, message", [
    ("wide", f"expected a head taking {PROJECTION} inputs (the projection_dim of the CLIP "
             f"model at reward.models.aesthetic.path), got one taking {PROJECTION + 1}"),
    ("keys", "expected the keys of LAION's aesthetic head ['layers.0.bias', "),
    ("module", "expected a readable state dict of tensors (UnpicklingError: "),
])
def test_an_aesthetic_head_that_does_not_fit_stops_the_run_before_it_starts(
        clip_folder, head_files, tmp_path, head, message):
    from digenrl.run.runner import RLWorkload

    path = head_files.get(head, tmp_path / f"{head}.pth")
    if head == "keys":
        torch.save({"weight": torch.zeros(1, PROJECTION)}, path)
    elif head == "module":  # a whole pickled module: never unpickled
        torch.save(torch.nn.Linear(PROJECTION, 1), path)
    cfg = small_config(**{"reward.components": {"aesthetic": 1.0}, "reward.models": {
        "aesthetic": {"kind": "aesthetic", "path": str(clip_folder), "head": str(path)}}})
    with pytest.raises(ConfigError) as e:
        RLWorkload(cfg)
    assert str(e.value).startswith(f"reward.models.aesthetic.head: {message}"), str(e.value)
    assert "\n" not in str(e.value)


def test_a_reward_server_serves_a_model_reward(clip_folder, tmp_path):
    """``digenrl reward-server NAME --config``: the served scores equal the in-process
    ones bit for bit (served in requests of 2, scored in-process in slices of 3 and 2:
    every pass is padded to batch_size), and the server loaded the model once (before
    serving)."""
    from digenrl.serving.remote import RemoteReward

    from test_reward_server import Server

    settings = {"path": str(clip_folder), "batch_size": 3}
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"reward": {"models": {"pick": settings},
                                             "components": {"pick": 1.0}}}))
    server = Server("pick", "--config", str(config))
    try:
        served = RemoteReward("served", server.url, batch_size=2)(IMAGES, PROMPTS, [{}] * 5)
        stats = server.stats(token=None)
    finally:
        server.kill()
    spec = model_reward("pick", RewardModelConfig(**settings))
    np.testing.assert_array_equal(served, spec(IMAGES, PROMPTS))
    assert stats == {"reward": "pick", "requests": 3, "images": 5, "model_loads": 1,
                     "forward_passes": 3, "queued": 0, "answered_429": 0}


def test_a_served_score_does_not_depend_on_the_requests_sharing_its_pass(clip_folder,
                                                                         tmp_path):
    """Requests of 1, 2 and 3 images sent at once are gathered into passes of the
    model's batch_size (4), a request spread over two passes where it does not fit: every
    served score equals the in-process one bit for bit, and fewer passes ran than
    requests were answered."""
    from digenrl.serving.remote import RemoteReward

    from test_reward_server import Server

    images = np.random.default_rng(3).integers(0, 256, (12, IMAGE_SIZE, IMAGE_SIZE, 3),
                                               dtype=np.uint8)
    prompts = [f"a photo of thing {i}" for i in range(12)]
    settings = {"path": str(clip_folder), "batch_size": 4}
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"reward": {"models": {"pick": settings},
                                             "components": {"pick": 1.0}}}))
    # Passes start when full, or 2 s after their first request: all requests leave
    # together, so they share passes.
    server = Server("pick", "--config", str(config), "--max-wait-ms", "2000")
    spans = [(0, 1), (1, 3), (3, 6), (6, 7), (7, 9), (9, 12)]
    barrier = threading.Barrier(len(spans))
    served = np.full(12, np.nan)

    def send(a: int, b: int) -> None:
        client = RemoteReward("served", server.url, batch_size=b - a, timeout=30.0)
        barrier.wait()
        served[a:b] = client(images[a:b], prompts[a:b], [{}] * (b - a))

    try:
        threads = [threading.Thread(target=send, args=span) for span in spans]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stats = server.stats(token=None)
    finally:
        server.kill()
    spec = model_reward("pick", RewardModelConfig(**settings))
    np.testing.assert_array_equal(served, spec(images, prompts))
    assert (stats["requests"], stats["images"]) == (6, 12)
    assert 3 <= stats["forward_passes"] < 6, stats


def test_reward_server_model_arguments_are_checked(capsys, clip_folder, tmp_path):
    from digenrl.commands.cli import main

    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"reward": {"models": {"pick": {"path": str(clip_folder)}},
                                             "components": {"pick": 1.0}}}))
    assert main(["reward-server", "other", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("digenrl reward-server: error: reward: expected a registered reward "
                          "["), err
    assert f"or one of reward.models in {config} ['pick'], got 'other'" in err
    assert main(["reward-server", "pick", "--config", str(tmp_path / "no.yaml")]) == 2
    assert "error: config: expected an existing YAML file" in capsys.readouterr().err


def _loads_here(config: RewardModelConfig) -> int:
    return reward_model_loads(config)


@pytest.mark.slow
def test_a_run_raises_the_clip_reward_loading_it_once_per_worker(cluster_1x1, clip_folder,
                                                                tmp_path, caplog):
    """One prompt (so every iteration's reward compares the same thing), 4 images of
    each of its 2 groups; a seed and learning rate with which it rises (runs are
    deterministic)."""
    cfg = small_config(**{"iterations": 10, "seed": 7, "train.learning_rate": 1e-2,
                          "data.prompts": ["a photo of a cat"], "data.samples_per_prompt": 4,
                          "rollout.chunk_size": 4, "reward.components": {"pick": 1.0},
                          "reward.models": {"pick": {"path": str(clip_folder)}}})
    caplog.set_level(logging.INFO, logger="digenrl")
    Runner(cfg, str(tmp_path / "run.zarr"), cluster=cluster_1x1).run()
    ds = open_run(tmp_path / "run.zarr")
    r = ds["samples"].reward.values  # (iteration, sample)
    first, last = r[:3].ravel(), r[-3:].ravel()
    gain = last.mean() - first.mean()
    stderr = np.sqrt(first.var() / first.size + last.var() / last.size)
    assert gain > 0.5 and gain > 5 * stderr, (r.mean(axis=1), gain, stderr)
    # Every worker that ran reward tasks loaded the model once; the others never did.
    t = ds["tasks"]
    scorers = set(t.worker.values[t.kind.values == "reward"].tolist())
    loads = cluster_1x1.client.run(_loads_here, cfg.reward.models["pick"])
    assert scorers and {w: n for w, n in loads.items() if n} == {w: 1 for w in scorers}
    events = cluster_1x1.client.get_events(reward_models.EVENT_TOPIC)
    assert {e["worker"] for _, e in events if e["path"] == str(clip_folder)} == scorers
    # The run's log says so, one line per worker's load (events arrive asynchronously).
    def lines():
        return [r.getMessage() for r in caplog.records
                if r.getMessage().startswith(f"reward model clip from {clip_folder} loaded")]

    deadline = time.monotonic() + 30
    while len(lines()) < len(scorers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(line.split("in worker ")[1] for line in lines()) == sorted(
        f"{w})" for w in scorers), lines()

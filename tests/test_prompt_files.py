"""Prompt files: their checks, the seeded epoch order, and metadata reaching rewards.

A file is refused at start with the field, the file and the line. Each epoch visits every
line once in an order that depends only on the seed and the epoch, so a resumed run
continues it; a run's stored prompts follow it and its rewards see each line's metadata.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from digenrl.config import ConfigError
from digenrl.prompts import epoch_indices, epoch_order, load_prompt_file, prompt_source
from digenrl.run.runner import Runner
from digenrl.store import open_run

from conftest import assert_complete, checked_config, small_config
from metadata_rewards import metadata_score


def _write(path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_txt_and_jsonl_files_load_with_metadata(tmp_path):
    txt = load_prompt_file(_write(tmp_path / "p.txt", ["a cat", "a dog on a {mat}"]))
    assert txt.prompts == ("a cat", "a dog on a {mat}")
    assert txt.metadata == ({}, {})
    jsonl = load_prompt_file(_write(tmp_path / "p.jsonl", [
        json.dumps({"prompt": "two dogs", "tag": "counting", "include": [{"class": "dog",
                                                                         "count": 2}]}),
        json.dumps({"prompt": "a red cube"})]))
    assert jsonl.prompts == ("two dogs", "a red cube")
    assert jsonl.metadata == ({"tag": "counting", "include": [{"class": "dog", "count": 2}]},
                              {})
    cfg = small_config(**{"data.prompt_file": jsonl.path})
    prompts, metadata, _ = prompt_source(cfg.data).draw(3, cfg.seed, 0)
    assert [json.loads(m) if m else {} for m in metadata] == [
        jsonl.metadata[jsonl.prompts.index(p)] for p in prompts]


@pytest.mark.parametrize("name, lines, message", [
    ("p.txt", ["a cat", "", "a dog"], "line 2 of {path}: expected a prompt, got an empty line"),
    ("p.txt", ["a cat", "   "], "line 2 of {path}: expected a prompt, got an empty line"),
    ("p.jsonl", ['{"prompt": "a"}', '{"prompt": "b"'],
     "line 2 of {path}: expected a JSON object, got bad JSON (Expecting"),
    ("p.jsonl", ['{"prompt": "a"}', '["b"]'],
     "line 2 of {path}: expected a JSON object, got list"),
    ("p.jsonl", ['{"prompt": "a"}', '{"text": "b"}', '{"prompt": "c"}'],
     'line 2 of {path}: expected a "prompt" key holding a non-empty string, got no '
     '"prompt" key'),
    ("p.jsonl", ['{"prompt": 3}'],
     'line 1 of {path}: expected a "prompt" key holding a non-empty string, got 3'),
    ("p.txt", [], "expected at least one prompt, got an empty file '{path}'"),
    ("p.csv", ["a cat"], "expected a .txt (one prompt per line) or .jsonl"),
])
@pytest.mark.parametrize("field", ["prompt_file", "eval_prompt_file"])
def test_bad_prompt_files_are_refused_naming_field_file_and_line(tmp_path, name, lines,
                                                                 message, field):
    path = _write(tmp_path / name, lines)
    with pytest.raises(ConfigError) as e:
        checked_config(**{f"data.{field}": path})
    expected = f"data.{field}: " + message.format(path=path)
    assert str(e.value).startswith(expected), str(e.value)
    assert "\n" not in str(e.value)


def test_missing_files_and_ambiguous_prompts_are_refused(tmp_path):
    missing = str(tmp_path / "nowhere.txt")
    with pytest.raises(ConfigError, match=rf"^data.prompt_file: expected an existing prompt "
                                          rf"file, got '{missing}' \(No such file"):
        checked_config(**{"data.prompt_file": missing})
    path = _write(tmp_path / "p.txt", ["a cat"])
    with pytest.raises(ConfigError, match=r"^data.prompts: expected an empty list when "
                                          r"data.prompt_file is set"):
        small_config(**{"data.prompt_file": path, "data.prompts": ["a dog"]})


def test_each_epoch_visits_every_prompt_once_in_a_seeded_order():
    n, count = 7, 3
    # 7 iterations of 3 prompts are exactly 3 epochs of 7.
    drawn = [j for i in range(7) for j in epoch_indices(n, count, seed=5, iteration=i)]
    epochs = [drawn[k * n:(k + 1) * n] for k in range(3)]
    for e, visited in enumerate(epochs):
        assert sorted(visited) == list(range(n))
        assert visited == list(epoch_order(n, 5, e))
    assert len({tuple(e) for e in epochs}) == 3  # each epoch its own order
    assert [epoch_indices(n, count, 6, i) for i in range(3)] != [
        epoch_indices(n, count, 5, i) for i in range(3)]


def test_the_order_depends_only_on_seed_and_iteration():
    """What a resumed run relies on: iteration i's prompts, computed in a fresh process
    state (no earlier iteration drawn, other epochs cached), are the same."""
    n, count = 11, 4
    straight = [epoch_indices(n, count, 9, i) for i in range(8)]
    epoch_order.cache_clear()
    for e in (7, 3, 12, 5):  # fill the cache with unrelated epochs
        epoch_order(n, 9, e)
    resumed = [epoch_indices(n, count, 9, i) for i in range(5, 8)]
    assert resumed == straight[5:]


def test_a_resumed_run_follows_the_epoch_order_and_rewards_see_metadata(cluster_1x1,
                                                                        tmp_path):
    records = [{"prompt": f"prompt {k}", "score": float(10 * k)} for k in range(3)]
    path = _write(tmp_path / "p.jsonl", [json.dumps(r) for r in records])
    out = str(tmp_path / "run.zarr")
    settings = {"data.prompt_file": path, "reward.components": {"metadata_score": 1.0}}
    # Iteration 0 takes lines 0 and 1 of epoch 0; iteration 1, after the resume, the
    # last of epoch 0 and the first of epoch 1.
    Runner(small_config(iterations=1, **settings), out, cluster=cluster_1x1).run()
    Runner(small_config(iterations=2, **settings), out, cluster=cluster_1x1,
           resume=True).run()
    ds = open_run(out)
    assert assert_complete(ds) == 2
    s = ds["samples"]
    cfg = small_config(**settings)
    per, spp = cfg.data.prompts_per_iteration, cfg.data.samples_per_prompt
    for i in range(2):
        lines = epoch_indices(len(records), per, cfg.seed, i)
        expected = [records[j]["prompt"] for j in lines for _ in range(spp)]
        assert list(s.prompt.values[i]) == expected, i
        metadata = [{"score": records[j]["score"]} for j in lines for _ in range(spp)]
        scores = metadata_score(s.image.values[i], expected, metadata)
        assert np.array_equal(s.reward_metadata_score.values[i], scores), i

    # A prompt file changed since: its epochs would visit other lines, so resuming with
    # it is refused before any work, naming the field.
    _write(tmp_path / "p.jsonl", [json.dumps(r) for r in reversed(records)])
    with pytest.raises(ConfigError, match=r"resume: data.prompt_file changed since"):
        Runner(small_config(iterations=3, **settings), out, cluster=cluster_1x1,
               resume=True).run()
    assert assert_complete(open_run(out)) == 2

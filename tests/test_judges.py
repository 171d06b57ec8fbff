"""VLM judges over the OpenAI-compatible API (reward.remote.NAME.protocol: openai), against
a small chat-completions server started here on 127.0.0.1 with the reward server's HTTP
stack (Tornado). Its answers are computed from the image it is sent -- b, the image's mean
brightness in [0, 1] -- so a score can only be right if the image arrived:

* model ``yes-no``: the first token's top logprobs give "Yes" log(b) and " NO " log(1 - b)
  (and "maybe" a little), so p(yes) / (p(yes) + p(no)) is b;
* model ``rater``: the text ``"{1 + 4b}, since ..."``, so with number_range [1, 5] the
  score is b;
* the models ``no-choices``, ``no-logprobs``, ``undecided`` and ``no-number`` answer
  without a score; ``busy-once`` answers 429 (Retry-After: 1) to an image's first request.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import threading

import numpy as np
import pytest
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets
from tornado.web import Application, RequestHandler

from digenrl.config import ConfigError, RemoteRewardConfig
from digenrl.serving.judges import DEFAULT_QUESTIONS, OpenAIJudge
from digenrl.serving.remote import decode_image
from digenrl.tasks.reward_sources import resolve_rewards
from digenrl.tasks.rewards import RewardError, evaluate_rewards

from conftest import small_config

IMAGES = np.random.default_rng(0).integers(20, 236, (6, 8, 8, 3), dtype=np.uint8)
PROMPTS = [f"thing {i}" for i in range(6)]
BRIGHTNESS = IMAGES.reshape(6, -1).mean(axis=1) / 255
PNG_URL = "data:image/png;base64,"


class _Completions(RequestHandler):
    def initialize(self, judge: "JudgeServer") -> None:
        self.judge = judge

    def post(self) -> None:
        body = json.loads(self.request.body)
        self.judge.requests.append(body)
        parts = body["messages"][0]["content"]
        url = next(p["image_url"]["url"] for p in parts if p["type"] == "image_url")
        if not url.startswith(PNG_URL):
            self.set_status(400)
            self.finish({"error": {"message": f"expected a PNG data URL, got {url[:30]}"}})
            return
        pixels = decode_image(base64.b64decode(url.removeprefix(PNG_URL)))
        b = float(pixels.mean() / 255)
        model = body["model"]
        if model == "busy-once" and self.judge.seen.setdefault(url, 0) == 0:
            self.judge.seen[url] += 1
            self.set_status(429)
            self.set_header("Retry-After", "1")
            self.finish({"error": {"message": "busy"}})
            return
        choice: dict = {"index": 0, "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "Yes" if b > 0.5 else "No"}}
        if model in ("yes-no", "undecided", "busy-once") and body.get("logprobs"):
            top = ([{"token": "Yes", "logprob": math.log(b)},
                    {"token": " NO ", "logprob": math.log(1 - b)}] if model != "undecided"
                   else [{"token": "Perhaps", "logprob": -0.5}])
            top.append({"token": "maybe", "logprob": math.log(1e-3)})
            choice["logprobs"] = {"content": [{"token": "Yes", "logprob": top[0]["logprob"],
                                               "top_logprobs": top[:body["top_logprobs"]]}]}
        elif model == "rater":
            choice["message"]["content"] = f"{1 + 4 * b!r}, since the image is that bright."
        elif model == "no-number":
            choice["message"]["content"] = "I cannot rate this image."
        answer = {"id": "chatcmpl-1", "object": "chat.completion", "model": model,
                  "choices": [] if model == "no-choices" else [choice]}
        self.finish(answer)


class JudgeServer:
    """The chat-completions server described above, on its own event loop thread;
    ``url`` is its OpenAI base URL (``.../v1``), ``requests`` the bodies it received."""

    def __init__(self):
        self.requests: list[dict] = []
        self.seen: dict[str, int] = {}
        started = threading.Event()

        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self.stop = asyncio.Event()
            sockets = bind_sockets(0, address="127.0.0.1")
            server = HTTPServer(Application([(r"/v1/chat/completions", _Completions,
                                              {"judge": self})]))
            server.add_sockets(sockets)
            self.url = f"http://127.0.0.1:{sockets[0].getsockname()[1]}/v1"
            started.set()
            await self.stop.wait()
            server.stop()
            await server.close_all_connections()

        self.thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
        self.thread.start()
        assert started.wait(30), "the judge server did not start"

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)


@pytest.fixture(scope="module")
def judge():
    server = JudgeServer()
    yield server
    server.close()


def _judge_reward(judge: JudgeServer, **settings):
    config = RemoteRewardConfig(**{"url": judge.url, "protocol": "openai", "retries": 0,
                                   "timeout": 10.0, **settings})
    config.validate("reward.remote.judge")
    ((spec, _),) = resolve_rewards({"judge": 1.0}, {"judge": config})
    return spec


def test_a_yes_no_judge_scores_p_yes_over_the_first_tokens_logprobs(judge):
    judge.requests.clear()
    spec = _judge_reward(judge, model="yes-no", concurrency=3,
                         question="Is this {prompt} in the {style} style? Answer yes or no.")
    assert spec.device == "wait" and spec.takes_metadata
    metadata = [{"style": f"style-{i}"} for i in range(6)]
    scores = spec(IMAGES, PROMPTS, metadata)
    np.testing.assert_allclose(scores, BRIGHTNESS, rtol=1e-12)
    # One request per image, each carrying its PNG (lossless) and its own question.
    assert len(judge.requests) == 6
    asked = {}
    for body in judge.requests:
        assert (body["model"], body["max_tokens"], body["temperature"], body["logprobs"],
                body["top_logprobs"]) == ("yes-no", 1, 0.0, True, 20)
        image, text = body["messages"][0]["content"]
        pixels = decode_image(base64.b64decode(image["image_url"]["url"].removeprefix(PNG_URL)))
        i = next(i for i in range(6) if np.array_equal(pixels, IMAGES[i]))
        asked[i] = text["text"]
    assert asked == {i: f"Is this thing {i} in the style-{i} style? Answer yes or no."
                     for i in range(6)}


def test_a_rating_judge_scores_the_first_number_scaled_by_number_range(judge):
    judge.requests.clear()
    spec = _judge_reward(judge, model="rater", score="number", number_range=(1.0, 5.0))
    scores = spec(IMAGES, PROMPTS, [{}] * 6)
    np.testing.assert_allclose(scores, BRIGHTNESS, rtol=1e-12)
    body = judge.requests[0]
    assert "logprobs" not in body and body["max_tokens"] == 32
    assert body["messages"][0]["content"][1]["text"] in {
        DEFAULT_QUESTIONS["number"].format(prompt=p) for p in PROMPTS}


@pytest.mark.parametrize("model, score, expected", [
    ("no-choices", "logprobs", "expected a chat completion with choices, got {'id': "),
    ("no-logprobs", "logprobs", "expected the first token's top logprobs "
                                "(choices[0].logprobs.content[0].top_logprobs), got None"),
    ("undecided", "logprobs", "expected 'yes' or 'no' among the first token's 2 top "
                              "logprobs, got ['Perhaps', 'maybe']"),
    ("no-number", "number", "expected a number in the answer, got 'I cannot rate this "
                            "image.'"),
    ("rater", "number-out-of-range", "expected a number from 0 to 1 (number_range) in the "
                                     "answer, got "),
])
def test_an_answer_without_a_score_fails_in_one_line_naming_reward_and_url(judge, model,
                                                                           score, expected):
    settings = {"model": model, "score": score}
    if score == "number-out-of-range":
        settings.update(score="number", number_range=(0.0, 1.0))
    rewards = resolve_rewards({"judge": 1.0}, {"judge": RemoteRewardConfig(
        url=judge.url, protocol="openai", retries=0, **settings)})
    with pytest.raises(RewardError) as e:
        evaluate_rewards(IMAGES[:2], PROMPTS[:2], range(2), rewards, "raise", iteration=3,
                         metadata=[{}, {}])
    message = str(e.value)
    head = f"reward 'judge' raised RemoteRewardError: judge server {judge.url}/chat/completions: "
    assert message.startswith(head + expected), message
    assert "\n" not in message


def test_a_question_naming_missing_metadata_fails_before_any_request(judge):
    judge.requests.clear()
    spec = _judge_reward(judge, model="yes-no", question="Is it {colour}?")
    with pytest.raises(Exception, match=r"^reward.remote.judge.question: expected every "
                                        r"sample's metadata to hold 'colour' \(the question "
                                        r"names \{colour\}\), got keys \['style'\]$"):
        spec(IMAGES[:2], PROMPTS[:2], [{"style": "x"}] * 2)
    assert judge.requests == []


def test_a_busy_judge_is_retried_after_its_retry_after(judge, caplog):
    judge.seen.clear()
    spec = _judge_reward(judge, model="busy-once", retries=2, backoff=0.0)
    with caplog.at_level(logging.WARNING, logger="digenrl"):
        scores = spec(IMAGES[:2], PROMPTS[:2], [{}] * 2)
    np.testing.assert_allclose(scores, BRIGHTNESS[:2], rtol=1e-12)
    retried = [r.getMessage() for r in caplog.records if "attempt 2 of 3" in r.getMessage()]
    assert len(retried) == 2, retried
    assert retried[0] == (f"reward 'judge': {judge.url}/chat/completions: HTTP 429: busy; "
                          f"attempt 2 of 3 in 1.0 s")  # the server's wait, not backoff's 0


def test_the_token_travels_but_is_not_shown(monkeypatch, judge):
    monkeypatch.setenv("JUDGE_TOKEN", "t0ken")
    spec = _judge_reward(judge, model="yes-no", token_env="JUDGE_TOKEN")
    assert isinstance(spec.fn, OpenAIJudge) and spec.fn.token == "t0ken"
    assert "t0ken" not in repr(spec)


@pytest.mark.parametrize("settings, message", [
    ({"protocol": "openai"},
     "reward.remote.judge.model: expected the served model's name (protocol openai asks a "
     "judge model), got None"),
    ({"model": "m"}, "reward.remote.judge.model: expected null (only protocol openai asks a "
                     "judge), got 'm'"),
    ({"question": "q {prompt}"},
     "reward.remote.judge.question: expected null (only protocol openai asks a judge)"),
    ({"protocol": "openai", "model": "m", "question": "Is it {prompt"},
     "reward.remote.judge.question: expected text whose {fields} are names ({prompt} or "
     "metadata keys; {{ and }} for braces), got 'Is it {prompt'"),
    ({"protocol": "openai", "model": "m", "question": "Is it {0}?"},
     "reward.remote.judge.question: expected text whose {fields} are names"),
    ({"protocol": "openai", "model": "m", "score": "text"},
     "reward.remote.judge.score: expected one of ['logprobs', 'number'], got 'text'"),
    ({"protocol": "openai", "model": "m", "number_range": [5, 1]},
     "reward.remote.judge.number_range: expected [LOW, HIGH], two finite numbers with LOW < "
     "HIGH, got [5.0, 1.0]"),
    ({"protocol": "openai", "model": "m", "number_range": [1]},
     "reward.remote.judge.number_range: expected [LOW, HIGH]"),
    ({"protocol": "openai", "model": "m", "top_logprobs": 21},
     "reward.remote.judge.top_logprobs: expected an integer from 1 to 20, got 21"),
    ({"protocol": "openai", "model": "m", "concurrency": 0},
     "reward.remote.judge.concurrency: expected an integer from 1 to 64, got 0"),
    ({"protocol": "openai", "model": "m", "max_tokens": 0},
     "reward.remote.judge.max_tokens: expected an integer >= 1, got 0"),
])
def test_judge_settings_are_checked_naming_the_field(settings, message):
    with pytest.raises(ConfigError) as e:
        small_config(**{"reward.remote": {"judge": {"url": "http://h/v1", **settings}},
                        "reward.components": {"judge": 1.0}})
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)


def test_a_question_without_the_prompt_judges_the_image_alone(judge):
    judge.requests.clear()
    spec = _judge_reward(judge, model="yes-no", question="Is this image sharp?")
    np.testing.assert_allclose(spec(IMAGES[:1], PROMPTS[:1], [{}]), BRIGHTNESS[:1],
                               rtol=1e-12)
    assert judge.requests[0]["messages"][0]["content"][1]["text"] == "Is this image sharp?"

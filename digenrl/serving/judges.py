"""VLM judges as rewards: a vision-language model, served with an OpenAI-compatible API
(vLLM, SGLang), asked a question about each image (``reward.remote.NAME.protocol: openai``).

Each image is one ``POST URL/chat/completions`` (``URL`` the server's base URL, e.g.
``http://host:8000/v1``) whose user message holds the image, as a
``data:image/png;base64,...`` URL in an ``image_url`` part (PNG: the pixels the run
generated), and the question, a template filled with the sample's prompt (``{prompt}``)
and metadata (``{KEY}``). Sampling is greedy (``temperature: 0``). The score is either

* ``logprobs`` (yes/no judges): ``p(yes) / (p(yes) + p(no))``, where ``p(yes)`` sums the
  probabilities of the first generated token's ``top_logprobs`` that read "yes" ignoring
  case and spaces ("Yes", " yes"), and ``p(no)`` likewise; or
* ``number`` (judges that rate, such as UnifiedReward's): the first number in the
  answer's text, ``(number - LOW) / (HIGH - LOW)`` with ``number_range: [LOW, HIGH]``.

A reward task's images are asked at once, at most ``concurrency`` requests in flight,
through the process's pooled connections (:func:`digenrl.serving.remote.post`: the same
timeout, retries and one-line failures as a reward server). An answer that gives no
score -- no choices, no logprobs when asked for, neither "yes" nor "no" among the top
tokens, no number or one outside the range -- fails the reward in one line naming the
URL and what the answer held instead (the reward task adds the reward's name).
"""

from __future__ import annotations

import base64
import json
import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from digenrl.config import RemoteRewardConfig
from digenrl.serving.remote import RemoteRewardError, encode_image, post

__all__ = ["OpenAIJudge", "openai_judge", "yes_probability", "first_number",
           "DEFAULT_QUESTIONS", "DEFAULT_MAX_TOKENS"]

#: The question asked when none is configured, by score.
DEFAULT_QUESTIONS = {
    "logprobs": 'Does this image match the description "{prompt}"? Answer yes or no.',
    "number": 'How well does this image match the description "{prompt}"? Rate it from 0 '
              'to 10 and answer with the number only.',
}
#: Tokens generated when max_tokens is not configured, by score: the first token is all
#: a yes/no judge needs.
DEFAULT_MAX_TOKENS = {"logprobs": 1, "number": 32}

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")


class MalformedAnswer(ValueError):
    """An answer that gives no score: the message says what was expected and what came."""


def _brief(value: Any, limit: int = 120) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _first_choice(answer: Any) -> dict:
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise MalformedAnswer(f"expected a chat completion with choices, got "
                              f"{_brief(answer)}")
    return choices[0]


def yes_probability(answer: Any) -> float:
    """``p(yes) / (p(yes) + p(no))`` from the first generated token's top logprobs of a
    chat completion (a dict), or :class:`MalformedAnswer`."""
    choice = _first_choice(answer)
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    first = content[0] if isinstance(content, list) and content else None
    top = first.get("top_logprobs") if isinstance(first, dict) else None
    if not isinstance(top, list) or not top or not all(
            isinstance(t, dict) and isinstance(t.get("token"), str)
            and isinstance(t.get("logprob"), (int, float)) for t in top):
        raise MalformedAnswer(f"expected the first token's top logprobs "
                              f"(choices[0].logprobs.content[0].top_logprobs), got "
                              f"{_brief(logprobs)}")
    p = {"yes": 0.0, "no": 0.0}
    for t in top:
        word = t["token"].strip().lower()
        if word in p:
            p[word] += math.exp(t["logprob"])
    if p["yes"] + p["no"] == 0.0:
        raise MalformedAnswer(f"expected 'yes' or 'no' among the first token's "
                              f"{len(top)} top logprobs, got "
                              f"{_brief([t['token'] for t in top])}")
    return p["yes"] / (p["yes"] + p["no"])


def first_number(answer: Any, low: float, high: float) -> float:
    """The first number of a chat completion's text, scaled from ``[low, high]`` to
    ``[0, 1]``, or :class:`MalformedAnswer`."""
    message = _first_choice(answer).get("message")
    text = message.get("content") if isinstance(message, dict) else None
    if not isinstance(text, str):
        raise MalformedAnswer(f"expected the answer's text (choices[0].message.content), "
                              f"got {_brief(message)}")
    match = _NUMBER.search(text)
    if match is None:
        raise MalformedAnswer(f"expected a number in the answer, got {_brief(text)}")
    value = float(match.group())
    if not low <= value <= high:
        raise MalformedAnswer(f"expected a number from {low:g} to {high:g} "
                              f"(number_range) in the answer, got {value:g} in "
                              f"{_brief(text)}")
    return (value - low) / (high - low)


@dataclass(frozen=True)
class OpenAIJudge:
    """The function of a judge reward: asks the server about each image, concurrently.

    Travels with the reward task to the worker (by value); the bearer token is left out
    of its repr."""

    name: str
    url: str
    model: str
    question: str
    score: str = "logprobs"
    number_range: tuple[float, float] = (0.0, 10.0)
    max_tokens: int = 1
    top_logprobs: int = 20
    concurrency: int = 8
    timeout: float = 60.0
    retries: int = 3
    backoff: float = 1.0
    token: str | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return self.url.rstrip("/") + "/chat/completions"

    def __call__(self, images: np.ndarray, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any]]) -> np.ndarray:
        questions = [self.ask(p, m) for p, m in zip(prompts, metadata)]  # before any request
        if not len(images):
            return np.zeros(0)
        pool = ThreadPoolExecutor(min(self.concurrency, len(images)),
                                  thread_name_prefix=f"digenrl-judge-{self.name}")
        try:
            futures = [pool.submit(self._judge, image, q) for image, q in zip(images, questions)]
            return np.asarray([f.result() for f in futures], dtype=np.float64)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def ask(self, prompt: str, metadata: Mapping[str, Any]) -> str:
        """The question about one sample: the template filled with its prompt and
        metadata."""
        try:
            return self.question.format_map({**metadata, "prompt": prompt})
        except KeyError as e:
            raise RemoteRewardError(
                f"reward.remote.{self.name}.question: expected every sample's metadata to "
                f"hold {e.args[0]!r} (the question names {{{e.args[0]}}}), got keys "
                f"{sorted(metadata)}") from None

    def request(self, image: np.ndarray, question: str) -> dict[str, Any]:
        """The chat completion request about one image."""
        png = base64.b64encode(encode_image(image)).decode("ascii")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                {"type": "text", "text": question}]}],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
        }
        if self.score == "logprobs":
            body.update(logprobs=True, top_logprobs=self.top_logprobs)
        return body

    def _judge(self, image: np.ndarray, question: str) -> float:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        url = self.endpoint
        response = post(url, json.dumps(self.request(image, question)).encode(), headers,
                        reward=self.name, timeout=self.timeout, retries=self.retries,
                        backoff=self.backoff, server="judge server")
        try:
            answer = json.loads(response.data)
        except ValueError:
            raise RemoteRewardError(f"judge server {url}: expected a JSON chat completion, "
                                    f"got {_brief(response.data[:200])}") from None
        try:
            if self.score == "logprobs":
                return yes_probability(answer)
            return first_number(answer, *self.number_range)
        except MalformedAnswer as e:
            raise RemoteRewardError(f"judge server {url}: {e}") from None


def openai_judge(name: str, config: RemoteRewardConfig, token: str | None) -> OpenAIJudge:
    """The judge ``config`` describes (``protocol: openai``), with its defaults filled."""
    # (Both checked with the config: a model's name, and [LOW, HIGH].)
    assert config.model is not None
    low, high = config.number_range
    return OpenAIJudge(
        name, config.url, config.model,
        config.question if config.question is not None else DEFAULT_QUESTIONS[config.score],
        config.score, (low, high),
        config.max_tokens if config.max_tokens is not None
        else DEFAULT_MAX_TOKENS[config.score],
        config.top_logprobs, config.concurrency, config.timeout, config.retries,
        config.backoff, token)

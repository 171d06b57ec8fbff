"""``digenrl reward-server`` and the remote reward client, over real HTTP on 127.0.0.1.

A run scored through the server equals the run scoring in-process, bit for bit. The
server answers every bad request with a 4xx naming the problem and goes on serving. The
client retries a server that went away and comes back, gives up on one that stays away
with the reward and the URL named (stopping the run, or dropping the samples), and never
retries a request the server refused.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest

from digenrl.config import ConfigError, RemoteRewardConfig
from digenrl.run.runner import Runner
from digenrl.store import committed_iterations, open_run
from digenrl.serving.remote import RemoteReward, RemoteRewardError, encode_image
from digenrl.tasks.reward_sources import resolve_rewards
from digenrl.tasks.rewards import (RewardError, brightness, evaluate_rewards,
                                   jpeg_compressibility)

from conftest import (REFERENCE_ITERATIONS, assert_complete, assert_same_results,
                      checked_config, small_config)
from metadata_rewards import metadata_score

TESTS = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
TOKEN = "s3cret-token"
IMAGES = np.random.default_rng(0).integers(0, 256, (5, 16, 16, 3), dtype=np.uint8)
PROMPTS = [f"prompt {i}" for i in range(5)]


class Server:
    """A ``digenrl reward-server`` subprocess; ``url`` is what it printed."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        environ = {**os.environ, **(env or {})}
        environ["PYTHONPATH"] = os.pathsep.join(
            [str(TESTS)] + [p for p in [environ.get("PYTHONPATH")] if p])
        self.proc = subprocess.Popen([str(BIN / "digenrl"), "reward-server", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=environ)
        line = self.proc.stdout.readline()
        if " at " not in line:
            self.proc.kill()
            raise AssertionError(f"the server did not start: {line!r} "
                                 f"{self.proc.stderr.read()!r}")
        self.url = line.split(" at ")[1].split()[0]
        self.port = int(self.url.rsplit(":", 1)[1].strip("/"))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stats(self, token: str | None = TOKEN) -> dict:
        req = urllib.request.Request(self.url, headers=_auth(token))
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


@pytest.fixture(scope="module")
def server():
    """jpeg_compressibility, behind a token from the environment, at most 100 kB a
    request, a body that stalls for 1 s given up."""
    s = Server("jpeg_compressibility", "--max-bytes", "100000", "--read-timeout", "1",
               env={"DIGENRL_REWARD_TOKEN": TOKEN})
    yield s
    s.kill()


def _client(url: str, **kw) -> RemoteReward:
    return RemoteReward("served", url, **{"token": TOKEN, "timeout": 10.0, **kw})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ good requests


def test_client_scores_in_batches_as_in_process(server):
    before = server.stats()
    scores = _client(server.url, batch_size=2)(IMAGES, PROMPTS, [{}] * 5)
    assert np.array_equal(scores, jpeg_compressibility(IMAGES, PROMPTS))
    after = server.stats()
    assert after["reward"] == "jpeg_compressibility"
    assert after["requests"] - before["requests"] == 3  # 2 + 2 + 1 images
    assert after["images"] - before["images"] == 5


def test_metadata_reaches_a_served_reward_and_pickle_is_opt_in(tmp_path):
    s = Server("metadata_score", "--import", "metadata_rewards", "--allow-pickle")
    try:
        metadata = [{"score": float(i), "tag": [i]} for i in range(5)]
        expected = metadata_score(IMAGES, PROMPTS, metadata)
        for protocol in ("json", "msgpack", "pickle"):
            got = RemoteReward("m", s.url, protocol=protocol)(IMAGES, PROMPTS, metadata)
            assert np.array_equal(got, expected), protocol
        # Even allowed, a pickle may only hold plain data: naming a function is refused.
        status, reason = _post(s.url, pickle.dumps({"images": [os.system]}))
        assert status == 400 and "refused to load posix.system" in reason, reason
    finally:
        s.kill()


def test_a_run_scored_by_the_server_equals_the_in_process_run(cluster_1x1, server,
                                                              reference_run, tmp_path,
                                                              monkeypatch):
    """The reference run's reward is jpeg_compressibility computed in the reward tasks;
    here the same reward comes from the server, one image per request."""
    cfg = small_config(**{"iterations": REFERENCE_ITERATIONS,
                          "reward.components": {"served": 1.0},
                          "reward.remote": {"served": {"url": server.url, "batch_size": 1,
                                                       "token_env": "SERVED_TOKEN"}}})
    monkeypatch.setenv("SERVED_TOKEN", TOKEN)
    result = Runner(cfg, str(tmp_path / "served.zarr"), cluster=cluster_1x1).run()
    ds = open_run(tmp_path / "served.zarr")
    assert_same_results(ds, result.final_weights.tensors, reference_run)
    assert np.array_equal(ds["samples"].reward_served.values,
                          reference_run[1]["samples"].reward_jpeg_compressibility.values)


def test_256_clients_at_once_are_all_answered_in_shared_passes(tmp_path, caplog):
    """256 clients, one image each, connect at once to a model reward (batch_size 8)
    whose queue holds at most 32 images: none is reset, every one is scored (some after
    a 429 and the Retry-After it names), and the passes hold several requests each."""
    from clip_models import IMAGE_SIZE, save_tiny_clip

    n = 256
    folder = save_tiny_clip(tmp_path / "clip")
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"reward": {
        "models": {"pick": {"path": str(folder), "batch_size": 8}},
        "components": {"pick": 1.0}}}))
    images = np.random.default_rng(4).integers(0, 256, (n, IMAGE_SIZE, IMAGE_SIZE, 3),
                                               dtype=np.uint8)
    s = Server("pick", "--config", str(config), "--max-queue", "32", "--max-wait-ms", "500")
    barrier = threading.Barrier(n)
    scores = np.full(n, np.nan)
    failures: list[str] = []

    def send(i: int) -> None:
        client = RemoteReward("served", s.url, retries=20, backoff=0.1, timeout=60.0)
        barrier.wait()
        try:
            scores[i] = client(images[i:i + 1], [f"prompt {i}"], [{}])[0]
        except Exception as e:  # reported below, with the others
            failures.append(f"{i}: {e}")

    try:
        with caplog.at_level(logging.WARNING, logger="digenrl"):
            threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        stats = s.stats(token=None)
    finally:
        s.kill()
    assert not failures, failures[:5]
    assert not np.isnan(scores).any()
    retries = [r.getMessage() for r in caplog.records if "; attempt " in r.getMessage()]
    assert all(": HTTP 429: busy: " in m for m in retries), [
        m for m in retries if "HTTP 429" not in m][:5]  # no reset, refused or lost answer
    assert (stats["requests"], stats["images"], stats["queued"]) == (n, n, 0)
    assert stats["answered_429"] == len(retries) > 0
    assert stats["forward_passes"] <= n // 4, stats


# ------------------------------------------------------------------- bad requests


def _post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, data=body, headers={
        "Content-Type": "application/json", **(headers or {})}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]


def _raw_bytes(port: int, head: bytes, body: bytes = b"", half_close: bool = True) -> bytes:
    """Send ``head`` and ``body`` on a socket, stop sending (or, not ``half_close``,
    stall), read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + body)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def _raw(port: int, head: bytes, body: bytes = b"", half_close: bool = True
         ) -> tuple[int, str]:
    """The status and reason of the answer to a hand-written request."""
    head_text, _, answer = _raw_bytes(port, head, body, half_close).partition(b"\r\n\r\n")
    return int(head_text.split()[1]), json.loads(answer)["error"]


def _good_json(images=IMAGES[:1]) -> bytes:
    return json.dumps({"images": [base64.b64encode(encode_image(i)).decode() for i in images],
                       "prompts": ["p"] * len(images), "metadata": [{}] * len(images)}).encode()


def _headers(port: int, length: int | None) -> bytes:
    head = f"POST / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {TOKEN}\r\n"
    if length is not None:
        head += f"Content-Length: {length}\r\n"
    return (head + "\r\n").encode()


BAD = {
    "truncated": lambda s: _raw(s.port, _headers(s.port, 1000), _good_json()[:10],
                                half_close=False),
    # (Answered from the headers alone: the client keeps its side open, as HTTP clients
    # do, so that the answer never races the server's seeing the connection end.)
    "oversized": lambda s: _raw(s.port, _headers(s.port, 100001), half_close=False),
    "no length": lambda s: _raw(s.port, _headers(s.port, None), half_close=False),
    "malformed JSON": lambda s: _post(s.url, b'{"images": [', _auth(TOKEN)),
    "wrong JSON": lambda s: _post(s.url, b'{"images": "x.png"}', _auth(TOKEN)),
    "prompts missing": lambda s: _post(s.url, json.dumps(
        {"images": json.loads(_good_json())["images"]}).encode(), _auth(TOKEN)),
    "not JSON": lambda s: _post(s.url, b"images=1", {**_auth(TOKEN), "Content-Type": "text/plain"}),
    "malformed MessagePack": lambda s: _post(s.url, b"\x83\xa6images", {
        **_auth(TOKEN), "Content-Type": "application/msgpack"}),
    "wrong MessagePack": lambda s: _post(s.url, msgpack.packb(
        {"images": [encode_image(IMAGES[0])], "prompts": ["p", "q"]}),
        {**_auth(TOKEN), "Content-Type": "application/msgpack"}),
    "pickle": lambda s: _post(s.url, pickle.dumps({"images": []}),
                              {**_auth(TOKEN), "Content-Type": "application/octet-stream"}),
    "no token": lambda s: _post(s.url, _good_json()),
    "wrong token": lambda s: _post(s.url, _good_json(), _auth("guess")),
    "not base64": lambda s: _post(s.url, json.dumps(
        {"images": ["@@@"], "prompts": ["p"]}).encode(), _auth(TOKEN)),
    "not an image": lambda s: _post(s.url, json.dumps(
        {"images": [base64.b64encode(b"no picture here").decode()],
         "prompts": ["p"]}).encode(), _auth(TOKEN)),
}

EXPECTED = {
    "truncated": (400, "truncated body: expected 1000 bytes (Content-Length), got 10 (then "
                       "nothing for 1 s)"),
    "oversized": (413, "expected a body of at most 100000 bytes (--max-bytes), got "
                       "Content-Length 100001"),
    "no length": (411, "expected a Content-Length header"),
    "malformed JSON": (400, "expected a JSON object, got malformed JSON"),
    "wrong JSON": (400, "images: expected a non-empty list of encoded images, got 'x.png'"),
    "prompts missing": (400, "prompts: expected a list of 1 strings (one per image), got None"),
    "not JSON": (415, "expected a JSON object (Content-Type application/json) or MessagePack "
                      "(application/msgpack), got 8 bytes of text/plain"),
    "malformed MessagePack": (400, "expected a MessagePack map, got malformed MessagePack"),
    "wrong MessagePack": (400, "prompts: expected a list of 1 strings (one per image), got "
                               "['p', 'q']"),
    "pickle": (415, "expected JSON or MessagePack, got a pickle (unpickling runs code; "
                    "start the server with --allow-pickle"),
    "no token": (401, "missing bearer token"),
    "wrong token": (401, "wrong bearer token"),
    "not base64": (400, "images[0]: expected base64 text of a PNG or JPEG, got text that is "
                        "not base64"),
    "not an image": (400, "images[0]: expected a PNG or JPEG image, got 15 bytes that do not "
                          "decode"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_requests_get_a_4xx_naming_the_problem_and_the_server_goes_on(server, case):
    status, reason = BAD[case](server)
    want_status, want_reason = EXPECTED[case]
    assert (status, reason[:len(want_reason)]) == (want_status, want_reason), reason
    assert "\n" not in reason
    # ... and the server still scores a good request.
    scores = _client(server.url)(IMAGES[:2], PROMPTS[:2], [{}] * 2)
    assert np.array_equal(scores, jpeg_compressibility(IMAGES[:2], PROMPTS[:2]))


def test_a_client_that_hangs_up_mid_body_gets_no_answer_and_the_server_goes_on(server):
    """A truncated body whose client stops sending (half-closes its socket) cannot be
    answered: the event loop's stream closes on the end of input. The server drops the
    connection and serves the next request."""
    assert _raw_bytes(server.port, _headers(server.port, 1000), _good_json()[:10]) == b""
    scores = _client(server.url)(IMAGES[:2], PROMPTS[:2], [{}] * 2)
    assert np.array_equal(scores, jpeg_compressibility(IMAGES[:2], PROMPTS[:2]))


@pytest.mark.parametrize("reward, reason", [
    ("faulty_raises", "ConnectionError: reward server refused the request"),
    ("faulty_wrong_shape", "ValueError: returned shape (3,), expected (2,)"),
])
def test_a_reward_that_fails_is_a_500_naming_it_and_the_server_goes_on(reward, reason):
    s = Server(reward, "--import", "faulty_rewards")
    try:
        client = RemoteReward("served", s.url, retries=1, backoff=0.0, timeout=10.0)
        with pytest.raises(RemoteRewardError) as e:
            client(IMAGES[:2], ["a broken window", "a calm lake"], [{}] * 2)
        assert str(e.value) == (f"reward server {s.url} gave no answer after 2 attempts "
                                f"(last: HTTP 500: reward {reward!r} raised {reason})")
        good = client(IMAGES[:2], PROMPTS[:2], [{}] * 2)
        stats = s.stats(token=None)
    finally:
        s.kill()
    assert np.array_equal(good, brightness(IMAGES[:2], PROMPTS[:2]))
    assert (stats["requests"], stats["images"], stats["forward_passes"]) == (1, 2, 3)


def test_a_refused_request_is_not_retried(server):
    before = server.stats()
    client = _client(server.url, token="guess", retries=5, backoff=60.0)
    with pytest.raises(RemoteRewardError, match=rf"reward server {server.url} refused the "
                                                r"request: HTTP 401: wrong bearer token"):
        client(IMAGES, PROMPTS, [{}] * 5)
    assert server.stats()["requests"] == before["requests"]


# ------------------------------------------------------------- servers that fail


def test_a_server_that_comes_back_is_retried(caplog):
    s = Server("jpeg_compressibility")
    port, url = s.port, s.url
    s.kill()
    result: dict = {}
    client = RemoteReward("served", url, retries=30, backoff=0.05, timeout=10.0)
    thread = threading.Thread(target=lambda: result.update(
        scores=client(IMAGES, PROMPTS, [{}] * 5)))
    with caplog.at_level(logging.WARNING, logger="digenrl"):
        thread.start()
        try:
            # Poll until the client has failed once, then bring the server back.
            while thread.is_alive() and not any("attempt 2 of 31" in r.getMessage()
                                                for r in caplog.records):
                thread.join(0.05)
            again = Server("jpeg_compressibility", "--port", str(port))
            try:
                thread.join(60)
            finally:
                again.kill()
        finally:
            thread.join(60)
    assert np.array_equal(result["scores"], jpeg_compressibility(IMAGES, PROMPTS))
    first = next(r.getMessage() for r in caplog.records if "attempt 2" in r.getMessage())
    assert first.startswith(f"reward 'served': {url}: ConnectionRefusedError"), first


def _dead(**kw) -> dict:
    return {"served": RemoteRewardConfig(url=f"http://127.0.0.1:{_free_port()}/", retries=1,
                                         backoff=0.0, **kw)}


@pytest.mark.parametrize("on_error", ["raise", "drop"])
def test_a_server_that_stays_down_stops_or_drops(on_error):
    remote = _dead()
    url = remote["served"].url
    rewards = resolve_rewards({"served": 1.0, "brightness": 0.5}, remote)
    message = (f"reward 'served' raised RemoteRewardError: reward server {url} gave no "
               f"answer after 2 attempts (last: ConnectionRefusedError")
    if on_error == "raise":
        with pytest.raises(RewardError) as e:
            evaluate_rewards(IMAGES, PROMPTS, range(5), rewards, on_error, iteration=7)
        assert str(e.value).startswith(message), str(e.value)
        assert str(e.value).endswith("for samples [0, 1, 2, 3, 4] of iteration 7")
        return
    total, per, valid, problems = evaluate_rewards(IMAGES, PROMPTS, range(5), rewards,
                                                   on_error, iteration=7)
    assert not valid.any() and np.isnan(total).all() and np.isnan(per["served"]).all()
    assert len(problems) == 1 and problems[0].startswith(message), problems


def test_a_request_that_times_out_is_retried_then_given_up():
    with socket.socket() as listener:  # accepts connections, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/"
        client = RemoteReward("served", url, timeout=0.2, retries=1, backoff=0.0)
        with pytest.raises(RemoteRewardError, match=rf"reward server {url} gave no answer "
                                                    r"after 2 attempts \(last: .*timed out"):
            client(IMAGES[:1], PROMPTS[:1], [{}])


def test_a_server_killed_mid_run_stops_it_naming_reward_and_url(cluster_1x1, tmp_path):
    s = Server("jpeg_compressibility")
    out = tmp_path / "killed.zarr"
    cfg = small_config(**{"iterations": 4, "reward.components": {"served": 1.0},
                          "reward.remote": {"served": {"url": s.url, "retries": 1,
                                                       "backoff": 0.0}}})
    try:
        with pytest.raises(RewardError) as e:
            Runner(cfg, str(out), cluster=cluster_1x1,
                   on_iteration=lambda summary: s.kill()).run()
    finally:
        s.kill()
    assert str(e.value).startswith(f"reward 'served' raised RemoteRewardError: reward server "
                                   f"{s.url} gave no answer after 2 attempts"), str(e.value)
    kept = committed_iterations(out)
    assert 1 <= kept < 4
    assert assert_complete(open_run(out)) == kept


# ------------------------------------------------------------------ configuration


@pytest.mark.parametrize("remote, message", [
    ({"served": {"url": "localhost:8000"}},
     "reward.remote.served.url: expected an http:// or https:// URL of a reward server, "
     "got 'localhost:8000'"),
    ({"served": {"url": "http://h/", "protocol": "xml"}},
     "reward.remote.served.protocol: expected one of ['json', 'msgpack', 'openai', "
     "'pickle'], got 'xml'"),
    ({"served": {"url": "http://h/", "retries": -1}},
     "reward.remote.served.retries: expected an integer >= 0, got -1"),
    ({"served": {"url": "http://h/", "batch": 4}},
     "reward.remote.served.batch: unknown field"),
    ({"served": {"url": "http://h/", "token_env": "A-B"}},
     "reward.remote.served.token_env: expected the name of an environment variable"),
    ({"brightness": {"url": "http://h/"}},
     "reward.remote.brightness: expected a name that is not a registered reward's"),
    ({"a/b": {"url": "http://h/"}},
     "reward.remote.a/b: expected a name of letters, digits, '_', '-' and '.', got 'a/b'"),
])
def test_remote_settings_are_checked_naming_the_field(remote, message):
    with pytest.raises(ConfigError) as e:
        checked_config(**{"reward.remote": remote, "reward.components": {"brightness": 1.0}})
    assert str(e.value).startswith(message), str(e.value)


def test_an_unset_token_variable_stops_the_run_before_it_starts(monkeypatch):
    from digenrl.run.runner import RLWorkload

    monkeypatch.delenv("NO_SUCH_TOKEN", raising=False)
    cfg = small_config(**{"reward.components": {"served": 1.0},
                          "reward.remote": {"served": {"url": "http://h/",
                                                       "token_env": "NO_SUCH_TOKEN"}}})
    with pytest.raises(ConfigError, match=r"^reward.remote.served.token_env: expected a set "
                                          r"environment variable .* got 'NO_SUCH_TOKEN'"):
        RLWorkload(cfg)


def test_a_remote_reward_takes_no_gpu_slot():
    from digenrl.graph.build import GraphContext

    cfg = small_config(**{"reward.components": {"served": 1.0},
                          "reward.remote": {"served": {"url": "http://h/"}}})
    ctx = GraphContext.from_config(cfg)
    assert ctx.layout.reward_gpu is False
    (spec, weight), = ctx.rewards
    assert (spec.name, spec.device, spec.takes_metadata, weight) == ("served", "wait", True, 1.0)
    assert TOKEN not in repr(spec)


@pytest.mark.parametrize("argv, message", [
    (["nosuch"], "reward: expected one of ["),
    (["brightness", "--import", "no_such_module"],
     "--import: expected an importable module, got 'no_such_module'"),
    (["brightness", "--port", "70000"], "--port: expected 0 to 65535, got 70000"),
    (["brightness", "--max-bytes", "0"],
     "--max-bytes: expected a positive number of bytes, got 0"),
    (["brightness", "--batch-size", "0"], "--batch-size: expected an integer >= 1, got 0"),
    (["brightness", "--max-queue", "0"], "--max-queue: expected an integer >= 1, got 0"),
    (["brightness", "--backlog", "-1"], "--backlog: expected an integer >= 1, got -1"),
    (["brightness", "--max-wait-ms", "-1"],
     "--max-wait-ms: expected a finite number >= 0, got -1.0"),
    (["brightness", "--read-timeout", "0"],
     "--read-timeout: expected a finite number > 0, got 0.0"),
])
def test_reward_server_arguments_are_checked(capsys, argv, message):
    from digenrl.commands.cli import main

    assert main(["reward-server", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"digenrl reward-server: error: {message}"), err
    assert err.count("\n") == 1

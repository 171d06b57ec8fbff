"""``digenrl reward-server``: any registered reward, served over HTTP.

Speaks the protocol of :mod:`digenrl.tasks.remote` (the one the client uses): ``POST``
any path with ``{"images", "prompts", "metadata"}``, answered ``{"scores": [...]}``.
``GET`` answers ``{"reward", "requests", "images"}`` (what it serves and has scored),
which is also how to see that it is up; for a model reward (``reward.models`` of the
config given with ``--config``) also ``model_loads``, how many times the server loaded the
model (once, at start).

Safe by default: it binds 127.0.0.1 unless told otherwise, reads JSON and MessagePack
(which run no code when parsed) and a pickle only when started with ``--allow-pickle``,
checks a bearer token when one is set, and reads at most ``max_bytes`` of a request.
Every request it cannot serve -- oversized, truncated, malformed, unauthorised, pickled
without ``--allow-pickle``, images that do not decode -- gets a 4xx and a one-line
reason, and the server goes on serving; a reward that raises is a 500 naming it. Requests are scored one at a time (a reward's model need not
be thread-safe); reading and decoding them run in parallel.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from digenrl.tasks.remote import ProtocolError, decode_request, encode_response
from digenrl.tasks.rewards import RewardSpec

__all__ = ["RewardServer", "TOKEN_ENV", "DEFAULT_MAX_BYTES"]

logger = logging.getLogger("digenrl")

#: The environment variable the bearer token is read from when --token is not given.
TOKEN_ENV = "DIGENRL_REWARD_TOKEN"
#: The largest request body read by default (64 MiB: a few hundred 512-pixel PNGs).
DEFAULT_MAX_BYTES = 64 * 2 ** 20
#: Seconds a connection may stall before its request is given up (a truncated body).
READ_TIMEOUT = 30.0


class RewardServer(ThreadingHTTPServer):
    """Serves ``spec`` at ``(host, port)`` (port 0 picks a free one: see :attr:`url`)."""

    daemon_threads = True

    def __init__(self, spec: RewardSpec, host: str = "127.0.0.1", port: int = 0, *,
                 token: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                 allow_pickle: bool = False, read_timeout: float = READ_TIMEOUT):
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)
        self.spec = spec
        self.token = token
        self.max_bytes = max_bytes
        self.allow_pickle = allow_pickle
        self.read_timeout = read_timeout
        self.requests = 0
        self.images = 0
        self._score_lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}/"

    def score(self, images: np.ndarray, prompts: list[str],
              metadata: list[dict[str, Any]]) -> list[float]:
        spec = self.spec
        with self._score_lock:
            values = spec(images, prompts, metadata)
            arr = np.asarray(values, dtype=np.float64)
            if arr.shape != (len(images),):
                raise ValueError(f"returned shape {arr.shape}, expected ({len(images)},)")
            self.requests += 1
            self.images += len(images)
        return [float(v) for v in arr]


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        self.timeout = self.server.read_timeout
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    def _answer(self, status: int, answer: dict[str, Any], protocol: str = "json") -> None:
        body, ctype = encode_response(protocol, answer)
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        if status >= 400:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def _refuse(self, status: int, reason: str, protocol: str = "json") -> None:
        logger.info("refused a request from %s: %d %s", self.address_string(), status, reason)
        self._answer(status, {"error": reason}, protocol)

    def do_GET(self) -> None:
        if not self._authorised():
            return
        s = self.server
        answer = {"reward": s.spec.name, "requests": s.requests, "images": s.images}
        loads = getattr(s.spec.fn, "loads", None)  # a model reward's
        if loads is not None:
            answer["model_loads"] = loads
        self._answer(200, answer)

    def _authorised(self) -> bool:
        token = self.server.token
        if token is None:
            return True
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return True
        self._refuse(401, "missing bearer token (Authorization: Bearer ...)" if not given
                     else "wrong bearer token")
        return False

    def do_POST(self) -> None:
        if not self._authorised():
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._refuse(411, f"expected a Content-Length header with the body's size in "
                              f"bytes, got {length!r}")
            return
        size, limit = int(length), self.server.max_bytes
        if size > limit:
            self._refuse(413, f"expected a body of at most {limit} bytes (--max-bytes), "
                              f"got Content-Length {size}")
            return
        try:
            body = self.rfile.read(size)
        except (TimeoutError, socket.timeout):
            body = b""
        if len(body) < size:
            self._refuse(400, f"truncated body: expected {size} bytes (Content-Length), "
                              f"got {len(body)}")
            return
        try:
            protocol, images, prompts, metadata = decode_request(
                body, self.headers.get("Content-Type"), allow_pickle=self.server.allow_pickle)
        except ProtocolError as e:
            self._refuse(e.status, str(e))
            return
        try:
            scores = self.server.score(images, prompts, metadata)
        except Exception as e:  # the reward's own failure: the server's fault, not the request's
            reason = " ".join(f"{type(e).__name__}: {e}".split())
            self._refuse(500, f"reward {self.server.spec.name!r} raised {reason}", protocol)
            return
        self._answer(200, {"scores": scores}, protocol)


def serve(spec: RewardSpec, host: str, port: int, *, token: str | None, max_bytes: int,
          allow_pickle: bool, announce=print) -> None:
    """Serve until interrupted, announcing the URL first (one line, flushed)."""
    server = RewardServer(spec, host, port, token=token, max_bytes=max_bytes,
                          allow_pickle=allow_pickle)
    with server:
        announce(f"digenrl reward-server: serving reward {spec.name!r} at {server.url}"
                 + (" (pickle allowed)" if allow_pickle else "")
                 + (" (bearer token required)" if token else ""))
        server.serve_forever()

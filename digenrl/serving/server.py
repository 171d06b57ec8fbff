"""``digenrl reward-server``: any registered reward, served over HTTP (Tornado).

Speaks the protocol of :mod:`digenrl.serving.remote` (the one the client uses): ``POST``
any path with ``{"images", "prompts", "metadata"}``, answered ``{"scores": [...]}``.
``GET`` answers what it serves and has done, which is also how to see that it is up:
``reward``; ``requests`` and ``images`` scored; ``forward_passes``, the batches it scored
them in; ``queued``, the images waiting now; ``answered_429``, the requests it turned away
as too busy; and for a model reward (``reward.models`` of the config given with
``--config``) ``model_loads``, how many times the server loaded the model (once, at start).

Safe by default: it binds 127.0.0.1 unless told otherwise, reads JSON and MessagePack
(which run no code when parsed) and a pickle only when started with ``--allow-pickle``,
checks a bearer token when one is set, and reads at most ``max_bytes`` of a request.
Every request it cannot serve -- oversized, truncated, malformed, unauthorised, pickled
without ``--allow-pickle``, images that do not decode -- gets a 4xx and a one-line
reason, and the server goes on serving; a reward that raises is a 500 naming it.

Under load: Tornado's event loop holds every connection (kept alive between requests)
and the listen backlog is ``backlog`` (1024 by default; http.server's 5 resets
connections when dozens of clients connect at once). Request bodies are decoded in a
thread pool. Concurrent requests are gathered into passes of ``batch_size`` images (a
model reward's own ``batch_size``), a request waiting at most ``max_wait`` seconds for
others to fill its pass; a request larger than a pass is spread over several. Passes are
scored one at a time on one thread, off the event loop (a reward's model need not be
thread-safe). A model reward pads every forward pass to its ``batch_size``, so a served
score has the same bits whatever requests shared its pass. A reward that raises fails
every request in that pass (the client retries a 500). When the queue would hold more
than ``max_queue`` images the request is answered 429 with a ``Retry-After`` header
(seconds) instead of queued; a request that arrives to an empty queue is always taken.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hmac
import logging
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tornado.http1connection import HTTP1Connection
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets
from tornado.web import Application, RequestHandler, stream_request_body

from digenrl.checks import finite, positive_int, require
from digenrl.serving.remote import ProtocolError, decode_request, encode_response
from digenrl.tasks.rewards import RewardSpec

__all__ = ["RewardServer", "Batcher", "serve", "serve_options", "TOKEN_ENV", "DEFAULT_MAX_BYTES",
           "READ_TIMEOUT", "DEFAULT_BATCH_SIZE", "DEFAULT_MAX_WAIT_MS", "DEFAULT_MAX_QUEUE",
           "DEFAULT_BACKLOG"]

logger = logging.getLogger("digenrl")

#: The environment variable the bearer token is read from when --token is not given.
TOKEN_ENV = "DIGENRL_REWARD_TOKEN"
#: The largest request body read by default (64 MiB: a few hundred 512-pixel PNGs).
DEFAULT_MAX_BYTES = 64 * 2 ** 20
#: Seconds a request's body may stall before it is given up (answered 400 as truncated).
READ_TIMEOUT = 30.0
#: Seconds a kept-alive connection may stay idle (or take to send its headers).
IDLE_TIMEOUT = 300.0
#: The key of the status answer (``GET``) naming the reward served.
SERVED_KEY = "reward"
#: Images per pass for a registered reward (a model reward uses its own batch_size).
DEFAULT_BATCH_SIZE = 32
#: How long a request waits for others to fill its pass, in milliseconds.
DEFAULT_MAX_WAIT_MS = 5.0
#: The most images waiting before requests are answered 429.
DEFAULT_MAX_QUEUE = 1024
#: Connections the kernel queues before the server accepts them.
DEFAULT_BACKLOG = 1024
#: Threads decoding request bodies (PNG decoding releases the GIL).
DECODE_THREADS = 4


class RewardServer:
    """Serves ``spec``: its Tornado application and counters. :meth:`listen` (on the
    event loop's thread) opens the sockets; :attr:`url` is where it listens."""

    def __init__(self, spec: RewardSpec, *, token: str | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES, allow_pickle: bool = False,
                 read_timeout: float = READ_TIMEOUT, batch_size: int = DEFAULT_BATCH_SIZE,
                 max_wait: float = DEFAULT_MAX_WAIT_MS / 1000,
                 max_queue: int = DEFAULT_MAX_QUEUE):
        self.spec = spec
        self.token = token
        self.max_bytes = max_bytes
        self.allow_pickle = allow_pickle
        self.read_timeout = read_timeout
        self.batcher = Batcher(spec, batch_size, max_wait, max_queue)
        self.decoders = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="digenrl-decode")
        self.requests = 0
        self.answered_429 = 0
        self.url: str | None = None
        self._http: HTTPServer | None = None

    def application(self) -> Application:
        return Application([(r"/.*", _Handler, {"server": self})],
                           log_function=_log_request)

    def listen(self, host: str = "127.0.0.1", port: int = 0,
               backlog: int = DEFAULT_BACKLOG) -> str:
        """Listen at ``(host, port)`` (port 0: a free one) with a queue of ``backlog``
        connections; returns the URL."""
        sockets = bind_sockets(port, address=host, backlog=backlog)
        # Bodies are limited per request (a 413 naming --max-bytes), never by Tornado
        # (whose own limit answers a bare 400); stalled bodies likewise (a 400 naming the
        # truncation), never by Tornado's body timeout (which closes without an answer).
        self._http = HTTPServer(self.application(), max_body_size=sys.maxsize,
                                idle_connection_timeout=IDLE_TIMEOUT)
        self._http.add_sockets(sockets)
        bound, bound_port = sockets[0].getsockname()[:2]
        self.url = f"http://{f'[{bound}]' if ':' in bound else bound}:{bound_port}/"
        return self.url

    def stats(self) -> dict[str, Any]:
        b = self.batcher
        answer = {SERVED_KEY: self.spec.name, "requests": self.requests, "images": b.images,
                  "forward_passes": b.passes, "queued": b.queued,
                  "answered_429": self.answered_429}
        loads = getattr(self.spec.fn, "loads", None)  # a model reward's
        if loads is not None:
            answer["model_loads"] = loads
        return answer

    async def close(self) -> None:
        if self._http is not None:
            self._http.stop()
            await self._http.close_all_connections()
        self.decoders.shutdown(wait=False, cancel_futures=True)
        self.batcher.close()


def _log_request(handler: RequestHandler) -> None:
    """Tornado's access log, as debug lines of digenrl's log (refusals are logged as info
    with their reason)."""
    r = handler.request
    logger.debug("%s %s %s %d", r.remote_ip, r.method, r.uri, handler.get_status())


# ------------------------------------------------------------------------ batching


@dataclass(eq=False)
class _Waiting:
    """A request in the queue: its rows, where its next pass starts, its scores so far."""

    images: np.ndarray
    prompts: list[str]
    metadata: list[dict[str, Any]]
    future: asyncio.Future
    arrived: float
    taken: int = 0  # rows handed to passes
    scored: int = 0  # rows whose scores came back
    scores: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.scores = np.empty(len(self.images), dtype=np.float64)


class Batcher:
    """Gathers queued requests into passes of at most ``batch_size`` images of one size,
    scores one pass at a time on its own thread, and resolves each request's future
    with its scores once all its rows are scored. Runs on the event loop's thread."""

    def __init__(self, spec: RewardSpec, batch_size: int, max_wait: float, max_queue: int):
        self.spec = spec
        self.batch_size = batch_size
        self.max_wait = max_wait
        self.max_queue = max_queue
        self.queued = 0  # images waiting for a pass
        self.images = 0  # images scored
        self.passes = 0
        self._queue: collections.deque[_Waiting] = collections.deque()
        self._scorer = ThreadPoolExecutor(1, thread_name_prefix="digenrl-score")
        self._scoring = False
        self._timer: asyncio.TimerHandle | None = None
        self._pass_seconds = 0.0  # a running mean, for Retry-After

    def full(self, n: int) -> bool:
        """Whether ``n`` more images would take the queue past ``max_queue`` (an empty
        queue takes any request)."""
        return self.queued > 0 and self.queued + n > self.max_queue

    def retry_after(self) -> int:
        """Whole seconds until the queue has likely drained (at least 1)."""
        passes = math.ceil(self.queued / self.batch_size) + 1
        return max(1, math.ceil(passes * self._pass_seconds))

    def submit(self, images: np.ndarray, prompts: list[str],
               metadata: list[dict[str, Any]]) -> asyncio.Future:
        """Queue a request; its future gets the float64 scores (or the reward's
        exception)."""
        loop = asyncio.get_running_loop()
        waiting = _Waiting(images, prompts, metadata, loop.create_future(), loop.time())
        self._queue.append(waiting)
        self.queued += len(images)
        self._schedule()
        return waiting.future

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._scorer.shutdown(wait=False, cancel_futures=True)

    def _schedule(self) -> None:
        """Start a pass when one is full or its oldest request has waited long enough;
        else wake up when it will have."""
        if self._scoring or not self._queue:
            return
        loop = asyncio.get_running_loop()
        wait = self._queue[0].arrived + self.max_wait - loop.time()
        if self.queued >= self.batch_size or wait <= 0:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._scoring = True
            loop.create_task(self._run_pass())
        elif self._timer is None:
            self._timer = loop.call_later(wait, self._wake)

    def _wake(self) -> None:
        self._timer = None
        self._schedule()

    def _take(self) -> list[tuple[_Waiting, int, int]]:
        """Up to ``batch_size`` rows from the front of the queue, all of the front
        request's image size: ``(request, first row, end row)`` each."""
        parts: list[tuple[_Waiting, int, int]] = []
        shape = self._queue[0].images.shape[1:]
        room = self.batch_size
        for w in list(self._queue):
            if room == 0:
                break
            if w.images.shape[1:] != shape:
                continue
            n = min(room, len(w.images) - w.taken)
            parts.append((w, w.taken, w.taken + n))
            w.taken += n
            room -= n
            self.queued -= n
            if w.taken == len(w.images):
                self._queue.remove(w)
        return parts

    async def _run_pass(self) -> None:
        parts = self._take()
        images = np.concatenate([w.images[a:b] for w, a, b in parts])
        prompts = [p for w, a, b in parts for p in w.prompts[a:b]]
        metadata = [m for w, a, b in parts for m in w.metadata[a:b]]
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            values = await loop.run_in_executor(self._scorer, self._score, images, prompts,
                                                metadata)
        except Exception as e:  # the reward's failure: every request of the pass gets it
            for w, _, _ in parts:
                if not w.future.done():
                    w.future.set_exception(e)
                if w in self._queue:  # the rest of it would fail too
                    self._queue.remove(w)
                    self.queued -= len(w.images) - w.taken
        else:
            self.images += len(images)
            row = 0
            for w, a, b in parts:
                w.scores[a:b] = values[row:row + b - a]
                row += b - a
                w.scored += b - a
                if w.scored == len(w.images) and not w.future.done():
                    w.future.set_result(w.scores)
        finally:
            self.passes += 1
            seconds = loop.time() - start
            self._pass_seconds = (seconds if self.passes == 1
                                  else 0.8 * self._pass_seconds + 0.2 * seconds)
            self._scoring = False
            self._schedule()

    def _score(self, images: np.ndarray, prompts: list[str],
               metadata: list[dict[str, Any]]) -> np.ndarray:
        values = np.asarray(self.spec(images, prompts, metadata), dtype=np.float64)
        if values.shape != (len(images),):
            raise ValueError(f"returned shape {values.shape}, expected ({len(images)},)")
        return values


# ------------------------------------------------------------------------ requests


@stream_request_body
class _Handler(RequestHandler):
    """One request: its headers are checked before its body is read (a refusal that
    cannot wait for the body closes the connection); the body is gathered in chunks
    and, once complete, decoded in the thread pool and queued for scoring."""

    server: RewardServer

    def initialize(self, server: RewardServer) -> None:
        self.server = server
        self._chunks: list[bytes] = []
        self._received = 0
        self._size = 0
        self._refusal: tuple[int, str] | None = None  # answered once the body is read
        self._stall: asyncio.TimerHandle | None = None

    # -- answers

    def _answer(self, status: int, answer: dict[str, Any],
                protocol: str = "json") -> asyncio.Future:
        """Send the answer; the future is done once it is written."""
        body, ctype = encode_response(protocol, answer)
        self.set_status(status)
        self.set_header("Content-Type", ctype)
        return self.finish(body)

    def _refuse(self, status: int, reason: str, protocol: str = "json") -> asyncio.Future:
        logger.info("refused a request from %s: %d %s", self.request.remote_ip, status,
                    reason)
        return self._answer(status, {"error": reason}, protocol)

    async def _refuse_unread(self, status: int, reason: str) -> None:
        """Refuse before the body is read, then close the connection (the only way not
        to read the body)."""
        self.set_header("Connection", "close")
        await self._refuse(status, reason)
        connection = self.request.connection
        assert isinstance(connection, HTTP1Connection)  # (the HTTPServer's)
        connection.close()

    def _unauthorised(self) -> str | None:
        token = self.server.token
        if token is None:
            return None
        given = self.request.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return None
        return ("missing bearer token (Authorization: Bearer ...)" if not given
                else "wrong bearer token")

    # -- GET

    def get(self) -> None:
        reason = self._unauthorised()
        if reason is not None:
            self._refuse(401, reason)
            return
        self._answer(200, self.server.stats())

    # -- POST

    async def prepare(self) -> None:
        if self.request.method != "POST":
            return
        length = self.request.headers.get("Content-Length")
        if length is None or not length.isdigit():
            await self._refuse_unread(411, f"expected a Content-Length header with the "
                                           f"body's size in bytes, got {length!r}")
            return
        self._size, limit = int(length), self.server.max_bytes
        if self._size > limit:
            await self._refuse_unread(413, f"expected a body of at most {limit} bytes "
                                           f"(--max-bytes), got Content-Length {self._size}")
            return
        reason = self._unauthorised()
        if reason is not None:  # answered after the body (discarded), keeping the connection
            self._refusal = (401, reason)
        self._arm_stall_timer()

    def data_received(self, chunk: bytes) -> None:
        self._received += len(chunk)
        if self._refusal is None:
            self._chunks.append(chunk)
        self._arm_stall_timer()

    def _arm_stall_timer(self) -> None:
        loop = asyncio.get_running_loop()
        if self._stall is not None:
            self._stall.cancel()
        self._stall = loop.call_later(self.server.read_timeout, self._stalled)

    def _stalled(self) -> None:
        self._stall = None
        if self._finished or self._received >= self._size:
            return
        self.set_header("Connection", "close")
        self._refuse(400, f"truncated body: expected {self._size} bytes (Content-Length), "
                          f"got {self._received} (then nothing for "
                          f"{self.server.read_timeout:g} s)")

    def on_connection_close(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
        super().on_connection_close()

    async def post(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        if self._refusal is not None:
            self._refuse(*self._refusal)
            return
        server = self.server
        body, self._chunks = b"".join(self._chunks), []
        decode = functools.partial(decode_request, body, self.request.headers.get(
            "Content-Type"), allow_pickle=server.allow_pickle)
        try:
            protocol, images, prompts, metadata = await asyncio.get_running_loop(
                ).run_in_executor(server.decoders, decode)
        except ProtocolError as e:
            self._refuse(e.status, str(e))
            return
        batcher = server.batcher
        if batcher.full(len(images)):
            server.answered_429 += 1
            wait = batcher.retry_after()
            logger.debug("answered 429 to %s: %d images queued (--max-queue %d); retry "
                         "after %d s", self.request.remote_ip, batcher.queued,
                         batcher.max_queue, wait)
            self.set_header("Retry-After", str(wait))
            self._answer(429, {"error": f"busy: {batcher.queued} images queued, at most "
                                        f"{batcher.max_queue} (--max-queue); retry after "
                                        f"{wait} s"}, protocol)
            return
        try:
            scores = await batcher.submit(images, prompts, metadata)
        except Exception as e:  # the reward's own failure: the server's fault, not the request's
            reason = " ".join(f"{type(e).__name__}: {e}".split())
            self._refuse(500, f"reward {server.spec.name!r} raised {reason}", protocol)
            return
        server.requests += 1
        self._answer(200, {"scores": [float(v) for v in scores]}, protocol)


def serve_options(spec: RewardSpec, *, port: int, max_bytes: int | None,
                  batch_size: int | None, max_queue: int | None, backlog: int | None,
                  max_wait_ms: float | None, read_timeout: float | None,
                  token: str | None) -> dict[str, Any]:
    """The keywords of :func:`serve` from the command line's flags (None: the flag's
    default), each checked in one line naming its flag before anything is served. A
    model reward's passes are its configured ``batch_size``: ``--batch-size`` may only
    repeat it."""
    require(0 <= port <= 65535, "--port", "0 to 65535", port)
    max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    require(max_bytes >= 1, "--max-bytes", "a positive number of bytes", max_bytes)
    model_batch = getattr(spec.fn, "batch_size", None)  # a model reward's forward pass
    require(model_batch is None or batch_size in (None, model_batch), "--batch-size",
            f"none (or {model_batch}) for the model reward {spec.name!r}, whose passes "
            f"are its reward.models.{spec.name}.batch_size {model_batch}", batch_size)
    batch_size = model_batch or (DEFAULT_BATCH_SIZE if batch_size is None else batch_size)
    for flag, value in (("--batch-size", batch_size), ("--max-queue", max_queue),
                        ("--backlog", backlog)):
        if value is not None:
            positive_int(value, flag)
    if max_wait_ms is not None:
        finite(max_wait_ms, "--max-wait-ms", lo=0)
    if read_timeout is not None:
        finite(read_timeout, "--read-timeout", lo=0, lo_open=True)
    token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    require(token is None or token.strip(), "--token", "a non-empty token", token)
    options: dict[str, Any] = {"port": port, "max_bytes": max_bytes, "batch_size": batch_size,
                               "token": token}
    if max_wait_ms is not None:
        options["max_wait"] = max_wait_ms / 1000
    for name, value in (("max_queue", max_queue), ("backlog", backlog),
                        ("read_timeout", read_timeout)):
        if value is not None:
            options[name] = value
    return options


def serve(spec: RewardSpec, host: str, port: int, *, token: str | None, max_bytes: int,
          allow_pickle: bool, batch_size: int = DEFAULT_BATCH_SIZE,
          max_wait: float = DEFAULT_MAX_WAIT_MS / 1000, max_queue: int = DEFAULT_MAX_QUEUE,
          backlog: int = DEFAULT_BACKLOG, read_timeout: float = READ_TIMEOUT,
          announce=print) -> None:
    """Serve until interrupted, announcing the URL first (one line, flushed)."""

    async def main() -> None:
        server = RewardServer(spec, token=token, max_bytes=max_bytes,
                              allow_pickle=allow_pickle, read_timeout=read_timeout,
                              batch_size=batch_size, max_wait=max_wait, max_queue=max_queue)
        url = server.listen(host, port, backlog)
        announce(f"digenrl reward-server: serving reward {spec.name!r} at {url}"
                 + (" (pickle allowed)" if allow_pickle else "")
                 + (" (bearer token required)" if token else "")
                 + f" (passes of {batch_size} images)")
        try:
            await asyncio.Event().wait()
        finally:
            await server.close()

    asyncio.run(main())

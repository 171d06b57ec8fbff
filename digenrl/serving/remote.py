"""Rewards scored by a reward server over HTTP: the wire protocol and the client.

The convention is the one flow_grpo's reward servers and veRL-Omni's HTTP scorer share:
a ``POST`` carries ``{"images": [...], "prompts": [...], "metadata": [...]}`` (one entry
per image) and is answered ``{"scores": [...]}`` (one float per image) or, on failure,
``{"error": "one line"}`` with a 4xx or 5xx status.

Three wire formats, both sides of which live here (``digenrl reward-server`` and the client
use the same functions):

* ``json`` (the default): a JSON object whose images are base64 **PNG**. PNG is lossless,
  so the server scores exactly the pixels the run generated and a served reward equals
  the same reward computed in the run; JPEG would change them (and with them any pixel
  statistic). JSON parsing runs no code, whatever arrives.
* ``msgpack``: the same dict in MessagePack (``Content-Type: application/msgpack``), the
  PNGs as raw bytes: about a quarter smaller than base64 and no text to decode, and as
  safe to parse as JSON.
* ``pickle``: the pickled dict, for an existing flow_grpo-style server. Unpickling runs
  code chosen by whoever wrote the bytes, so it is an explicit opt-in on each side
  (``protocol: pickle`` on the client, ``--allow-pickle`` on the server), and even then
  only plain containers, strings, bytes and numbers are unpickled (no class or function
  is looked up). Images are PNG bytes here too (such servers open them with PIL, which
  reads PNG as well as JPEG).

The client (:class:`RemoteReward`) sends a reward task's images in requests of at most
``batch_size``, each with a timeout, through one urllib3 connection pool per process
(shared by every remote reward and judge, thread-safe; connections stay open between
requests). urllib3's retries repeat a request that gets no answer, a broken one, a 429
or a 5xx, waiting ``backoff`` seconds before the first retry and doubling (at most
:data:`MAX_BACKOFF`), or as long as a ``Retry-After`` header says; a 4xx answer is the
request's fault and is not retried. After the retries the failure is one line naming
the server's URL. It runs inside the reward task, on a worker thread (never the event
loop), and a remote reward is a ``cpu`` reward: the task holds no GPU slot while it
waits. ``protocol: openai`` asks a VLM judge instead (:mod:`digenrl.serving.judges`).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
import pickle
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import msgpack
import numpy as np
import urllib3
from PIL import Image

from digenrl.config import REMOTE_MAX_CONCURRENCY

__all__ = ["ProtocolError", "RemoteRewardError", "RemoteReward", "post",
           "encode_image", "decode_image", "encode_request", "decode_request",
           "encode_response", "decode_response", "JSON_TYPE", "MSGPACK_TYPES", "PICKLE_TYPE"]

logger = logging.getLogger("digenrl")

JSON_TYPE = "application/json"
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack")
PICKLE_TYPE = "application/octet-stream"
#: The longest wait between two attempts, in seconds (a longer Retry-After is cut to it).
MAX_BACKOFF = 30.0


class ProtocolError(ValueError):
    """A request or answer that does not follow the protocol; ``status`` is the HTTP
    status a server answers it with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class RemoteRewardError(RuntimeError):
    """A reward server gave no usable answer (after the retries)."""


# ------------------------------------------------------------------------ images


def encode_image(image: np.ndarray) -> bytes:
    """PNG bytes of one uint8 ``(height, width, 3)`` image."""
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def decode_image(data: bytes) -> np.ndarray:
    """The RGB pixels of a PNG, JPEG or any image PIL reads."""
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


# ------------------------------------------------------------------------ pickle


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, tuples, strings, bytes, numbers, booleans and None;
    refuses anything that names a class or a function."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: only plain "
                                     f"containers, strings, bytes and numbers are read")


def _unpickle(body: bytes) -> Any:
    return _PlainUnpickler(io.BytesIO(body)).load()


def _is_pickle(body: bytes) -> bool:
    return body[:1] == b"\x80"  # the PROTO opcode every pickle since protocol 2 starts with


# ----------------------------------------------------------------------- request


def encode_request(protocol: str, images: np.ndarray, prompts: Sequence[str],
                   metadata: Sequence[Mapping[str, Any]]) -> tuple[bytes, str]:
    """The body and content type of a request scoring ``images``."""
    pngs = [encode_image(img) for img in images]
    if protocol in ("pickle", "msgpack"):
        data = {"images": pngs, "prompts": list(prompts), "metadata": [dict(m) for m in metadata]}
        if protocol == "pickle":
            return pickle.dumps(data), PICKLE_TYPE
        return msgpack.packb(data), MSGPACK_TYPES[0]
    return json.dumps({"images": [base64.b64encode(p).decode("ascii") for p in pngs],
                       "prompts": list(prompts),
                       "metadata": [dict(m) for m in metadata]}).encode(), JSON_TYPE


def decode_request(body: bytes, content_type: str | None, *, allow_pickle: bool
                   ) -> tuple[str, np.ndarray, list[str], list[dict[str, Any]]]:
    """``(protocol, images, prompts, metadata)`` of a request body, or a
    :class:`ProtocolError` naming what is wrong."""
    ctype = (content_type or "").split(";")[0].strip().lower()
    if ctype in MSGPACK_TYPES:
        protocol = "msgpack"
        try:
            data = _unpack(body)
        except Exception as e:  # msgpack raises several kinds for bad input
            raise ProtocolError(f"expected a MessagePack map, got malformed MessagePack "
                                f"({type(e).__name__}: {e})") from None
    elif _is_pickle(body):  # never JSON, whatever the declared type
        protocol = "pickle"
        if not allow_pickle:
            raise ProtocolError("expected JSON or MessagePack, got a pickle (unpickling runs "
                                "code; start the server with --allow-pickle to accept "
                                "pickles)", 415)
        try:
            data = _unpickle(body)
        except Exception as e:  # a truncated or hostile pickle raises anything
            raise ProtocolError(f"expected a pickled dict, got an unreadable pickle "
                                f"({type(e).__name__}: {e})") from None
    elif ctype == JSON_TYPE or body.lstrip()[:1] == b"{":
        protocol = "json"
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise ProtocolError(f"expected a JSON object, got malformed JSON ({e})") from None
    else:
        raise ProtocolError(f"expected a JSON object (Content-Type {JSON_TYPE}) or "
                            f"MessagePack ({MSGPACK_TYPES[0]}), got "
                            f"{len(body)} bytes of {ctype or 'no declared type'} starting "
                            f"{body[:16]!r}", 415)
    if not isinstance(data, dict):
        raise ProtocolError(f"expected an object with images, prompts and metadata, got "
                            f"{type(data).__name__}")
    images = data.get("images")
    if not isinstance(images, list) or not images:
        raise ProtocolError(f"images: expected a non-empty list of encoded images, got "
                            f"{_brief(images)}")
    n = len(images)
    prompts = data.get("prompts")
    if not isinstance(prompts, list) or len(prompts) != n or not all(
            isinstance(p, str) for p in prompts):
        raise ProtocolError(f"prompts: expected a list of {n} strings (one per image), got "
                            f"{_brief(prompts)}")
    metadata = data.get("metadata")
    if metadata is None:
        metadata = [{} for _ in range(n)]
    if not isinstance(metadata, list) or len(metadata) != n or not all(
            isinstance(m, dict) for m in metadata):
        raise ProtocolError(f"metadata: expected a list of {n} objects (one per image), got "
                            f"{_brief(metadata)}")
    pixels = []
    for i, item in enumerate(images):
        if protocol == "json":  # the binary formats carry the bytes themselves
            if not isinstance(item, str):
                raise ProtocolError(f"images[{i}]: expected base64 text of a PNG or JPEG, "
                                    f"got {type(item).__name__}")
            try:
                item = base64.b64decode(item, validate=True)
            except (binascii.Error, ValueError):
                raise ProtocolError(f"images[{i}]: expected base64 text of a PNG or JPEG, "
                                    f"got text that is not base64") from None
        if not isinstance(item, bytes):
            raise ProtocolError(f"images[{i}]: expected the bytes of a PNG or JPEG, got "
                                f"{type(item).__name__}")
        try:
            pixels.append(decode_image(item))
        except Exception as e:  # PIL raises several kinds for a broken image
            raise ProtocolError(f"images[{i}]: expected a PNG or JPEG image, got "
                                f"{len(item)} bytes that do not decode "
                                f"({type(e).__name__})") from None
    if len({p.shape for p in pixels}) != 1:
        raise ProtocolError(f"images: expected images of one size, got sizes "
                            f"{sorted({p.shape[:2] for p in pixels})}")
    return protocol, np.stack(pixels), prompts, metadata


def _unpack(body: bytes) -> Any:
    return msgpack.unpackb(body, raw=False)


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------- response


def encode_response(protocol: str, answer: Mapping[str, Any]) -> tuple[bytes, str]:
    """The body and content type of an answer (``{"scores": [...]}`` or
    ``{"error": "..."}``) in the request's wire format."""
    if protocol == "pickle":
        return pickle.dumps(dict(answer)), PICKLE_TYPE
    if protocol == "msgpack":
        return msgpack.packb(dict(answer)), MSGPACK_TYPES[0]
    return json.dumps(dict(answer)).encode(), JSON_TYPE


def decode_response(protocol: str, body: bytes) -> dict[str, Any]:
    """An answer's dict; a :class:`ProtocolError` for one that is not in the format."""
    try:
        data = {"pickle": _unpickle, "msgpack": _unpack}.get(protocol, json.loads)(body)
    except Exception as e:
        raise ProtocolError(f"expected a {protocol} answer, got {len(body)} bytes that do "
                            f"not parse ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"expected an object with scores, got {type(data).__name__}")
    return data


# ------------------------------------------------------------------------ client


def _pool() -> urllib3.PoolManager:
    """This process's connection pool, shared by every remote reward and judge (urllib3
    pools are thread-safe): connections to a server are kept alive between requests."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = urllib3.PoolManager(num_pools=16, maxsize=POOL_CONNECTIONS)
        return _POOL


_POOL: urllib3.PoolManager | None = None
_POOL_LOCK = threading.Lock()
#: Connections kept alive per server (more are opened, then closed, when needed).
POOL_CONNECTIONS = REMOTE_MAX_CONCURRENCY


class _Retry(urllib3.util.Retry):
    """urllib3's retries with digenrl's schedule: ``backoff_factor`` seconds before the
    first retry, doubling with each further one up to ``backoff_max`` (urllib3's own
    first retry is immediate); a server's ``Retry-After`` (seconds, at most
    ``retry_after_max``) replaces the wait. Each retry is logged: the reward, the URL,
    what failed, and when the next attempt comes."""

    reward = ""

    def new(self, **kw: Any) -> "_Retry":
        retry = super().new(**kw)
        retry.reward = self.reward
        return retry

    def get_backoff_time(self) -> float:
        failed = len(self.history)
        if failed == 0:
            return 0.0
        return float(min(self.backoff_max, self.backoff_factor * 2 ** (failed - 1)))

    def increment(self, method=None, url=None, response=None, error=None, _pool=None,
                  _stacktrace=None) -> "_Retry":
        retry = super().increment(method, url, response, error, _pool, _stacktrace)
        wait = None  # as Retry.sleep: a positive Retry-After, else the backoff
        if response is not None and self.respect_retry_after_header:
            wait = retry.get_retry_after(response)
        if not wait:
            wait = retry.get_backoff_time()
        attempt = len(retry.history) + 1
        assert retry.total is not None     # (made with a number of retries)
        attempts = attempt + retry.total
        logger.warning("reward %r: %s: %s; attempt %d of %d in %.1f s", self.reward,
                       _full_url(_pool, url), _failure_text(response, error), attempt,
                       attempts, wait)
        return retry


def _full_url(pool: Any, path: str | None) -> str:
    if pool is None or path is None or "://" in path:
        return path or "?"
    return f"{pool.scheme}://{pool.host}:{pool.port}{path}"


def post(url: str, body: bytes, headers: Mapping[str, str], *, reward: str,
         timeout: float, retries: int, backoff: float, server: str = "reward server"
         ) -> urllib3.BaseHTTPResponse:
    """POST ``body`` to ``url`` through this process's pool, retrying what is worth
    retrying (no connection, a timeout, a broken answer, a 429 or 5xx); the 2xx answer,
    or a :class:`RemoteRewardError` in one line naming ``server`` and ``url``: a 4xx (or
    any other answer) at once, the last failure once the retries are spent."""
    retry = _Retry(total=retries, redirect=False, backoff_factor=backoff,
                   backoff_max=MAX_BACKOFF, retry_after_max=int(MAX_BACKOFF),
                   status_forcelist=RETRIED_STATUSES, allowed_methods=None,
                   respect_retry_after_header=True, raise_on_status=False)
    retry.reward = reward
    attempts = retries + 1
    given_up = (f"{server} {url} gave no answer after {attempts} "
                f"attempt{'s' if attempts != 1 else ''}")
    try:
        response = _pool().request("POST", url, body=body, headers=dict(headers),
                                   timeout=urllib3.Timeout(total=timeout), retries=retry)
    except urllib3.exceptions.MaxRetryError as e:
        raise RemoteRewardError(f"{given_up} (last: {_failure_text(None, e.reason)})"
                                ) from None
    except urllib3.exceptions.HTTPError as e:  # a failure urllib3 does not retry
        raise RemoteRewardError(f"{given_up} (last: {_failure_text(None, e)})") from None
    if 200 <= response.status < 300:
        return response
    reason = _failure_text(response, None)
    if response.status in RETRIED_STATUSES:
        raise RemoteRewardError(f"{given_up} (last: {reason})")
    raise RemoteRewardError(f"{server} {url} refused the request: {reason}")


#: Answers worth another attempt: busy (429) and the server's own failures.
RETRIED_STATUSES = (429, 500, 502, 503, 504)


def _failure_text(response: Any, error: BaseException | None) -> str:
    """What went wrong in one line: ``HTTP 500: the reason the answer gives``, or the
    underlying OS error (``ConnectionRefusedError: ...``) of a connection failure."""
    if response is not None:
        return f"HTTP {response.status}: " + _error_text(
            response.headers.get("Content-Type"), response.data or b"")
    e = error
    seen = set()
    while e is not None and id(e) not in seen:  # the OS error under urllib3's wrappers
        seen.add(id(e))
        if isinstance(e, OSError) and not isinstance(e, urllib3.exceptions.HTTPError):
            break
        inner = next((a for a in getattr(e, "args", ()) if isinstance(a, BaseException)),
                     None)
        e = e.__cause__ or inner or e.__context__
    e = e if e is not None else error
    return " ".join(f"{type(e).__name__}: {e}".split()) if str(e) else type(e).__name__


@dataclass(frozen=True)
class RemoteReward:
    """The function of a remote reward: scores a reward task's images on a server.

    Travels with the reward task to the worker (by value). The bearer token, read from
    the configured environment variable of the run's process, travels with it and is
    left out of its repr."""

    name: str
    url: str
    protocol: str = "json"
    timeout: float = 60.0
    retries: int = 3
    backoff: float = 1.0
    batch_size: int = 32
    token: str | None = field(default=None, repr=False)

    def __call__(self, images: np.ndarray, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any]]) -> np.ndarray:
        scores: list[float] = []
        for a in range(0, len(images), self.batch_size):
            b = a + self.batch_size
            scores += self._request(images[a:b], prompts[a:b], metadata[a:b])
        return np.asarray(scores, dtype=np.float64)

    def _request(self, images, prompts, metadata) -> list[float]:
        body, ctype = encode_request(self.protocol, images, prompts, metadata)
        headers = {"Content-Type": ctype}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        response = post(self.url, body, headers, reward=self.name, timeout=self.timeout,
                        retries=self.retries, backoff=self.backoff)
        try:
            data = decode_response(self.protocol, response.data)
        except ProtocolError as e:
            raise RemoteRewardError(f"reward server {self.url}: {e}") from None
        scores = data.get("scores")
        n = len(images)
        if not isinstance(scores, list) or len(scores) != n or not all(
                isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores):
            got = scores if "scores" in data else data
            raise RemoteRewardError(f"reward server {self.url}: expected scores, a list of "
                                    f"{n} numbers, got {_brief(got)}")
        return [float(s) for s in scores]


def _error_text(content_type: str | None, body: bytes) -> str:
    """The reason an error answer gives, in the format its Content-Type names (an
    OpenAI-style ``{"error": {"message": ...}}`` too)."""
    ctype = (content_type or "").split(";")[0].strip().lower()
    protocol = ("msgpack" if ctype in MSGPACK_TYPES else "pickle" if ctype == PICKLE_TYPE
                else "json")
    try:
        data = decode_response(protocol, body)
    except ProtocolError:
        text = body[:200].decode("utf-8", "replace")
        return " ".join(text.split()) or "no reason given"
    error = data.get("error", data.get("message", data))
    if isinstance(error, dict) and "message" in error:
        error = error["message"]
    return " ".join(str(error).split())



"""Stable seeds derived from the run seed and a task's identity.

Every random draw in a run comes from a generator seeded by :func:`stable_seed` of the
run seed and the identity of what is drawn (a sample and a timestep, an iteration's prompt
choice, ...), never from process state. A result recomputed on another worker, or in a
run that chunked the samples differently, draws exactly the same numbers.
"""

from __future__ import annotations

import hashlib
from typing import Hashable

__all__ = ["stable_seed"]


def stable_seed(*parts: Hashable) -> int:
    """A 63-bit seed from the repr of ``parts`` (stable across processes and runs)."""
    text = repr(tuple(parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1

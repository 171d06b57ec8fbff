"""Which samples an iteration generates and how they are chunked into tasks."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

__all__ = ["IterationPlan"]


@dataclass(frozen=True)
class IterationPlan:
    """Samples ``0 .. n-1`` of one iteration, group-major: sample ``s`` belongs to prompt
    group ``s // samples_per_prompt``. ``chunks`` are consecutive ``[start, stop)``
    sample ranges, one per denoise chain. ``metadata`` is each prompt's metadata for the
    rewards, as JSON text (empty for none), or empty when no prompt has any; ``inputs``
    each prompt's source images and negative prompt
    (:class:`~digenrl.prompts.PromptInputs`), or empty when no prompt has any.
    ``context_parallel`` is each chunk's context-parallel degree (how many rollout
    workers compute each of its denoise steps together), or empty when every chunk's is
    1."""

    iteration: int
    prompts: tuple[str, ...]
    samples_per_prompt: int
    chunks: tuple[tuple[int, int], ...]
    metadata: tuple[str, ...] = ()
    inputs: tuple = ()
    context_parallel: tuple[int, ...] = ()

    @classmethod
    def uniform(cls, iteration: int, prompts, samples_per_prompt: int,
                chunk_size: int, metadata=(), inputs=(), degree: int = 1) -> "IterationPlan":
        """Chunks of ``chunk_size`` samples, each computed at context-parallel
        ``degree``."""
        n = len(prompts) * samples_per_prompt
        if n % chunk_size:
            raise ValueError(f"chunk_size: expected a divisor of {n}, got {chunk_size}")
        chunks = tuple((s, s + chunk_size) for s in range(0, n, chunk_size))
        metadata = tuple(metadata) if any(metadata) else ()
        inputs = tuple(inputs) if any(inputs) else ()
        degrees = (degree,) * len(chunks) if degree > 1 else ()
        return cls(iteration, tuple(prompts), samples_per_prompt, chunks, metadata, inputs,
                   degrees)

    def __post_init__(self) -> None:
        for name in ("metadata", "inputs"):
            got = len(getattr(self, name))
            if got and got != len(self.prompts):
                raise ValueError(f"{name}: expected one entry per prompt "
                                 f"({len(self.prompts)}), got {got}")
        degrees = self.context_parallel
        if degrees and (len(degrees) != len(self.chunks) or min(degrees) < 1):
            raise ValueError(f"context_parallel: expected a degree >= 1 per chunk "
                             f"({len(self.chunks)}), got {degrees}")
        covered = [s for a, b in self.chunks for s in range(a, b)]
        if covered != list(range(self.num_samples)):
            raise ValueError(f"chunks: expected consecutive ranges covering 0..{self.num_samples - 1},"
                             f" got {self.chunks}")

    @property
    def num_samples(self) -> int:
        return len(self.prompts) * self.samples_per_prompt

    @property
    def num_groups(self) -> int:
        return len(self.prompts)

    def group_of(self, sample: int) -> int:
        return sample // self.samples_per_prompt

    def degree(self, chunk: int) -> int:
        """Chunk ``chunk``'s context-parallel degree."""
        return self.context_parallel[chunk] if self.context_parallel else 1

    def sample_ids(self, chunk: int) -> tuple[int, ...]:
        a, b = self.chunks[chunk]
        return tuple(range(a, b))

    def chunk_prompts(self, chunk: int) -> tuple[str, ...]:
        a, b = self.chunks[chunk]
        prompts, per = self.prompts, self.samples_per_prompt
        return tuple([prompts[s // per] for s in range(a, b)])

    def chunk_metadata(self, chunk: int) -> tuple[str, ...]:
        """Each sample's prompt metadata (JSON text), or () when no prompt has any."""
        if not self.metadata:
            return ()
        a, b = self.chunks[chunk]
        return tuple([self.metadata[s // self.samples_per_prompt] for s in range(a, b)])

    def chunk_inputs(self, chunk: int) -> tuple:
        """Each sample's prompt inputs (source images, negative prompt), or () when no
        prompt has any."""
        if not self.inputs:
            return ()
        a, b = self.chunks[chunk]
        return tuple([self.inputs[s // self.samples_per_prompt] for s in range(a, b)])

    def group_sample_ids(self, group: int) -> tuple[int, ...]:
        a = group * self.samples_per_prompt
        return tuple(range(a, a + self.samples_per_prompt))

    def groups_of_chunk(self, chunk: int) -> list[int]:
        # A chunk is a consecutive range of group-major samples: its groups are too.
        a, b = self.chunks[chunk]
        if b <= a:
            return []
        return list(range(a // self.samples_per_prompt, (b - 1) // self.samples_per_prompt + 1))

    def chunks_of_group(self, group: int) -> list[int]:
        """The chunks holding any sample of ``group`` (chunks are consecutive ranges)."""
        a = group * self.samples_per_prompt
        b = a + self.samples_per_prompt
        starts = [c[0] for c in self.chunks] if len(self.chunks) < 64 else self._starts()
        first = bisect.bisect_right(starts, a) - 1
        last = bisect.bisect_left(starts, b) - 1
        return list(range(first, last + 1))

    def _starts(self) -> list[int]:
        cache = self.__dict__.get("_chunk_starts")
        if cache is None:
            cache = [c[0] for c in self.chunks]
            object.__setattr__(self, "_chunk_starts", cache)
        return cache

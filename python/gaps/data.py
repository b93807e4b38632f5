"""Criteo-layout training data as numpy batches — the reader the built-in workers use.

Three ways to read it::

    from gaps.data import CriteoReader, held_out
    for batch in CriteoReader("train.tsv", part=rank, parts=world).batches(256, count=1000):
        ...                                   # a fixed share: lines numbered rank modulo world
    for split in client.splits("train.tsv"):  # dealt by the coordinator (dynamic sharding)
        for batch in split.batches(256): ...
    test = held_out("train.tsv", 10_000)      # the held-out lines (every 10th line of a file)

A batch is a :class:`gaps.CriteoBatch`: ``labels`` (n,) float32 0/1, ``ints`` (n, 13) float32
(log(1 + max(x, 0)) of the integer features), ``ids`` (n, 26) uint64 feature ids, ``MISSING`` where a field
is empty. ``data`` is a path (several files comma-separated) or ``"synthetic"`` (the seeded generator with a
planted teacher). Bad lines are skipped and counted, as the built-in workers do.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from . import CriteoBatch, Split, _batch, _gaps, _native, read_split

__all__ = ["CriteoBatch", "CriteoReader", "MISSING", "Split", "held_out", "read_split", "torch_batch"]

#: The id of a missing categorical field.
MISSING = np.uint64(2**64 - 1)


class CriteoReader:
    """Worker ``part`` of ``parts``' fixed share of ``data`` (file lines numbered ``part`` modulo ``parts``,
    held-out lines skipped), read in passes: a file is read again from its start when it ends; the
    synthetic generator never ends."""

    def __init__(self, data: str, *, part: int = 0, parts: int = 1, seed: int = 1):
        if parts < 1 or not 0 <= part < parts:
            raise ValueError(f"part must be in 0..parts (got part {part} of {parts})")
        self._stream = _native(_gaps.CriteoStream, data, seed, part, parts)

    def next_batch(self, n: int) -> CriteoBatch:
        """The next ``n`` samples."""
        if n < 1:
            raise ValueError(f"a batch holds at least 1 sample, not {n}")
        return _batch(_native(self._stream.next_batch, n))

    def batches(self, n: int, *, count: int | None = None) -> Iterator[CriteoBatch]:
        """``count`` batches of ``n`` samples (without end when ``count`` is None)."""
        i = 0
        while count is None or i < count:
            yield self.next_batch(n)
            i += 1


def held_out(data: str, n: int, *, seed: int = 1) -> CriteoBatch:
    """The first ``n`` held-out samples of ``data`` (every 10th line of a file; the synthetic generator's
    evaluation range), the same the built-in evaluation uses."""
    return _batch(_native(_gaps.held_out, data, seed, n))


def torch_batch(batch: CriteoBatch):
    """``(labels, ints, ids, present)`` as torch tensors: ids as int64 with 0 where a field is missing, and
    the boolean mask of present fields (multiply the embeddings by it)."""
    import torch

    present = batch.ids != MISSING
    ids = np.where(present, batch.ids, 0).astype(np.int64)
    return (
        torch.from_numpy(np.array(batch.labels)),
        torch.from_numpy(np.array(batch.ints)),
        torch.from_numpy(ids),
        torch.from_numpy(present),
    )

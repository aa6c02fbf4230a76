"""A tensor whose bytes lie in files (an offloaded optimizer's piece files, a checkpoint shard's record), copied file to
file through one small buffer: a checkpoint write or a resume of an offloaded optimizer moves its state without
holding it (runtime/step/offload.py, runtime/checkpoint/shardio.py)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

COPY_BYTES = 1 << 20  # the buffer a copy goes through


@dataclass(frozen=True)
class FileRange:
    """A contiguous tensor of `shape` and `dtype` whose bytes are the concatenation of `segments`
    ((file, offset, bytes), in order)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    segments: tuple[tuple[Path, int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(size for _, _, size in self.segments)

    def elements(self, start: int, stop: int) -> "FileRange":
        """Flattened elements [start, stop) as a 1-d FileRange."""
        size = self.dtype.itemsize
        first, last, at, out = start * size, stop * size, 0, []
        for path, offset, nbytes in self.segments:
            lo, hi = max(first, at), min(last, at + nbytes)
            if lo < hi:
                out.append((path, offset + lo - at, hi - lo))
            at += nbytes
        return FileRange((stop - start,), self.dtype, tuple(out))

    def copy_into(self, out: BinaryIO) -> int:
        """Write the bytes at `out`'s position; returns how many. A file shorter than recorded is an OSError."""
        buffer = memoryview(bytearray(min(COPY_BYTES, max(1, self.nbytes))))
        for path, offset, nbytes in self.segments:
            with open(path, "rb") as source:
                source.seek(offset)
                left = nbytes
                while left:
                    got = source.readinto(buffer[:min(left, len(buffer))])
                    if not got:
                        raise OSError(f"{path}: ended {left} bytes before the {nbytes} bytes at {offset} it should hold")
                    out.write(buffer[:got])
                    left -= got
        return self.nbytes

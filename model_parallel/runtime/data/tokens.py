"""A flat token file (nanoGPT's train.bin) as windows of token ids, read with `pread` from one open descriptor.

Not a memory map: a file truncated while the job ran (a `prepare.py` run again over it, `cp` onto it, a full disk
under a writer) turned the read of a page past its new end into SIGBUS, and the rank died with no message, hours
into a run. A `pread` past the end only returns fewer bytes. Before each read the descriptor's size and
modification time are compared with those seen at open (one `fstat`): a file rewritten in place, even to the same
size, would otherwise train later steps on other tokens than the run started with (the checkpoint's record of the
data, data_identity.py, is only compared at a resume). Either is a `DataError` naming the file and what to do.
A file replaced by a rename keeps the old contents behind the open descriptor, as a memory map kept them: the run
goes on with the tokens it started with.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

import torch
from torch.utils.data import Dataset as TorchDataset

from model_parallel.errors import DataError
from model_parallel.userfile import check_regular

if TYPE_CHECKING:
    import numpy as np

TOKEN_DTYPES = ("uint16", "uint32")


def check_token_file(path: str, error: type[Exception], where: str) -> None:
    """A token file is a regular file: a missing one is said so, and a FIFO, a device or a directory is refused by
    its kind, not opened (opening a FIFO waits for a writer; /dev/zero never ends). `where` starts the message."""
    fix = "give a flat uint16/uint32 array of token ids (nanoGPT's train.bin)"
    if not os.path.exists(path):
        raise error(f"{where}: no such file; {fix}")
    check_regular(path, error=error, what="token file", fix=fix, where=where)


class TokenWindows(TorchDataset):
    """A flat token file (nanoGPT's train.bin) as samples (ids[i*T : i*T+T], ids[i*T+1 : i*T+T+1]), int64.
    `vocab`: ids must be below it (the model's vocabulary), checked over the whole file when it is opened."""

    def __init__(self, path: str, seq_len: int, dtype: str = "uint16", vocab: Optional[int] = None) -> None:
        import numpy as np

        if dtype not in TOKEN_DTYPES:
            raise DataError(f"tokens:{path}: token dtype {dtype!r} is not one of {', '.join(TOKEN_DTYPES)}")
        if seq_len < 1:
            raise DataError(f"tokens:{path}: --seq_len must be >= 1, got {seq_len}")
        check_token_file(path, DataError, f"tokens:{path}")
        self.dtype, self.itemsize = np.dtype(dtype), np.dtype(dtype).itemsize
        self.seq_len, self.path, self.vocab = seq_len, path, vocab
        try:
            self._file = open(path, "rb")  # noqa: SIM115 - kept open for the dataset's life: every read goes through it
        except OSError as error:
            raise DataError(f"tokens:{path}: cannot be opened ({error.strerror})") from None
        seen = os.fstat(self._file.fileno())
        self._identity = (seen.st_size, seen.st_mtime_ns)
        size = seen.st_size
        if size % self.itemsize:
            raise DataError(f"tokens:{path}: {size} bytes is not a whole number of {dtype} ids ({self.itemsize} bytes "
                            "each); is the dtype right (--token_dtype)?")
        self.count = size // self.itemsize  # token ids in the file
        if self.count < seq_len + 1:
            raise DataError(f"tokens:{path}: {self.count} token(s) cannot make one window of --seq_len {seq_len} "
                            "plus its shifted target; give more tokens or a shorter --seq_len")
        if vocab is not None and vocab <= np.iinfo(dtype).max:
            self._check_vocab(vocab)

    def __len__(self) -> int:
        return (self.count - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.read(index * self.seq_len, self.seq_len + 1)
        return window[:-1], window[1:]

    def target(self, index: int) -> torch.Tensor:
        """`self[index][1]` alone: the window shifted by one token."""
        return self.read(index * self.seq_len + 1, self.seq_len)

    def read(self, start: int, count: int) -> torch.Tensor:
        """Token ids [start, start + count) as int64; a DataError when the file changed since it was opened."""
        return torch.from_numpy(self._ids(start, count).astype("int64"))

    def _ids(self, start: int, count: int) -> "np.ndarray":
        """Token ids [start, start + count) in the file's dtype (see `read`)."""
        import numpy as np

        now = os.fstat(self._file.fileno())
        if (now.st_size, now.st_mtime_ns) != self._identity:
            self._changed(f"it is {now.st_size} bytes now, {self._identity[0]} when the run opened it"
                          if now.st_size != self._identity[0] else "its modification time changed")
        data = os.pread(self._file.fileno(), count * self.itemsize, start * self.itemsize)
        if len(data) != count * self.itemsize:  # truncated between the fstat and the read
            self._changed(f"reading tokens {start}..{start + count} found its end at byte {start * self.itemsize + len(data)}")
        return np.frombuffer(data, dtype=self.dtype)

    def _changed(self, how: str) -> None:
        raise DataError(f"tokens:{self.path}: the file changed while this run read it ({how}): a token file must not "
                        "be truncated or rewritten in place under a running job. Restore the file the run started "
                        "with and resume from the last checkpoint (--resume); to train on new tokens, write them to "
                        "another file (or rename a new file over this one: a running job keeps the old contents)")

    def __getstate__(self) -> dict:
        # A DataLoader worker or a copy opens the file again (an open file does not pickle); the identity stays,
        # so a file that changed in between is refused on its first read, as in this process.
        return {k: v for k, v in self.__dict__.items() if k != "_file"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._file = open(self.path, "rb")  # noqa: SIM115 - as in __init__

    def _check_vocab(self, vocab: int) -> None:
        """An id past the vocabulary would fail deep in a stage as "index out of range in self", naming nothing,
        and only at the step that first read it, hours in. So the whole file is checked once, here: a max over each
        chunk (16 Mi ids; a cold file costs one read of it; nothing is held)."""
        import numpy as np

        chunk = 1 << 24
        for begin in range(0, self.count, chunk):
            part = self._ids(begin, min(chunk, self.count - begin))
            if int(part.max()) >= vocab:
                at = begin + int(np.argmax(part >= vocab))
                raise DataError(f"tokens:{self.path}: token id {int(part[at - begin])} (at token {at}) is not below "
                                f"the model's vocabulary size {vocab}; was the file made by another tokenizer, or is "
                                f"its dtype other than {self.dtype} (--token_dtype)?")

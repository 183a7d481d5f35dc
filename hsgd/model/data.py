"""Training data: a byte corpus, a fixed train/validation split, and the batch of every step.

Tokens are bytes (vocabulary 256). With no file given, the corpus is the Python standard library's own
top-level source files (found through `sysconfig`), read in sorted order: every Python machine has it, so
the default job needs no download. `--data FILE` trains on any file instead.

The split is fixed: the last 10% of the bytes (at least seq_len + 1 of them) are validation data.

The global batch of step s is a pure function of (seed, step): B windows of T+1 bytes whose start offsets
come from NumPy's PCG64 generator seeded with (seed, split, step). It does not depend on how many ranks will
share it, so a data-parallel run can slice rows out of the very batch the serial run trains on.
"""
import glob
import hashlib
import os
import sysconfig

import numpy as np

from hsgd.errors import DataError
from hsgd.files import regular_file

VAL_FRACTION = 0.10
_SPLIT_ID = {"train": 0, "val": 1}


def default_corpus_files():
    """The standard library's top-level *.py files, sorted by name."""
    stdlib = sysconfig.get_paths()["stdlib"]
    return sorted(glob.glob(os.path.join(stdlib, "*.py")))


def read_bytes(path):
    """The bytes of `path`, memory-mapped (a large file is not read into every rank's memory), or a DataError that
    says what is wrong with it."""
    if not isinstance(path, (str, os.PathLike)):                 # (an integer would open a file descriptor)
        raise DataError(f"data {path!r} is not a path; give --data (TOML: data) the path of a text file")
    if not os.path.exists(path):
        raise DataError(f"data file {path!r} does not exist; pass --data with the path of a text file, "
                        "or leave --data out to train on the built-in corpus")
    if os.path.isdir(path):
        raise DataError(f"data path {path!r} is a directory; --data takes one text file")
    regular_file(path, "data file", DataError)                   # a FIFO or a device would never end
    try:
        if os.path.getsize(path) == 0:
            return b""
        return np.memmap(path, dtype=np.uint8, mode="r")         # mapped: pages are read as batches need them
    except OSError as e:
        raise DataError(f"data file {path!r} cannot be read ({e.strerror}); check its permissions") from None


class Corpus:
    """Token arrays of one corpus, split into train and val. Both are uint8 NumPy arrays on the host."""

    def __init__(self, data, name, seq_len):
        n = len(data)
        if n == 0:
            raise DataError(f"data file {name!r} is empty; it needs at least seq_len + 1 = {seq_len + 1} bytes")
        if n < seq_len + 1:
            raise DataError(f"data file {name!r} has {n} bytes, fewer than seq_len + 1 = {seq_len + 1}; "
                            f"use a longer file or a smaller --seq-len (at most {n - 1})")
        tokens = self.all = np.frombuffer(data, dtype=np.uint8)  # (a mapped file stays mapped: no copy)
        self.name = name
        self.seq_len = seq_len
        n_val = max(int(n * VAL_FRACTION), seq_len + 1)
        if n - n_val >= seq_len + 1:
            self.train, self.val = tokens[:n - n_val], tokens[n - n_val:]
            self.shared_split = False
        else:                                                     # too small to split: validate on train
            self.train = self.val = tokens
            self.shared_split = True

    @classmethod
    def load(cls, path, seq_len):
        """The corpus in `path`, or the default corpus when `path` is None."""
        if path is None:
            files = default_corpus_files()
            data = b"".join(bytes(read_bytes(f)) for f in files)
            if not data:
                raise DataError("the built-in corpus (the standard library's source files) was not found; "
                                "pass --data with the path of a text file")
            return cls(data, f"python-stdlib ({len(files)} files)", seq_len)
        return cls(read_bytes(path), path, seq_len)

    def fingerprint(self):
        """(size, SHA-256 of 64 blocks of 4 KiB spread over the corpus): cheap for a large mapped file, and enough
        to tell whether two ranks (two nodes) see the same data."""
        n, h = len(self.all), hashlib.sha256()
        for start in np.linspace(0, max(n - 4096, 0), 64).astype(np.int64):
            h.update(self.all[start:start + 4096].tobytes())
        return n, h.hexdigest()

    def tokens(self, split):
        if split not in _SPLIT_ID:
            raise ValueError(f"split must be 'train' or 'val', not {split!r}")
        return self.train if split == "train" else self.val

    def batch(self, seed, step, batch_size, split="train"):
        """(idx, targets), each int64 (B, T): the batch of `step`, a pure function of (seed, split, step)."""
        toks = self.tokens(split)
        T = self.seq_len
        rng = np.random.default_rng([seed, _SPLIT_ID[split], step])
        starts = rng.integers(0, len(toks) - T, size=batch_size)             # (B,) window starts
        windows = toks[starts[:, None] + np.arange(T + 1)].astype(np.int64)   # (B, T+1)
        return windows[:, :-1], windows[:, 1:]

    def describe(self):
        split = "validation shares the training text (file too small to split)" if self.shared_split else \
            f"{len(self.train):,} train / {len(self.val):,} validation bytes"
        return f"{self.name}: {split}"


def same_data(prints, path):
    """Every rank read the same data (nodes can see different versions of a file), else DataError."""
    differ = [r for r, p in enumerate(prints) if p != prints[0]]
    if differ:
        raise DataError(f"ranks {differ} read other data than rank 0 from {path or 'the built-in corpus'!r} "
                          f"({prints[differ[0]][0]:,} bytes vs {prints[0][0]:,}); give every node the same file")

"""The native weight file's data digest (``edgeroute.data_digest``), in numpy: the same function
as libedgeroute's ``er_data_digest`` (libedgeroute/src/digest.c; the formula is in edgeroute.h).

A sum over the data's 8-byte words of a bijective mix of (word + index * step): any one changed
word changes the digest, and the sum splits into chunks (numpy here, the model's threads in C).
It finds damage (a flipped bit, a block overwritten, a file cut or grown), not tampering: the
manifest's sha256 is the cryptographic check."""

from __future__ import annotations

import numpy as np

STEP = np.uint64(0x9E3779B97F4A7C15)
MUL = np.uint64(0xD6E8FEB86659FD93)
MASK = (1 << 64) - 1
CHUNK_WORDS = 1 << 20  # 8 MiB of words per numpy pass: bounded memory for any file


def _mix(x: np.ndarray) -> np.ndarray:
    """In place: x ^= x >> 32; x *= MUL; x ^= x >> 32; x *= MUL; x ^= x >> 32 (mod 2^64)."""
    x ^= x >> np.uint64(32)
    x *= MUL
    x ^= x >> np.uint64(32)
    x *= MUL
    x ^= x >> np.uint64(32)
    return x


def _mix_int(x: int) -> int:
    return int(_mix(np.array([x & MASK], dtype=np.uint64))[0])


class Digest:
    """``update`` with the data's bytes in file order, then ``value()``."""

    def __init__(self) -> None:
        self.words = 0  # full words summed so far
        self.total = 0  # their sum, mod 2^64
        self.pending = b""  # < 8 bytes not yet a full word
        self.bytes = 0

    def update(self, data: bytes | bytearray | memoryview | np.ndarray) -> None:
        raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
        self.bytes += raw.size
        if self.pending:
            need = 8 - len(self.pending)
            head, raw = raw[:need].tobytes(), raw[need:]
            self.pending += head
            if len(self.pending) < 8:
                return
            self._add(np.frombuffer(self.pending, dtype="<u8"))
            self.pending = b""
        full = raw.size // 8 * 8
        words = raw[:full].view("<u8")
        for at in range(0, words.size, CHUNK_WORDS):
            self._add(words[at:at + CHUNK_WORDS])
        self.pending = raw[full:].tobytes()

    def _add(self, words: np.ndarray) -> None:
        index = np.arange(self.words, self.words + words.size, dtype=np.uint64)
        index *= STEP
        index += words
        self.total = (self.total + int(_mix(index).sum(dtype=np.uint64))) & MASK
        self.words += words.size

    def value(self) -> int:
        total = self.total
        if self.pending:
            word = int.from_bytes(self.pending + b"\0" * (8 - len(self.pending)), "little")
            total = (total + _mix_int(word + self.words * int(STEP))) & MASK
        return _mix_int(total + self.bytes)


def data_digest(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """The digest of ``data`` in one call."""
    digest = Digest()
    digest.update(data)
    return digest.value()

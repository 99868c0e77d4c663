"""The KV cache and the attention flavours that read and write it.

A sequence's cache is allocated once at full capacity; attention graphs read the past where
it lies. Two flavours of the same attention (docs/bundle-format.md):

- :class:`PortableAttention` (standard ops, TensorRT-parsable): the cache is positions-first
  ``[layers, capacity, kv, hd]``, so the past of a layer is a contiguous view passed without
  a copy; the graph returns the new rows and the runtime writes them after the past.
- :class:`OrtAttention` (ONNX Runtime's GroupQueryAttention): the cache is heads-first
  ``[layers, 1, kv, capacity, hd]`` as the kernel reads it; each layer's buffer is bound
  (IO binding) as both ``past_*`` and ``present_*``, so the kernel writes the new rows in place.

The portable cache may hold fp16 (half the memory; the graphs widen it to fp32 for the
arithmetic); the ort flavour's is fp32. The native backend (``native.py``) keeps a heads-first
cache of fp32, fp16 or int8 rows (the row layouts: ``edgeroute.kv_formats``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnxruntime as ort

from edgeroute.kv_formats import kv_row_bytes

MASKED = np.finfo(np.float32).min


def resident_zeros(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Zeros written now. ``np.zeros`` maps pages that become resident only as positions fill,
    so a session's memory would grow over a conversation (by ~480 MB over 10k SmolLM2 tokens)
    and a device that cannot hold the cache would be killed mid-conversation instead of
    refusing at the start; written at allocation, the cache costs its full size at once."""
    array = np.empty(shape, dtype)
    array.fill(0.0)
    return array


class CacheBook(ABC):
    """What every cache of the layer-by-layer backends keeps beside its rows: the positions
    held, the capacity, which positions each layer dropped (kv_cache_reduction), and the rules
    for truncating and copying them. A cache keeps its rows where its backend computes (host
    arrays here, device buffers in ``trt.DeviceKVCache``) and moves them in ``_copy_rows``."""

    capacity: int
    length: int
    dropped: np.ndarray | None  # [layers, capacity] bool, only once a layer was dropped

    @property
    @abstractmethod
    def layers(self) -> int: ...

    @abstractmethod
    def _layout(self) -> tuple[Any, ...]:
        """What two caches must share for positions to move between them (all but capacity)."""

    @abstractmethod
    def _copy_rows(self, other: Any, length: int) -> None:
        """Copy ``other``'s rows of positions [0, length) of every layer into this cache."""

    def drop(self, layer: int, start: int, count: int) -> None:
        if self.dropped is None:
            self.dropped = np.zeros((self.layers, self.capacity), bool)
        self.dropped[layer, start:start + count] = True

    def dropped_before(self, layer: int, start: int) -> np.ndarray | None:
        """Which of positions [0, start) ``layer`` dropped (kv_cache_reduction), or None when
        it dropped none of them."""
        if self.dropped is None or not self.dropped[layer, :start].any():
            return None
        return self.dropped[layer, :start]

    def truncate(self, length: int) -> None:
        """Forget positions >= length (rejected speculative tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        if self.dropped is not None:
            self.dropped[:, length:] = False
        self.length = length

    def reset(self) -> None:
        self.truncate(0)
        self.dropped = None

    def copy_from(self, other: CacheBook, length: int | None = None) -> None:
        """Take over ``other``'s first ``length`` positions (all by default), e.g. a shared
        prompt prefix; the buffers stay the same objects (IO bindings stay valid)."""
        length = other.length if length is None else length
        if other._layout() != self._layout():
            raise ValueError("cannot copy between caches of different models, attention flavours or KV dtypes")
        if not 0 <= length <= min(other.length, self.capacity):
            raise ValueError(f"cannot copy {length} positions from a cache of {other.length} into one of "
                             f"capacity {self.capacity}")
        self._copy_rows(other, length)
        self.dropped = None
        if other.dropped is not None and other.dropped[:, :length].any():
            self.dropped = np.zeros((self.layers, self.capacity), bool)
            self.dropped[:, :length] = other.dropped[:, :length]
        self.length = length


@dataclass
class KVCache(CacheBook):
    """One sequence's keys and values for every layer, positions-first or heads-first."""

    keys: np.ndarray
    values: np.ndarray
    capacity: int
    heads_first: bool = False
    length: int = 0
    dropped: np.ndarray | None = None  # [layers, capacity] bool, only once a layer was dropped
    # per (graph kind, layer): the ONNX Runtime IO binding over this cache's buffers
    bindings: dict[tuple[str, int], Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def allocate(cls, layers: int, capacity: int, kv_heads: int, head_dim: int, heads_first: bool,
                 dtype: str = "float32") -> KVCache:
        row = kv_row_bytes(head_dim, dtype) // np.dtype(dtype).itemsize  # an int8 row ends with its scales
        shape = (layers, 1, kv_heads, capacity, row) if heads_first else (layers, capacity, kv_heads, row)
        return cls(resident_zeros(shape, dtype), resident_zeros(shape, dtype), capacity, heads_first)

    @property
    def dtype(self) -> str:
        return str(self.keys.dtype)

    @property
    def layers(self) -> int:
        return self.keys.shape[0]

    def _positions(self, array: np.ndarray, layer: int | slice, start: int, stop: int) -> np.ndarray:
        """``array``'s rows [start, stop) of ``layer`` as [..., positions, kv, hd] (a view)."""
        if self.heads_first:
            return np.moveaxis(array[layer, 0, :, start:stop], -3, -2)
        return array[layer, start:stop]

    def rows(self, layer: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of positions [start, stop) of ``layer``, [n, kv, hd] (views)."""
        return self._positions(self.keys, layer, start, stop), self._positions(self.values, layer, start, stop)

    def write(self, layer: int, start: int, key: np.ndarray, value: np.ndarray) -> None:
        """Store new rows [T, kv, hd] at ``start``."""
        k, v = self.rows(layer, start, start + key.shape[0])
        k[...], v[...] = key, value

    def _layout(self) -> tuple[tuple[int, ...], bool, str]:
        shape = list(self.keys.shape)
        del shape[-2 if self.heads_first else 1]
        return tuple(shape), self.heads_first, self.dtype

    def _copy_rows(self, other: KVCache, length: int) -> None:
        every = slice(None)
        for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
            self._positions(mine, every, 0, length)[...] = other._positions(theirs, every, 0, length)

    def clone(self) -> KVCache:
        """An independent cache of the same capacity holding the same positions."""
        copy = KVCache(resident_zeros(self.keys.shape, self.dtype), resident_zeros(self.values.shape, self.dtype),
                       self.capacity, self.heads_first)
        copy.copy_from(self)
        return copy


class PortableAttention:
    flavour = "portable"
    heads_first = False

    def __init__(self, capacity: int) -> None:
        self._zero_row = np.zeros((1, capacity), np.float32)

    def bias(self, cache: CacheBook, layer: int, start: int, t: int) -> np.ndarray:
        """Additive mask [t, start + t]: every cached position, the new ones causally, minus
        the positions this layer dropped (kv_cache_reduction). A one-token step without drops
        (the decode hot path) gets a view of a preallocated zero row."""
        dropped = cache.dropped_before(layer, start)
        if t == 1 and dropped is None:
            return self._zero_row[:, :start + 1]
        bias = np.zeros((t, start + t), np.float32)
        bias[:, start:] = np.triu(np.full((t, t), MASKED, np.float32), k=1)
        if dropped is not None:
            bias[:, :start][:, dropped] = MASKED
        return bias

    def run(self, session: ort.InferenceSession, kind: str, layer: int, cache: KVCache, start: int,
            feeds: dict[str, np.ndarray]) -> np.ndarray:
        t = feeds["hidden"].shape[0]
        past_k, past_v = cache.rows(layer, 0, start)
        feeds = {**feeds, "attn_bias": self.bias(cache, layer, start, t), "past_key": past_k, "past_value": past_v}
        out, key, value = session.run(["hidden_out", "key", "value"], feeds)
        cache.write(layer, start, key, value)
        return out


class OrtAttention:
    flavour = "ort"
    heads_first = True

    def __init__(self, capacity: int) -> None:
        self._zero_row = np.zeros((1, 1, 1, capacity), np.float32)

    def bias(self, cache: CacheBook, layer: int, start: int, t: int) -> np.ndarray:
        """Additive bias [1, 1, t, start + t] for the kernel, which masks causally on its own:
        zero but for the positions this layer dropped (kv_cache_reduction)."""
        dropped = cache.dropped_before(layer, start)
        if dropped is None:
            return self._zero_row[..., :start + 1] if t == 1 else np.zeros((1, 1, t, start + t), np.float32)
        bias = np.zeros((1, 1, t, start + t), np.float32)
        bias[..., :start][..., dropped] = MASKED
        return bias

    @staticmethod
    def _binding(session: ort.InferenceSession, kind: str, layer: int, cache: KVCache) -> ort.IOBinding:
        key = (kind, layer)
        if key not in cache.bindings:
            binding = session.io_binding()
            buffers = []
            for name, array in (("key", cache.keys[layer]), ("value", cache.values[layer])):
                buffer = ort.OrtValue.ortvalue_from_numpy(array)  # wraps the cache's memory, no copy
                binding.bind_ortvalue_input(f"past_{name}", buffer)
                binding.bind_ortvalue_output(f"present_{name}", buffer)
                buffers.append(buffer)
            cache.bindings[key] = (binding, buffers)
        return cache.bindings[key][0]

    def run(self, session: ort.InferenceSession, kind: str, layer: int, cache: KVCache, start: int,
            feeds: dict[str, np.ndarray]) -> np.ndarray:
        t = feeds["hidden"].shape[0]
        binding = self._binding(session, kind, layer, cache)
        feeds = {**feeds, "attn_bias": self.bias(cache, layer, start, t),
                 "seqlens_k": np.array([start + t - 1], np.int32), "total_sequence_length": np.array(start + t, np.int32)}
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        binding.bind_output("hidden_out")  # afresh: a bound output keeps the previous call's shape
        session.run_with_iobinding(binding)
        return binding.get_outputs()[2].numpy()  # bound after present_key, present_value


FLAVOURS = {"portable": PortableAttention, "ort": OrtAttention}
ATTENTION_CHOICES = ("auto", *FLAVOURS)

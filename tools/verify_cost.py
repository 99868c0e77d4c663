"""What checking the native weights' digest costs when a model opens: er_data_digest alone over
the file's tensor data (mapped, the page cache warm after the first round), and er_model_open
with verify ER_VERIFY_NONE and ER_VERIFY_DIGEST, alternating.

    python -m tools.verify_cost bundles/qwen-pair/llm/native.bin --rounds 3

A file exported before the digest: ``--add-digest OUT`` writes a copy with it (the same data
section) and measures that.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import struct
import time
from pathlib import Path

import numpy as np

from edgeroute.export.digest import data_digest
from edgeroute.runtime.backends import native

SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def header(raw: np.ndarray) -> tuple[int, int, int, int | None]:
    """(end of the key-value pairs, end of the tensor table, where the data starts, its digest)."""
    b = raw[:1 << 22].tobytes()
    _, tensors, keys = struct.unpack_from("<IQQ", b, 4)
    at, align, digest = 24, 32, None

    def string(at: int) -> tuple[bytes, int]:
        n = struct.unpack_from("<Q", b, at)[0]
        return b[at + 8:at + 8 + n], at + 8 + n

    for _ in range(keys):
        key, at = string(at)
        kind = struct.unpack_from("<I", b, at)[0]
        at += 4
        if kind == 8:
            at = string(at)[1]
        elif kind == 9:
            inner, count = struct.unpack_from("<IQ", b, at)
            at += 12
            for _ in range(count):
                at = string(at)[1] if inner == 8 else at + SIZES[inner]
        else:
            if key == b"general.alignment":
                align = struct.unpack_from("<I", b, at)[0]
            if key == b"edgeroute.data_digest":
                digest = struct.unpack_from("<Q", b, at)[0]
            at += SIZES[kind]
    kv_end = at
    for _ in range(tensors):
        at = string(at)[1]
        at += 4 + 8 * struct.unpack_from("<I", b, at)[0] + 12
    return kv_end, at, (at + align - 1) // align * align, digest


def add_digest(source: Path, out: Path) -> None:
    raw = np.memmap(source, dtype=np.uint8, mode="r")
    kv_end, table_end, start, digest = header(raw)
    if digest is not None:
        raise SystemExit(f"{source} already carries a digest")
    b = raw[:table_end].tobytes()
    key = b"edgeroute.data_digest"
    kv = struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 10, data_digest(raw[start:]))
    version, tensors, keys = struct.unpack_from("<IQQ", b, 4)
    head = b[:4] + struct.pack("<IQQ", version, tensors, keys + 1) + b[24:kv_end] + kv + b[kv_end:]
    with open(out, "wb") as f:
        f.write(head + bytes(-len(head) % 64))
        for at in range(start, raw.size, 1 << 26):
            f.write(raw[at:at + (1 << 26)].tobytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--add-digest", type=Path, help="write a copy with the digest here and measure it")
    args = parser.parse_args()
    path = args.file
    if args.add_digest:
        add_digest(path, args.add_digest)
        path = args.add_digest
    lib, constants = native.native_library(), native.header_constants()
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    start = header(raw)[2]
    for threads in (1, 0):
        times = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            lib.er_data_digest(raw.ctypes.data + start, raw.size - start, threads)
            times.append(time.perf_counter() - t)
        print(f"er_data_digest of {(raw.size - start) / 1e9:.2f} GB, {threads or 'all'} threads: median "
              f"{statistics.median(times):.3f} s ({', '.join(f'{t:.3f}' for t in times)})")
    opens: dict[str, list[float]] = {"ER_VERIFY_NONE": [], "ER_VERIFY_DIGEST": []}
    for _ in range(args.rounds):
        for name, times in opens.items():
            params = native._sized(native._ModelParams, kernels=lib.er_kernels_best(), threads=0, max_pass=256,
                                   verify=constants[name])
            handle = ctypes.c_void_p()
            t = time.perf_counter()
            native._check(lib, lib.er_model_open(str(path).encode(), ctypes.byref(params), ctypes.byref(handle)))
            times.append(time.perf_counter() - t)
            lib.er_model_free(handle)
    for name, times in opens.items():
        print(f"er_model_open {name}: median {statistics.median(times):.2f} s ({', '.join(f'{t:.2f}' for t in times)})")


if __name__ == "__main__":
    main()

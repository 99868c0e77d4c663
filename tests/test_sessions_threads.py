"""Sessions of one native model from several Python threads at once: forwards, truncations,
copies and frees in a random order give the logits the same scripts give run one after another,
and the model closed while its caches run leaves them running (libedgeroute's model is
reference-counted; the C side of this is tests/native/test_sessions_threads.c under
ThreadSanitizer)."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from edgeroute.bundle import Bundle
from edgeroute.errors import InputError

native = pytest.importorskip("edgeroute.runtime.backends.native")
WORKERS, OPS, CAPACITY = 3, 12, 32


@pytest.fixture(scope="module")
def model(smollm2_bundles):
    try:
        return native.NativeModel(Bundle.open(smollm2_bundles["int4"][0]), threads=1)
    except native.NativeBackendUnavailable as err:
        pytest.skip(str(err))


def script(worker: int) -> list[tuple]:
    """One worker's ops, the same on every run: forward ids on cache 0 or 1, truncate one, copy
    one's prefix into the other."""
    rng, ops = random.Random(worker), []
    for _ in range(OPS):
        which, kind = rng.randrange(2), rng.choice(["forward", "forward", "truncate", "copy"])
        if kind == "forward":
            ops.append((kind, which, [rng.randrange(2000) for _ in range(rng.randint(1, 3))]))
        else:
            ops.append((kind, which, rng.random()))
    return ops


def run(model, ops: list[tuple], caches: list, before_ops=None) -> list[np.ndarray]:
    """The ops over ``caches``; the logits of each forward (and each op's lengths)."""
    if before_ops is not None:
        before_ops()
    out = []
    for kind, which, arg in ops:
        cache, other = caches[which], caches[1 - which]
        if kind == "forward":
            if cache.length + len(arg) > CAPACITY:
                cache.truncate(2)
            out.append(model.forward(cache, arg, all_logits=True))
        elif kind == "truncate":
            cache.truncate(int(arg * cache.length))
        else:
            cache.copy_from(other, int(arg * other.length))
        out.append(np.array([caches[0].length, caches[1].length]))
    return out


def test_native_sessions_in_parallel_threads_give_the_serial_logits_and_outlive_the_closed_model(model):
    scripts = [script(w) for w in range(WORKERS)]
    serial = []
    for ops in scripts:
        caches = [model.new_cache(CAPACITY) for _ in range(2)]
        serial.append(run(model, ops, caches))
    assert sum(out.ndim == 2 for outs in serial for out in outs) >= WORKERS * OPS // 3, "too few forwards to compare"

    results: list[list[np.ndarray] | BaseException] = [[] for _ in range(WORKERS)]
    made = threading.Barrier(WORKERS + 1)  # every worker holds its caches: the model may close

    def worker(w: int) -> None:
        try:
            caches = [model.new_cache(CAPACITY) for _ in range(3)]
            caches.pop(random.Random(w).randrange(3)).close()  # one freed while the others are made
            results[w] = run(model, scripts[w], caches, made.wait)
            for cache in random.Random(w + 10).sample(caches, 2):  # freed in either order
                cache.close()
        except BaseException as err:  # noqa: BLE001 - handed to the main thread
            results[w] = err
            made.abort()

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(WORKERS)]
    for thread in threads:
        thread.start()
    made.wait()
    model.close()  # while every worker's caches run
    for thread in threads:
        thread.join(timeout=300)
    for w, (got, want) in enumerate(zip(results, serial, strict=True)):
        assert not isinstance(got, BaseException), f"worker {w}: {got!r}"
        assert len(got) == len(want) and all(np.array_equal(g, s) for g, s in zip(got, want, strict=True)), \
            f"worker {w}: logits or lengths differ from the serial run"
    with pytest.raises(InputError, match="closed"):
        model.new_cache(CAPACITY)

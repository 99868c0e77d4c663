"""Label shards as Ray tasks: ``edgeroute calibrate --executor ray [--address ADDR]``.

The driver plans the shards, keeps ``workers`` of them in flight and writes each shard file
itself when its arrays come back (``label_prompts``), so a worker never leaves half a shard: a
worker killed mid-shard has written nothing, Ray runs its task again (``SHARD_RETRIES``), and
the retry labels the same arrays (greedy answers on the same bundle). Each worker opens the
bundle itself, from the path the driver opened (so every node must see it there), and keeps
its engine for the next shard it gets. Training, fitting and confirmation stay on the driver.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from edgeroute.bundle import Bundle
from edgeroute.calibration.labels import LabelSettings, Progress, Shard, bundle_identity, label_shard, uncalibrated_engine
from edgeroute.errors import EdgerouteError, InputError
from edgeroute.runtime.engine import Engine

INSTALL = "pip install 'edgeroute[cluster]'"
# Ray's retries of a task whose worker died (killed, out of memory, its node lost); a task
# that raised is not retried: a bundle that cannot be opened fails the same way again.
SHARD_RETRIES = 3
THREADS_VARIABLE = "EDGEROUTE_THREADS"  # the runtime's thread count (OrtModel's pool, the native kernels)


def import_ray() -> ModuleType:
    try:
        import ray
    except ImportError:
        raise InputError(f"--executor ray needs Ray, which is not installed here: {INSTALL} "
                         "(or label with --executor local)") from None
    return ray


_engines: dict[tuple[str, str], Engine] = {}  # in a worker process: (bundle path, identity) -> its engine


def label_on_worker(bundle_path: str, identity: str, shard: Shard, settings: LabelSettings) -> dict[str, np.ndarray]:
    """A Ray task's body: ``label_shard`` on this worker's engine for the bundle."""
    engine = _engines.get((bundle_path, identity))
    if engine is None:
        engine = _engines[bundle_path, identity] = _open_on_worker(bundle_path, identity)
    return label_shard(engine, shard, settings)


def _open_on_worker(bundle_path: str, identity: str) -> Engine:
    node = socket.gethostname()
    try:
        engine = uncalibrated_engine(Bundle.open(bundle_path))
    except (EdgerouteError, OSError) as err:
        raise InputError(f"a Ray worker on {node} cannot open the bundle {bundle_path}: {err}. Every node labels "
                         "from the path the driver opened: put the bundle on storage all nodes mount at that path "
                         "(or the same copy at that path on each node)") from None
    if bundle_identity(engine) != identity:
        raise InputError(f"the bundle at {bundle_path} on {node} is not the one the driver calibrates (its model "
                         "files differ): put the same bundle at that path on every node")
    return engine


@contextmanager
def _connected(ray: ModuleType, address: str | None, cpus: int) -> Iterator[None]:
    """Ray as this process has it: an existing connection as it is; else the cluster at
    ``address`` (or ``RAY_ADDRESS``), else a local Ray of ``cpus`` CPUs started for the run;
    the ones made here are closed after it."""
    if ray.is_initialized():
        yield
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    quiet = {"logging_level": logging.WARNING, "log_to_driver": False}  # the progress bar stays readable
    try:
        if address:
            ray.init(address=address, **quiet)
        else:
            ray.init(num_cpus=cpus, include_dashboard=False, **quiet)
    except ConnectionError as err:
        raise InputError(f"cannot reach the Ray cluster at {address}: {err}. Start one with `ray start --head`, "
                         "or drop --address to label on a local Ray started for the run") from None
    try:
        yield
    finally:
        ray.shutdown()


@dataclass
class RayExecutor:
    """Shards as Ray tasks of ``worker_cpus`` CPUs each (the runtime's thread count in the
    task); at most ``workers`` in flight (default: as many as the cluster's CPUs hold; a local
    Ray started for the run gets ``workers x worker_cpus`` CPUs, default all of this machine's)."""

    address: str | None = None
    workers: int | None = None
    worker_cpus: int = 1

    def __post_init__(self) -> None:
        import_ray()  # without Ray, say how to install it before anything loads
        for name, value in (("workers", self.workers), ("worker CPUs", self.worker_cpus)):
            if value is not None and value < 1:
                raise InputError(f"{name} must be at least 1 (got {value})")

    def label(self, engine: Engine, shards: list[Shard], settings: LabelSettings,
              progress: Progress | None) -> Iterator[tuple[Shard, dict[str, np.ndarray]]]:
        if not shards:
            return
        ray = import_ray()
        local_workers = self.workers or max(1, (os.cpu_count() or 1) // self.worker_cpus)
        with _connected(ray, self.address, local_workers * self.worker_cpus):
            task = ray.remote(label_on_worker).options(
                num_cpus=self.worker_cpus, max_retries=SHARD_RETRIES,
                runtime_env={"env_vars": {THREADS_VARIABLE: str(self.worker_cpus)}})
            workers = self.workers or max(1, int(ray.cluster_resources().get("CPU", 1) // self.worker_cpus))
            path, identity = str(engine.bundle.path.resolve()), bundle_identity(engine)
            waiting, running = list(shards), {}
            try:
                while waiting or running:
                    while waiting and len(running) < workers:
                        shard = waiting.pop(0)
                        running[task.remote(path, identity, shard, settings)] = shard
                    (ready,), _ = ray.wait(list(running), num_returns=1)
                    shard = running.pop(ready)
                    yield shard, _result(ray, ready, shard)
            finally:  # an interrupted driver leaves no task running for it
                for ref in running:
                    ray.cancel(ref, force=True)


def _result(ray: ModuleType, ref, shard: Shard) -> dict[str, np.ndarray]:
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, EdgerouteError):  # the worker's own message, without Ray's wrapping
            raise type(err.cause)(str(err.cause)) from None
        raise
    except ray.exceptions.RayError as err:
        raise EdgerouteError(f"label shard {shard.id} failed on Ray after {SHARD_RETRIES} retries "
                             f"({type(err).__name__}: {err}); the finished shards are on disk: rerun to resume "
                             "from them") from None

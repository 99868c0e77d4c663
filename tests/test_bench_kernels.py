"""tools/bench_kernels.py: one matrix product of the library's kernels timed alone. Its driver is
built from the library's internal sources, so a change to an internal signature breaks it
where no other test looks (it did: er_pack gained its threads)."""

from __future__ import annotations

import platform

import pytest

from edgeroute.runtime.backends.native import header_constants
from tools import bench_kernels

OTHER_ARCH_KERNELS = "NEON" if platform.machine() in ("x86_64", "AMD64") else "AVX2"


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return bench_kernels.build_driver(tmp_path_factory.mktemp("bench_kernels") / "bench_kernels")


def test_driver_times_a_product_on_every_kernel_set_this_cpu_runs(driver):
    timed = {name: bench_kernels.time_case(driver, kernels, ("Q8_0", 64, 256), 2, 1, 0.01)
             for name, kernels in bench_kernels.kernel_ids().items()}
    assert timed["generic"] is not None
    for name, result in timed.items():
        if result is not None:
            ms, read = result
            assert ms > 0, name
            assert read >= 64 * 256, name  # Q8_0: at least a byte per weight


def test_a_kernel_set_this_cpu_does_not_run_is_no_case(driver):
    kernels = header_constants()[f"ER_KERNELS_{OTHER_ARCH_KERNELS}"]
    assert bench_kernels.time_case(driver, kernels, ("Q8_0", 64, 256), 1, 1, 0.01) is None


def test_a_shape_the_format_cannot_take_is_an_error_not_a_skipped_case(driver):
    generic = bench_kernels.kernel_ids()["generic"]
    with pytest.raises(RuntimeError, match=r"Q8_0 64x33 M=1: exit 2: .*does not take 33 columns"):
        bench_kernels.time_case(driver, generic, ("Q8_0", 64, 33), 1, 1, 0.01)

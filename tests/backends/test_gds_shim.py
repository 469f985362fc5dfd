"""kvikio's host-memory path in CI through a TEST-ONLY libcuda SHIM — not GDS coverage.

kvikio 26.10 refuses all I/O without ``libcuda.so.1``. This test builds a fake one (gcc, in a
temporary directory; never shipped) whose ``cuPointerGetAttributes`` says "not initialized", so
kvikio treats every buffer as host memory, then runs tests/backends/test_gds_kvikio.py in a subprocess
with it on ``LD_LIBRARY_PATH``. That exercises the gds tier's kvikio code (compat mode, host
buffers) for real; device memory and GPUDirect Storage stay untested here.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kvplug.backends.gds.probe import probe

_ZERO = """cuInit cuMemHostRegister cuMemHostRegister_v2 cuMemHostUnregister cuMemcpyHtoDAsync
cuMemcpyHtoDAsync_v2 cuMemcpyDtoHAsync cuMemcpyDtoHAsync_v2 cuMemcpyAsync cuPointerGetAttribute
cuCtxPushCurrent cuCtxPushCurrent_v2 cuCtxPopCurrent cuCtxPopCurrent_v2 cuCtxGetCurrent
cuCtxGetDevice cuMemGetAddressRange cuMemGetAddressRange_v2 cuGetErrorName cuGetErrorString
cuDeviceGet cuDeviceGetCount cuDeviceGetAttribute cuDevicePrimaryCtxRetain
cuDevicePrimaryCtxRelease cuDevicePrimaryCtxRelease_v2 cuStreamSynchronize cuStreamCreate
cuStreamDestroy cuStreamDestroy_v2 cuEventCreate cuEventRecord cuEventQuery cuEventSynchronize
cuEventDestroy cuEventDestroy_v2 cuLaunchHostFunc cuMemcpyBatchAsync cuCtxCreate cuCtxCreate_v2
cuCtxDestroy cuCtxDestroy_v2""".split()

SHIM_C = "\n".join([
    "/* TEST-ONLY fake libcuda.so.1 for kvikio's host path. Never ship. */",
    "#include <stdlib.h>",
    "int cuDriverGetVersion(int *v) { *v = 12000; return 0; }",
    "/* CUDA_ERROR_NOT_INITIALIZED: kvikio then treats every pointer as host memory */",
    "int cuPointerGetAttributes(unsigned n, void *a, void **d, unsigned long long p)"
    " { return 3; }",
    "int cuMemHostAlloc(void **p, size_t n, unsigned f)"
    " { return posix_memalign(p, 4096, n ? n : 4096) ? 2 : 0; }",
    "int cuMemAllocHost_v2(void **p, size_t n)"
    " { return posix_memalign(p, 4096, n ? n : 4096) ? 2 : 0; }",
    "int cuMemFreeHost(void *p) { free(p); return 0; }",
    *[f"int {name}(void) {{ return 0; }}" for name in _ZERO],
]) + "\n"

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("kvikio") is None,
                    reason="kvikio is not installed (CI installs no gds extra); see docs/gds.md")
@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is needed to build the libcuda shim")
@pytest.mark.skipif(probe().driver, reason="a real CUDA driver is present: "
                    "tests/backends/test_gds_kvikio.py runs against it directly")
def test_kvikio_host_path_through_test_only_libcuda_shim(tmp_path):
    src = tmp_path / "fake_libcuda_shim.c"
    src.write_text(SHIM_C)
    lib = tmp_path / "libcuda.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib),
                    str(src)], check=True, capture_output=True)
    env = dict(os.environ, KVPLUG_TEST_LIBCUDA_SHIM="1",
               LD_LIBRARY_PATH=os.pathsep.join(
                   p for p in (str(tmp_path), os.environ.get("LD_LIBRARY_PATH")) if p))
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         str(REPO / "tests" / "backends" / "test_gds_kvikio.py")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, tail
    assert " passed" in res.stdout and "failed" not in res.stdout, tail

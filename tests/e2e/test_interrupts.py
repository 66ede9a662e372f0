"""SIGINT / SIGTERM to the calibrate script (default multi-process engine): every process it started ends (checked by
PID), config.json is untouched, nothing is written and no temporary file is left behind.

Two moments: SIGINT while the engine is still starting (a Ctrl-C at load), SIGTERM while the prompts run. The
prompts are the README's CPU-engine calibration with more decode steps: its 4 prompts of 8 steps ran in 2.2 s on a
Xeon with AMX and were done before the signal came (the script then wrote its results and exited 0); 256 steps keep
the engine busy well past it.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from e2e_lib import descendants, env, readme_calibrate_command, still_running, wait_for_log

from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import linked_checkpoint_copy

pytestmark = pytest.mark.e2e

# torch's compile cache folder (`torchinductor_<user>`) is a cache torch keeps in the temporary folder on purpose.
TORCH_CACHE_PREFIX = "torchinductor_"


@pytest.mark.parametrize(
    ("sig", "moment"),
    [
        (signal.SIGINT, "(EngineCore pid="),  # the engine process is up and loading
        (signal.SIGTERM, "calibration mode on"),  # the prompts are running
    ],
    ids=["SIGINT-at-startup", "SIGTERM-while-calibrating"],
)
def test_signal_shuts_the_engine_down_and_writes_nothing(smollm2_checkpoint, tmp_path, request, sig, moment):
    ckpt = linked_checkpoint_copy(smollm2_checkpoint, tmp_path / "ckpt")
    work = tmp_path / "work"
    work.mkdir()
    # the script's own temporary folder: short, as ZMQ socket paths under it must stay below 108 bytes
    tmp = Path(tempfile.mkdtemp(prefix="e2e_", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    config_before = (ckpt / "config.json").read_bytes()
    ckpt_before = sorted(p.name for p in ckpt.iterdir())
    log = tmp_path / "calibrate.log"
    cmd = readme_calibrate_command(ckpt, "--decode_tokens", "256")
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=work, env=env(TMPDIR=str(tmp)), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_for_log(proc, log, moment, timeout=600)  # + 120 s below pytest's 1200 s
        time.sleep(2)
        procs = descendants(proc.pid)
        assert any("EngineCore" in p.name() for p in procs), [p.name() for p in procs]
        proc.send_signal(sig)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:  # the test failed: do not leave the script behind
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert code == 128 + sig, text[-4000:]
    assert f"interrupted by {signal.Signals(sig).name}: engine shut down, nothing written" in text
    assert "Traceback" not in text, text[-4000:]
    left = still_running(procs, wait=5)
    assert not left, f"still running after the script exited: {left}"
    assert (ckpt / "config.json").read_bytes() == config_before
    assert sorted(p.name for p in ckpt.iterdir()) == ckpt_before
    assert list(work.iterdir()) == []
    assert [p.name for p in tmp.iterdir() if not p.name.startswith(TORCH_CACHE_PREFIX)] == []

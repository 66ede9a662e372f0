"""The Makefile's logic, checked without installing anything and without network.

Runs the real Makefile (``make -n`` dry runs, with every env path pointing into a temporary folder) and
the real scripts/torch_cpu_source.py, with pip isolated from this machine's configuration
(``PIP_CONFIG_FILE=/dev/null``) and told to use no index, so pip only sees the temporary find-links
folders these tests make.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "torch_cpu_source.py"
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CPU_TORCH = "2.13.0+cpu"
TIMEOUT = 240  # generous for `make -n` (only a hang trips it); at most three make calls a test, below 900 s

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without make's or pip's settings, pip isolated and offline, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MAKE", "MFLAGS", "GNUMAKEFLAGS", "PIP_", "VIRTUAL_ENV"))
    }
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.update(extra)
    return env


def _wheels(tmp_path: Path, *names: str) -> Path:
    folder = tmp_path / "wheels"
    folder.mkdir(exist_ok=True)
    for name in names:
        (folder / name).touch()  # pip decides from the file name; nothing is read or installed
    return folder


def _with_torch(tmp_path: Path) -> dict[str, str]:
    """An env whose pip config file (no index, one find-links folder) has a torch==2.13.0+cpu wheel."""
    links = _wheels(tmp_path, f"torch-{CPU_TORCH}-py3-none-any.whl")
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nno-index = true\nfind-links = {links}\n")
    return _env(PIP_CONFIG_FILE=str(conf))


def _without_torch(tmp_path: Path) -> dict[str, str]:
    """An env whose pip sees no index and an empty find-links folder."""
    return _env(PIP_FIND_LINKS=str(_wheels(tmp_path)))


def _source(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--version", CPU_TORCH, *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=True,
    )  # fmt: skip


def _make(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["make", "--no-print-directory", "-C", str(REPO), *args],
        env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _paths(tmp_path: Path) -> list[str]:
    """Env/model locations inside tmp_path; PYTHON is this interpreter (it has pip; nothing runs it to install)."""
    return [
        f"VENV={tmp_path / 'venv'}",
        f"VENV_CPU={tmp_path / 'venv-cpu'}",
        f"VENV_LINT={tmp_path / 'venv-lint'}",
        f"MODEL_DIR={tmp_path / 'model'}",
        f"PYTHON={sys.executable}",
    ]


def _make_vars(env: dict[str, str], tmp_path: Path, *names: str, extra: tuple[str, ...] = ()) -> list[str]:
    out = _make(env, "-s", "--eval", "print-%: ; @echo '$($*)'", *[f"print-{n}" for n in names],
                *_paths(tmp_path), *extra).stdout  # fmt: skip
    return out.splitlines()


def _pip_installs(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.search(r"/bin/pip install ", line)]


# --- scripts/torch_cpu_source.py ---------------------------------------------------------------------------


def test_torch_source_uses_pips_sources_when_find_links_have_the_wheel(tmp_path):
    proc = _source(_with_torch(tmp_path))
    assert proc.stdout.strip() == ""
    assert "find-links have it" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1  # one line saying which source


def test_torch_source_adds_pytorch_cpu_index_when_pip_lacks_the_wheel(tmp_path):
    proc = _source(_without_torch(tmp_path))
    assert proc.stdout.split() == ["--extra-index-url", PYTORCH_CPU_INDEX]
    assert PYTORCH_CPU_INDEX in proc.stderr


def test_torch_source_wants_the_exact_version(tmp_path):
    links = _wheels(tmp_path, "torch-2.12.0+cpu-py3-none-any.whl", "torch-2.13.0-py3-none-any.whl")
    proc = _source(_env(PIP_FIND_LINKS=str(links)), "--index", "http://mirror.invalid/whl/cpu")
    assert proc.stdout.split() == ["--extra-index-url", "http://mirror.invalid/whl/cpu"]


# --- the Makefile (dry runs) ------------------------------------------------------------------------------


@pytest.mark.parametrize("has_torch", [True, False], ids=["pip-has-torch", "pip-lacks-torch"])
def test_venv_cpu_pip_installs_use_constraints_and_the_chosen_torch_source(tmp_path, has_torch):
    env = _with_torch(tmp_path) if has_torch else _without_torch(tmp_path)
    proc = _make(env, "-n", "venv-cpu", *_paths(tmp_path))
    installs = _pip_installs(proc.stdout)
    assert len(installs) == 2, proc.stdout
    for line in installs:
        assert "-c constraints.txt" in line
        assert f"-c {tmp_path / 'venv-cpu'}/constraints.txt" in line
        assert (f"--extra-index-url {PYTORCH_CPU_INDEX}" in line) is not has_torch
    assert f"torch=={CPU_TORCH}" in proc.stderr  # the one line saying which source
    # the per-env constraints written before installing: the CPU torch, and never `vllm` itself
    assert re.search(rf"printf .*torch=={re.escape(CPU_TORCH)} .*vllm===never-in-the-cpu-env", proc.stdout)


def test_torch_cpu_index_can_be_overridden_or_emptied(tmp_path):
    env = _without_torch(tmp_path)
    other = "http://mirror.invalid/pytorch/cpu"
    installs = _pip_installs(_make(env, "-n", "venv-cpu", *_paths(tmp_path), f"TORCH_CPU_INDEX={other}").stdout)
    assert installs and all(f"--extra-index-url {other}" in line for line in installs)
    installs = _pip_installs(_make(env, "-n", "venv-cpu", *_paths(tmp_path), "TORCH_CPU_INDEX=").stdout)
    assert installs and not any("--extra-index-url" in line for line in installs)


def test_every_make_pip_install_uses_the_constraints(tmp_path):
    proc = _make(_without_torch(tmp_path), "-n", "venv", "venv-lint", "venv-cpu", *_paths(tmp_path))
    installs = _pip_installs(proc.stdout)
    assert len(installs) == 5, proc.stdout  # 2 in .venv, 1 in .venv-lint, 2 in .venv-cpu
    assert all("-c constraints.txt" in line for line in installs)
    # the PyTorch CPU index only ever goes to .venv-cpu (.venv needs the CUDA torch from PyPI)
    assert all(f"{tmp_path / 'venv-cpu'}/bin/pip" in line for line in installs if "--extra-index-url" in line)


def test_make_test_lints_first_in_its_own_env_then_unit_then_e2e(tmp_path):
    out = _make(_with_torch(tmp_path), "-n", "test", *_paths(tmp_path)).stdout
    lint_env = out.index(f"-m venv {tmp_path / 'venv-lint'}")
    lint = out.index(f"{tmp_path / 'venv-lint'}/bin/ruff check .")
    vllm_env = out.index(f"-m venv {tmp_path / 'venv'}\n")
    unit = out.index('-m pytest -m "not e2e and not vllm_cpu"')
    e2e = out.index('-m pytest -m "e2e or vllm_cpu"')
    # lint (env and run) before anything builds the vLLM envs; the stages in order
    assert lint_env < lint < vllm_env < unit < e2e


def test_stamp_keys_cover_the_constraints(tmp_path):
    env = _env()
    names = ("VENV_STAMP", "CPU_STAMP", "LINT_STAMP")
    edited = tmp_path / "constraints-edited.txt"
    edited.write_text((REPO / "constraints.txt").read_text() + "pytest==0.0.0\n")
    before = _make_vars(env, tmp_path, *names)
    after = _make_vars(env, tmp_path, *names, extra=(f"CONSTRAINTS={edited}",))
    assert len(before) == len(after) == 3
    assert all(a != b for a, b in zip(before, after, strict=True))


def test_vllm_versions_come_from_the_constraints_file(tmp_path):
    env = _env()
    pins = dict(
        line.split("==", 1)
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert _make_vars(env, tmp_path, "VLLM_VERSION", "VLLM_CPU_VERSION") == [pins["vllm"], pins["vllm-cpu"]]
    assert "ruff" in pins  # .venv-lint installs ruff pinned
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    proc = _make(env, "-n", "help", f"CONSTRAINTS={empty}", check=False)
    assert proc.returncode != 0 and "has no vllm==VERSION line" in proc.stderr


# --- the pytest stages: an empty stage fails --------------------------------------------------------------


def _fake_envs(tmp_path: Path) -> dict[str, str]:
    """Stamp files in place (so make builds nothing) and a fake Python that exits with $FAKE_PYTEST_RC."""
    env = _env()
    for stamp in _make_vars(env, tmp_path, "VENV_STAMP", "CPU_STAMP", "MODEL_STAMP"):
        path = Path(stamp)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    for venv in ("venv", "venv-cpu"):
        python = tmp_path / venv / "bin" / "python"
        python.parent.mkdir(parents=True, exist_ok=True)
        python.write_text('#!/bin/sh\nexit "$FAKE_PYTEST_RC"\n')
        python.chmod(0o755)
    return env


@pytest.mark.parametrize("stage", ["test-unit", "test-e2e"])
@pytest.mark.parametrize("rc", [0, 1, 5])
def test_pytest_stage_fails_on_any_error_and_on_no_tests_collected(tmp_path, stage, rc):
    env = _fake_envs(tmp_path)
    env["FAKE_PYTEST_RC"] = str(rc)
    proc = _make(env, stage, *_paths(tmp_path), check=False)
    assert (proc.returncode == 0) is (rc == 0), proc.stdout + proc.stderr
    assert ("collected no tests" in proc.stdout) is (rc == 5)

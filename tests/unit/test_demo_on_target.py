"""`make demo` calibrates over the lengths it serves (issue #67 item 3): its calibration's longest prompt is the
server's --max-model-len, and a served prompt outside the calibrated lengths is named. No engine, no server."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "scripts" / "demo.py"


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("demo_under_test", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_calibration_reaches_the_served_max_model_len(demo, tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(demo.subprocess, "run", lambda cmd, **kw: seen.setdefault("calibrate", cmd))
    demo.calibrate("python", tmp_path / "ckpt", tmp_path, 0.5)
    monkeypatch.setattr(demo, "running_server", lambda cmd, *a: seen.setdefault("serve", cmd))
    demo.serve("python", tmp_path / "ckpt", 1, tmp_path / "log", [], 1.0)
    longest, served = int(_flag(seen["calibrate"], "--calib_max_seqlen")), int(_flag(seen["serve"], "--max-model-len"))
    assert longest == served == demo.MAX_MODEL_LEN
    # the long prompt (1672 SmolLM2 tokens; over 4 characters per token) lies below the longest calibration bin
    prompt = demo.long_prompt()
    assert demo.LONG_PROMPT_CHARS <= len(prompt) < demo.LONG_PROMPT_CHARS + 500 and len(prompt) / 4 < longest


def test_prompt_outside_the_calibrated_lengths_is_named(demo):
    lengths = {"prefill": (508, 2048), "decode": (509, 2055)}
    assert demo.outside_note(1697, lengths) == ""
    assert demo.outside_note(5, lengths) == ""  # one tile: nothing to skip, nothing to say
    assert demo.outside_note(None, lengths) == "" and demo.outside_note(1697, {}) == ""
    assert "outside the calibrated 124..1017" in demo.outside_note(1697, {"prefill": (124, 1017)})

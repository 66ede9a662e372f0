#!/usr/bin/env python3
"""Offline kit: carry vLLM and this plugin to a GPU machine that has no network (issue #68).

The lent GPU machine (one H100/H200, Python 3.12, torch 2.11.0+cu130, Triton 3.6.0) has no vLLM and no package
index. Each call to it carries at most 64 MiB of files from this working tree (8 carried paths), and what one call
leaves there survives only while the machine stays warm (about 30 s idle). So a vLLM install has to travel as
byte parts over several back-to-back calls, be verified and reassembled there, and install with pip offline.

    build     resolve vLLM (the release in the supported range that pins the GPU's torch) + modelopt-ext against
              what the GPU machine already has (scripts/gpu_machine_packages.txt), download the missing wheels
              (cp312 manylinux x86_64), build modelopt-ext's wheel, split all of it into parts + manifest.json
    receive   (GPU side, every call) verify the carried parts and move them to a folder the next call keeps
    assemble  parts -> wheels, every sha256 checked; a missing or corrupt part fails naming it
    install   pip install --no-index --find-links WHEELS vllm==V modelopt-ext (this interpreter or --target-venv)
    plan      the sequence of device calls and their exact commands
    rehearse  the whole path on this CPU machine in a clean venv (`make gpu-kit-rehearsal`)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

LOG = logging.getLogger("gpu_kit")
REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20
GPU_TORCH = "2.11.0"
# Releases in the supported range (pyproject's vllm extra, >=0.16,<0.34) that pin torch==2.11.0, from their PyPI
# metadata (the project's reading of vLLM releases): 0.20.2, 0.21.0, 0.22.1, 0.23.0, 0.24.0, 0.25.1, 0.26.0.
# 0.25.1 is the newest of them that docs/vllm_matrix.md ran (PASS, torch 2.11.0+cu130); 0.26.0 was never run.
DEFAULT_VLLM = "0.25.1"
PART_MIB = 56  # <= 60; a call also carries the working tree (~4 MiB), and 64 MiB is the whole call's limit
CALL_MIB = 64
MAX_CARRY = 8
# On the GPU machine, <kit>/recv holds the parts of earlier calls: ignored and never carried, so kept while warm.
# The GPU machine's Python 3.12.3 is Ubuntu 24.04's (glibc 2.39), so wheels up to manylinux_2_39 run there; pip
# matches each tag exactly, so every one is named (llguidance 1.7, say, ships only manylinux_2_31).
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(39, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


class KitError(RuntimeError):
    """A kit that cannot be built, carried or installed as asked; the message says which piece and why."""


@dataclass(frozen=True)
class Preinstalled:
    name: str
    version: str
    known: bool


def norm(name: str) -> str:
    """PEP 503 normalized project name."""
    return "-".join(name.lower().replace("_", "-").replace(".", "-").split("-"))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def read_preinstalled(path: Path) -> list[Preinstalled]:
    """`name==version  # known|assumed: ...` lines; anything else but comments and blanks is an error."""
    out = []
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        spec, _, comment = raw.partition("#")
        spec = spec.strip()
        if not spec:
            continue
        name, sep, version = spec.partition("==")
        tag = comment.strip().split(":", 1)[0].strip()
        if not sep or not name.strip() or not version.strip() or tag not in ("known", "assumed"):
            raise KitError(f"{path}:{lineno}: expected 'name==version  # known|assumed: ...', got {raw!r}")
        out.append(Preinstalled(norm(name.strip()), version.strip(), tag == "known"))
    return out


# ----------------------------------------------------------------------------------------------- split / join


def pack(files: list[Path], out: Path, part_bytes: int, meta: dict) -> dict:
    """Write `files` as one byte stream cut into parts of at most `part_bytes` (a big wheel spans parts, small ones
    share them) under out/parts, and out/manifest.json with the sha256 of every part and of every whole file."""
    if part_bytes <= 0:
        raise KitError("part size must be positive")
    parts_dir = out / "parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    for old in parts_dir.glob("part-*.bin"):
        old.unlink()
    entries, parts, offset = [], [], 0
    cur, cur_hash, cur_size = None, None, 0

    def close_part():
        if cur is not None:
            cur.close()
            parts.append({"name": Path(cur.name).name, "size": cur_size, "sha256": cur_hash.hexdigest()})

    for path in files:
        size = path.stat().st_size
        entries.append({"name": path.name, "size": size, "offset": offset, "sha256": sha256_file(path)})
        offset += size
        with path.open("rb") as src:
            while block := src.read(min(MIB, part_bytes)):
                while block:
                    if cur is None or cur_size == part_bytes:
                        close_part()
                        cur = (parts_dir / f"part-{len(parts):03d}.bin").open("wb")
                        cur_hash, cur_size = hashlib.sha256(), 0
                    take = block[: part_bytes - cur_size]
                    cur.write(take)
                    cur_hash.update(take)
                    cur_size += len(take)
                    block = block[len(take):]
    close_part()
    manifest = {"format": 1, **meta, "part_bytes": part_bytes, "total_bytes": offset, "parts": parts,
                "files": entries}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def check_parts(manifest: dict, parts_dir: Path, names: list[str] | None = None) -> list[str]:
    """Problems with the parts in `parts_dir` (all of the manifest's, or `names`): missing, wrong size, wrong sha."""
    problems = []
    for part in manifest["parts"]:
        if names is not None and part["name"] not in names:
            continue
        path = parts_dir / part["name"]
        if not path.is_file():
            problems.append(f"{part['name']}: missing")
        elif path.stat().st_size != part["size"]:
            problems.append(f"{part['name']}: {path.stat().st_size} bytes, manifest says {part['size']}")
        elif sha256_file(path) != part["sha256"]:
            problems.append(f"{part['name']}: sha256 differs from the manifest (corrupt)")
    return problems


def assemble(manifest: dict, parts_dir: Path, out: Path) -> list[Path]:
    """Rebuild every file of the manifest from the parts; raises KitError naming each missing/corrupt part or file."""
    problems = check_parts(manifest, parts_dir)
    if problems:
        raise KitError("cannot assemble the kit: " + "; ".join(problems))
    out.mkdir(parents=True, exist_ok=True)
    parts = iter(manifest["parts"])
    src, left = None, 0
    written = []
    for entry in manifest["files"]:
        dest, h, need = out / entry["name"], hashlib.sha256(), entry["size"]
        with dest.open("wb") as f:
            while need:
                if left == 0:
                    if src:
                        src.close()
                    part = next(parts)
                    src, left = (parts_dir / part["name"]).open("rb"), part["size"]
                block = src.read(min(need, left, 8 * MIB))
                f.write(block)
                h.update(block)
                need -= len(block)
                left -= len(block)
        if h.hexdigest() != entry["sha256"]:
            raise KitError(f"{entry['name']}: sha256 of the reassembled file differs from the manifest")
        written.append(dest)
    if src:
        src.close()
    return written


# ----------------------------------------------------------------------------------------------------- plan


def tree_bytes(repo: Path = REPO) -> int:
    """Bytes of the working tree that travels with every call (tracked + untracked-not-ignored files)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         check=True, capture_output=True).stdout
    return sum((repo / p).stat().st_size for p in out.decode().split("\0") if p and (repo / p).is_file())


def plan_calls(manifest: dict, tree: int, call_bytes: int = CALL_MIB * MIB, max_carry: int = MAX_CARRY) -> list[list]:
    """Group the parts into device calls: each call carries the manifest and at most `max_carry - 1` parts, and
    the tree plus what it carries stays within `call_bytes`."""
    man_bytes = len(json.dumps(manifest, indent=1)) + 1
    budget = call_bytes - tree - man_bytes
    calls, cur, used = [], [], 0
    for part in manifest["parts"]:
        if part["size"] > budget:
            raise KitError(f"{part['name']} ({part['size']} bytes) cannot travel: a call has {budget} bytes left "
                           f"after the working tree ({tree}) and the manifest; build with a smaller --part-mib")
        if cur and (used + part["size"] > budget or len(cur) == max_carry - 1):
            calls.append(cur)
            cur, used = [], 0
        cur.append(part["name"])
        used += part["size"]
    if cur:
        calls.append(cur)
    return calls


def call_commands(manifest: dict, calls: list[list], engine_args: str = "") -> list[dict]:
    """The `run` arguments of each call: every call receives its parts; the last one with parts also assembles and
    installs; one more call (nothing carried) runs the engine check, so neither command nears the 10-minute cap."""
    out = []
    for i, names in enumerate(calls):
        carry = [".kit/manifest.json"] + [f".kit/parts/{n}" for n in names]
        cmd = f"python3 scripts/gpu_kit.py receive --kit .kit --expect-before {sum(len(c) for c in calls[:i])}"
        if i == len(calls) - 1:
            cmd = ("set -o pipefail; " + cmd + " && python3 scripts/gpu_kit.py assemble --parts .kit/recv --out "
                   "/tmp/kit-wheels && python3 scripts/gpu_kit.py install --wheels /tmp/kit-wheels 2>&1 | tee "
                   "$OUT/install.log")
        out.append({"call": i + 1, "carry": carry, "command": cmd, "timeout_s": 120 if i < len(calls) - 1 else 420,
                    "carry_bytes": sum(p["size"] for p in manifest["parts"] if p["name"] in names)})
    engine = ("set -o pipefail; export PYTHONUNBUFFERED=1; python3 -c 'import vllm' && python3 "
              f"scripts/gpu_engine_check.py --out /tmp/engine {engine_args}".rstrip() + " 2>&1 | tee $OUT/engine.log;"
              " rc=$?; cp /tmp/engine/engine_check.json /tmp/engine/server_*.log $OUT/; exit $rc")  # 4 files back
    out.append({"call": len(calls) + 1, "carry": [], "command": engine, "timeout_s": 540, "carry_bytes": 0})
    return out


# ------------------------------------------------------------------------------------------------------ build


def pip_cmd(python: str) -> list[str]:
    return [python, "-m", "pip", "--disable-pip-version-check"]


def target_flags(py_version: str) -> list[str]:
    flags = ["--only-binary=:all:", "--python-version", py_version, "--implementation", "cp"]
    for plat in PLATFORMS:
        flags += ["--platform", plat]
    return flags


TARGET_MARKERS = {"sys_platform": "linux", "platform_machine": "x86_64", "platform_system": "Linux", "os_name": "posix",
                  "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def fetch_metadata(python: str, specs: list[str], py_version: str, work: Path) -> dict[str, dict]:
    """The index's metadata (name, version, requires_dist, provides_extra) of each spec, nothing installed: one pip
    dry-run for all, else one per spec so that a spec the index lacks costs only itself (missing from the result)."""
    def run(batch: list[str]) -> dict[str, dict] | None:
        report = work / "metadata.json"
        cmd = pip_cmd(python) + ["install", "--dry-run", "--quiet", "--no-deps", "--ignore-installed", "--target",
                                 str(work / "unused"), "--report", str(report), *target_flags(py_version), *batch]
        if subprocess.run(cmd, capture_output=True, text=True).returncode:
            return None
        return {norm(i["metadata"]["name"]): i["metadata"] for i in json.loads(report.read_text())["install"]}

    found = run(specs) if specs else {}
    if found is None:
        found = {}
        for spec in specs:
            found.update(run([spec]) or {})
    return found


def requirements_for_target(meta: dict, extras: set[str], py_version: str) -> list:
    """`meta`'s Requires-Dist (packaging Requirements) that apply on the GPU machine with `extras` asked."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip's own copy
        from pip._vendor.packaging.requirements import Requirement
    env = {**TARGET_MARKERS, "python_version": py_version, "python_full_version": f"{py_version}.3"}
    out = []
    for line in meta.get("requires_dist") or []:
        req = Requirement(line)
        if not req.marker or any(req.marker.evaluate({**env, "extra": e}) for e in extras | {""}):
            out.append(req)
    return out


def narrow_names(items: list[dict], py_version: str) -> set[str]:
    """Names some resolved package asks for narrowly (==, ~=, or a range within one major version, such as
    numba's llvmlite<0.48,>=0.47): an unknown installed version is unlikely to fit, so they travel whatever
    their size."""
    out = set()
    for item in items:
        for req in requirements_for_target(item["metadata"], set(item.get("requested_extras") or []), py_version):
            ops = {s.operator: s.version for s in req.specifier}
            if {"==", "~=", "==="} & ops.keys() or (
                    "<" in ops and ">=" in ops and ops["<"].split(".")[0] == ops[">="].split(".")[0]):
                out.add(norm(req.name))
    return out


def exact_pins(meta: dict, extras: set[str], py_version: str) -> dict[str, tuple[str, set[str]]]:
    """What `meta`'s package pins exactly (==, also ==X.*) for the GPU machine, with the extras it asks of each."""
    out = {}
    for req in requirements_for_target(meta, extras, py_version):
        specs = list(req.specifier)
        if len(specs) == 1 and specs[0].operator == "==":
            out[norm(req.name)] = (str(specs[0]), set(req.extras))
    return out


def known_closure(python: str, pre: list[Preinstalled], py_version: str, work: Path) -> dict[str, dict]:
    """Metadata of the machine's `known` packages and, transitively, of what they pin exactly with the extras asked
    (torch 2.11.0 pins cuda-toolkit[cublas,...]==13.0.2, which pins each CUDA library): those are on the machine
    at those versions too. A pinned package the index lacks gets a stub without dependencies."""
    metas: dict[str, dict] = {}
    extras_of: dict[str, set[str]] = {}
    pending = {p.name: f"=={p.version}" for p in pre if p.known}
    while True:
        got = fetch_metadata(python, [f"{n}{spec}" for n, spec in pending.items()], py_version, work)
        for name, spec in pending.items():
            metas[name] = got.get(name) or {"name": name, "version": spec.lstrip("=").removesuffix(".*"),
                                            "requires_dist": []}
        pending, grew = {}, False
        for name, meta in list(metas.items()):
            for dep, (spec, extras) in exact_pins(meta, extras_of.get(name, set()), py_version).items():
                if not extras <= extras_of.setdefault(dep, set()):
                    extras_of[dep] |= extras
                    grew = True
                if dep not in metas:
                    pending[dep] = spec
        if not pending and not grew:
            return metas


def stub_env(python: str, metas: dict[str, dict], where: Path) -> str:
    """A venv whose site-packages holds metadata-only stubs (real name, version, Requires-Dist, Provides-Extra) of
    what the GPU machine has, so that pip resolves vLLM as it would there: keeping what satisfies, asking for what
    does not, and honouring what the installed packages themselves pin (torch's CUDA libraries)."""
    subprocess.run([python, "-m", "venv", "--without-pip", str(where)], check=True)
    stub_py = str(where / "bin" / "python")
    site = subprocess.run([stub_py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    for name, meta in metas.items():
        info = Path(site) / f"{name.replace('-', '_')}-{meta['version']}.dist-info"
        info.mkdir(parents=True)
        lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {meta['version']}"]
        lines += [f"Provides-Extra: {e}" for e in meta.get("provides_extra") or []]
        lines += [f"Requires-Dist: {r}" for r in meta.get("requires_dist") or []]
        (info / "METADATA").write_text("\n".join(lines) + "\n")
        (info / "INSTALLER").write_text("gpu_kit stub\n")
        (info / "RECORD").write_text("")
    return stub_py


def resolve(python: str, stub_py: str, reqs: list[str], py_version: str, work: Path) -> list[dict]:
    """pip's own resolution (metadata only, nothing installed) of `reqs` for the GPU machine's Python."""
    report = work / "report.json"
    cmd = pip_cmd(python) + ["--python", stub_py, "install", "--dry-run", "--quiet", "--report", str(report),
                             *target_flags(py_version), *reqs]
    LOG.info("resolving %s for cp%s", " ".join(reqs), py_version.replace(".", ""))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise KitError(f"pip could not resolve {reqs} for Python {py_version}:\n{done.stderr[-3000:]}")
    return json.loads(report.read_text())["install"]


def torch_pin(vllm_item: dict) -> str | None:
    """The torch version the vLLM wheel pins (`torch==X` in its Requires-Dist), None without an exact pin."""
    for req in vllm_item["metadata"].get("requires_dist") or []:
        head = req.split(";")[0].replace(" ", "")
        if head.startswith("torch=="):
            return head.split("==", 1)[1]
    return None


def download(python: str, items: list[dict], dest: Path, py_version: str) -> list[Path]:
    """Download the resolved wheels (exact versions, no dependency walk) and check each against the index's hash."""
    dest.mkdir(parents=True, exist_ok=True)
    specs = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in items]
    LOG.info("downloading %d wheels into %s", len(specs), dest)
    subprocess.run(pip_cmd(python) + ["download", "--quiet", "--no-deps", *target_flags(py_version), "-d",
                                      str(dest), *specs], check=True)
    files = []
    for item in items:
        fname = item["download_info"]["url"].rsplit("/", 1)[-1]
        path = dest / fname
        want = (item["download_info"].get("archive_info") or {}).get("hashes", {}).get("sha256")
        if not path.is_file():
            raise KitError(f"pip download left no {fname}")
        if want and sha256_file(path) != want:
            raise KitError(f"{fname}: sha256 differs from the index's")
        files.append(path)
    return files


# Big wheels an engine for a Llama-geometry model on Hopper never loads, replaced by empty placeholder wheels of the
# same name and version so that vLLM's pins still resolve offline (`build --placeholder none` carries the real ones).
PLACEHOLDERS = {
    "flashinfer-cubin": "FlashInfer's prebuilt cubins (437 MiB); vllm never imports it, FlashInfer JIT-builds instead",
    "tokenspeed-triton": "a Triton fork for tokenspeed-mla (MLA models only), imported lazily",
    "tilelang": "TileLang kernels (DeepSeek sparse attention), imported lazily; takes z3-solver along",
    "pynvvideocodec": "GPU video decoding for multimodal inputs, imported lazily",
    "cuda-tile": "cuTile (FlashInfer's all-gather matmul only); takes CUDA 13.2 nvcc/nvvm/tileiras wheels along "
                 "(138 MiB), where the image has its own nvcc",
    "nvidia-cuda-nvcc": "the CUDA 13.5 compiler humming-kernels[cu13] asks for (JIT kernels vLLM imports lazily); "
                        "takes nvidia-nvvm along (116 MiB together), where the image has its own nvcc 13.0",
}


def placeholder_wheel(name: str, version: str, why: str, dest: Path) -> Path:
    """An empty wheel `name==version` (no modules, no dependencies) whose METADATA says what it stands in for."""
    import zipfile

    dist = name.replace("-", "_")
    path = dest / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 f"Summary: gpu_kit placeholder, not the real package: {why}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: gpu_kit\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for n, text in {**files, f"{info}/RECORD": record}.items():
            zf.writestr(n, text)
    return path


def build_own_wheel(python: str, dest: Path) -> Path:
    """modelopt-ext's wheel from this checkout (`pip wheel --no-deps .`)."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    subprocess.run(pip_cmd(python) + ["wheel", "--quiet", "--no-deps", "-w", str(dest),
                                      str(REPO)], check=True)
    wheels = sorted(dest.glob("modelopt_ext-*.whl"))
    if len(wheels) != 1:
        raise KitError(f"expected one modelopt_ext wheel in {dest}, found {wheels}")
    return wheels[0]


def select(items: list[dict], pre: list[Preinstalled], files: dict[str, Path], hedge_bytes: int, narrow: set[str]):
    """Split the resolution into what travels and what is left out: an `assumed` package travels as a hedge when
    something asks for it narrowly or its wheel is at most `hedge_bytes` (pip keeps the machine's copy when that
    satisfies)."""
    assumed = {p.name: p.version for p in pre if not p.known}
    carried, left_out = [], []
    for item in items:
        name, version = norm(item["metadata"]["name"]), item["metadata"]["version"]
        path = files[name]
        if name in assumed and name not in narrow and path.stat().st_size > hedge_bytes:
            left_out.append({"name": name, "version": version, "bytes": path.stat().st_size,
                             "reason": "assumed on the GPU machine, asked for broadly; wheel too big to hedge"})
        else:
            carried.append(path)
    return carried, left_out


def check_pip(python: str) -> None:
    """Resolving for another platform without installing (--dry-run with --platform, no --target) needs pip >= 24."""
    version = subprocess.run(pip_cmd(python) + ["--version"], check=True, capture_output=True, text=True).stdout
    if int(version.split()[1].split(".")[0]) < 24:
        raise KitError(f"{version.strip()}: build needs pip >= 24 (python -m pip install -U 'pip>=24', or run it "
                       "as `make gpu-kit-rehearsal` does, from .kit/tool)")


def cmd_build(args) -> int:
    check_pip(sys.executable)
    out, work = Path(args.out), Path(args.out) / "work"
    work.mkdir(parents=True, exist_ok=True)
    pre = read_preinstalled(Path(args.preinstalled))
    own = build_own_wheel(sys.executable, out / "own")
    stub_python = args.stub_python or find_python(args.python_version)
    if not stub_python:  # pip evaluates markers (python_version > "3.11") with the interpreter it resolves for
        raise KitError(f"no Python {args.python_version} here (PATH, pyenv, uv) for the resolver's stub venv: pass "
                       "--stub-python, or build for the Python you have (--python-version)")
    metas = known_closure(sys.executable, pre, args.python_version, work)
    (work / "machine_closure.json").write_text(json.dumps({n: m["version"] for n, m in metas.items()}, indent=1))
    reqs = [f"vllm=={args.vllm}", str(own)]
    placeholders = [] if args.placeholder == ["none"] else (args.placeholder or list(PLACEHOLDERS))
    with tempfile.TemporaryDirectory() as tmp:
        stub_py = stub_env(stub_python, metas, Path(tmp) / "stub")
        items = resolve(sys.executable, stub_py, reqs, args.python_version, work)
        stand_ins = [placeholder_wheel(norm(i["metadata"]["name"]), i["metadata"]["version"],
                                       PLACEHOLDERS.get(norm(i["metadata"]["name"]), "asked for"), out / "own")
                     for i in items if norm(i["metadata"]["name"]) in placeholders]
        if stand_ins:  # again, with the placeholders as given: what only the real ones needed drops out
            items = resolve(sys.executable, stub_py, reqs + [str(w) for w in stand_ins], args.python_version, work)
    vllm_item = next(i for i in items if norm(i["metadata"]["name"]) == "vllm")
    pin = torch_pin(vllm_item)
    if pin != args.torch and not args.allow_torch_mismatch:
        raise KitError(f"vllm=={args.vllm} pins torch=={pin}, the GPU machine has torch {args.torch}: pick a "
                       "release that pins it (0.20.2-0.26.0 do) or pass --allow-torch-mismatch")
    remote = [i for i in items if not i.get("is_direct")]
    paths = download(sys.executable, remote, out / "wheels", args.python_version)
    files = {norm(i["metadata"]["name"]): p for i, p in zip(remote, paths, strict=True)}
    files["modelopt-ext"] = own
    files.update({norm(w.name.split("-")[0]): w for w in stand_ins})
    carried, left_out = select(items, pre, files, int(args.hedge_mib * MIB), narrow_names(items, args.python_version))
    carried.sort(key=lambda p: p.name.lower())
    meta = {"vllm": args.vllm, "torch_pin": pin, "python": args.python_version,
            "placeholders": {norm(w.name.split("-")[0]): PLACEHOLDERS.get(norm(w.name.split("-")[0]), "asked for")
                             for w in stand_ins},
            "requirements": [f"vllm=={args.vllm}", "modelopt-ext"], "left_out": left_out,
            "preinstalled_file": str(Path(args.preinstalled)), "built": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                          time.gmtime())}
    manifest = pack(carried, out, int(args.part_mib * MIB), meta)
    print(f"kit: vllm=={args.vllm} (pins torch=={pin}) for cp{args.python_version.replace('.', '')}: "
          f"{len(carried)} wheels, {manifest['total_bytes'] / MIB:.1f} MiB in {len(manifest['parts'])} parts "
          f"of <= {args.part_mib} MiB; placeholders: {', '.join(meta['placeholders']) or '-'}; left out (assumed "
          f"there): {', '.join(e['name'] for e in left_out) or '-'}")
    return 0


def load_manifest(kit: Path) -> dict:
    path = kit / "manifest.json" if kit.is_dir() else kit
    if not path.is_file():
        raise KitError(f"no manifest at {path}: build the kit first (scripts/gpu_kit.py build)")
    return json.loads(path.read_text())


def cmd_receive(args) -> int:
    """GPU side of every call: check this call's parts, move them into RECV, and fail loudly when parts of earlier
    calls are gone (the machine went cold between calls: start again from call 1)."""
    kit = Path(args.kit)
    manifest = load_manifest(kit)
    recv = kit / "recv"
    recv.mkdir(parents=True, exist_ok=True)
    here = sorted(p.name for p in (kit / "parts").glob("part-*.bin"))
    problems = check_parts(manifest, kit / "parts", here)
    if problems:
        raise KitError("carried parts are damaged: " + "; ".join(problems))
    for name in here:
        os.replace(kit / "parts" / name, recv / name)
    earlier = [p["name"] for p in manifest["parts"][: args.expect_before]]
    gone = [n for n in earlier if not (recv / n).is_file()]
    have = sum(1 for p in manifest["parts"] if (recv / p["name"]).is_file())
    print(f"received {len(here)} part(s); {have}/{len(manifest['parts'])} parts on this machine")
    if gone:
        raise KitError(f"{len(gone)} part(s) of earlier calls are gone ({gone[0]}...): this is a fresh machine; "
                       "restart the sequence from call 1 (scripts/gpu_kit.py plan)")
    return 0


def cmd_assemble(args) -> int:
    parts = Path(args.parts)
    manifest = load_manifest(Path(args.manifest) if args.manifest else parts.parent)
    start = time.monotonic()
    written = assemble(manifest, parts, Path(args.out))
    (Path(args.out) / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"assembled {len(written)} files ({manifest['total_bytes'] / MIB:.1f} MiB) into {args.out}, all sha256 "
          f"verified, in {time.monotonic() - start:.1f} s")
    return 0


def cmd_install(args) -> int:
    """pip install from the reassembled wheels only (--no-index): into this interpreter or --target-venv."""
    wheels = Path(args.wheels)
    manifest_path = wheels / "manifest.json"
    reqs = args.requirement or (json.loads(manifest_path.read_text())["requirements"] if manifest_path.is_file()
                                else ["vllm", "modelopt-ext"])
    python = sys.executable
    if args.target_venv:
        venv = Path(args.target_venv)
        if not (venv / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        python = str(venv / "bin" / "python")
    cmd = pip_cmd(python) + ["install", "--no-index", "--find-links", str(wheels), *reqs]
    LOG.info("%s", " ".join(cmd))
    start = time.monotonic()
    if subprocess.run(cmd).returncode:
        raise KitError("the offline install failed: the line above names the requirement the kit lacks (a "
                       "'left_out' package of the manifest, or one the GPU machine has in another version)")
    print(f"installed {' '.join(reqs)} offline in {time.monotonic() - start:.1f} s")
    return 0


def cmd_plan(args) -> int:
    manifest = load_manifest(Path(args.kit))
    tree = tree_bytes()
    calls = call_commands(manifest, plan_calls(manifest, tree, int(args.call_mib * MIB)), args.engine_args)
    print(f"kit: vllm=={manifest['vllm']}, {len(manifest['files'])} files, {manifest['total_bytes'] / MIB:.1f} MiB, "
          f"{len(manifest['parts'])} parts; working tree {tree / MIB:.1f} MiB travels with every call")
    print(f"{len(calls)} device calls ({len(calls) - 1} carrying parts, then the engine check), back to back: a "
          "machine idle for ~30 s is given back, and the parts and installs on it are lost")
    for call in calls:
        total = (tree + call["carry_bytes"]) / MIB
        print(f"\n# call {call['call']}/{len(calls)}: {len(call['carry'])} carry paths, {total:.1f} MiB travel")
        print(json.dumps({k: call[k] for k in ("command", "carry", "timeout_s")}))
    return 0


# --------------------------------------------------------------------------------------------------- rehearse


def find_python(version: str) -> str | None:
    """An interpreter of `version` on this machine: pythonX.Y on PATH, pyenv's, or uv's; None when there is none."""
    import glob
    import shutil

    root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    candidates = [shutil.which(f"python{version}")] + sorted(glob.glob(f"{root}/versions/{version}*/bin/python3"))
    if shutil.which("uv"):
        found = subprocess.run(["uv", "python", "find", version], capture_output=True, text=True)
        candidates.append(found.stdout.strip() if found.returncode == 0 else None)
    for cand in filter(None, candidates):
        probe = subprocess.run([cand, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return cand
    return None


def torch_stand_ins(pre: list[Preinstalled]) -> tuple[list[str], list[str]]:
    """The rehearsal's stand-in for torch 2.11.0+cu130 and its pinned CUDA libraries (importable without a GPU):
    (specs, notes). This machine's PyPI lacks nvidia-nccl-cu13==2.28.9 (torch 2.11.0's pin), so 2.32.6 (same
    libnccl.so.2; 2.27.7 lacks symbols torch 2.11.0 links, ncclDevCommDestroy) stands in for it and is relabelled
    2.28.9 afterwards, rehearsal only."""
    specs = ["cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.0.2"]
    notes = []
    for p in pre:
        if p.name.startswith("nvidia-") and p.known:
            if p.name == "nvidia-nccl-cu13" and p.version == "2.28.9":
                specs.append("nvidia-nccl-cu13==2.32.6")
                notes.append("nvidia-nccl-cu13 2.28.9 is not on this PyPI: 2.32.6 installed and relabelled 2.28.9")
            else:
                specs.append(f"{p.name}=={p.version}")
    return specs, notes


def relabel(python: str, name: str, old: str, new: str) -> None:
    """Make an installed distribution report another version (the rehearsal's nccl stand-in)."""
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    info = Path(site) / f"{name.replace('-', '_')}-{old}.dist-info"
    meta = info / "METADATA"
    meta.write_text(meta.read_text().replace(f"\nVersion: {old}\n", f"\nVersion: {new}\n", 1))
    info.rename(info.with_name(f"{name.replace('-', '_')}-{new}.dist-info"))


def install_stand_ins(python: str, pre: list[Preinstalled]) -> list[str]:
    """Install what the GPU machine is believed to have (every line of the preinstalled file), from PyPI."""
    pip = pip_cmd(python) + ["install", "--quiet"]
    torch = next(p for p in pre if p.name == "torch")
    subprocess.run(pip + ["--no-deps", f"torch=={torch.version}"], check=True)
    cuda, notes = torch_stand_ins(pre)
    subprocess.run(pip + ["--no-deps", *cuda], check=True)
    if any("relabelled" in n for n in notes):
        relabel(python, "nvidia-nccl-cu13", "2.32.6", "2.28.9")
    rest = [f"{p.name}=={p.version}" if p.known else p.name for p in pre  # assumed: whatever fits the known ones
            if p.name != "torch" and not p.name.startswith("nvidia-") and p.name != "cuda-toolkit"]
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as pins:
        pins.write(f"torch=={torch.version}\n")
        pins.flush()
        subprocess.run(pip + ["-c", pins.name, *rest], check=True)
    return notes


IMPORT_CHECK = """
import importlib.metadata as md, json, torch, vllm
import modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm as plugin
ep = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "modelopt_ext_sparse_attention"]
register = ep[0].load()
try:
    register()
    called = "register() ran"
except Exception as exc:  # CUDA calls aside: say what stopped it
    called = f"register() raised {type(exc).__name__}: {exc}"
print(json.dumps({"vllm": vllm.__version__, "torch": torch.__version__, "plugin": plugin.__name__,
                  "entry": ep[0].value, "register": called}))
"""


def cmd_rehearse(args) -> int:
    start = time.monotonic()
    manifest = load_manifest(Path(args.kit))
    python = args.python or find_python(manifest["python"])
    if not python:
        raise KitError(f"no Python {manifest['python']} here (PATH, pyenv, uv): build a kit for the Python you "
                       "have (build --python-version 3.11) and rehearse with that")
    venv = Path(args.venv)
    if venv.exists():
        subprocess.run(["rm", "-rf", str(venv)], check=True)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    vpy = str(venv / "bin" / "python")
    LOG.info("stand-ins for the GPU machine's packages into %s", venv)
    notes = install_stand_ins(vpy, read_preinstalled(Path(args.preinstalled)))
    t_assemble = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        recv = Path(tmp) / "recv"
        recv.mkdir()
        for part in manifest["parts"]:  # what the calls leave in <kit>/recv on the GPU machine
            os.link(Path(args.kit) / "parts" / part["name"], recv / part["name"])
        assemble(manifest, recv, Path(tmp) / "wheels")
        t_install = time.monotonic()
        before = set(pip_freeze(vpy))
        subprocess.run(pip_cmd(vpy) + ["install", "--quiet", "--no-index", "--find-links", str(Path(tmp) / "wheels"),
                                       *manifest["requirements"]], check=True)
        installed = sorted(set(pip_freeze(vpy)) - before)
    t_check = time.monotonic()
    check = subprocess.run([vpy, "-c", IMPORT_CHECK], capture_output=True, text=True,
                           env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    if check.returncode:
        raise KitError(f"import check failed in the rehearsal venv:\n{check.stderr[-3000:]}")
    calls = plan_calls(manifest, tree_bytes())
    result = {"python": python, "kit_mib": round(manifest["total_bytes"] / MIB, 1), "files": len(manifest["files"]),
              "parts": len(manifest["parts"]), "device_calls": len(calls) + 1, "installed_from_kit": installed,
              "left_out": [e["name"] for e in manifest["left_out"]], "stand_in_notes": notes,
              "import_check": json.loads(check.stdout.strip().splitlines()[-1]),
              "seconds": {"stand_ins": round(t_assemble - start, 1), "assemble": round(t_install - t_assemble, 1),
                          "install": round(t_check - t_install, 1), "total": round(time.monotonic() - start, 1)}}
    Path(args.report).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


def pip_freeze(python: str) -> list[str]:
    out = subprocess.run(pip_cmd(python) + ["list", "--format=freeze"], check=True, capture_output=True, text=True)
    return out.stdout.split()


# ------------------------------------------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="resolve, download, split into parts + manifest")
    b.add_argument("--out", default=".kit")
    b.add_argument("--preinstalled", default=str(REPO / "scripts" / "gpu_machine_packages.txt"))
    b.add_argument("--vllm", default=DEFAULT_VLLM, help=f"vLLM release (default {DEFAULT_VLLM})")
    b.add_argument("--torch", default=GPU_TORCH, help="the GPU machine's torch; vLLM must pin exactly this")
    b.add_argument("--allow-torch-mismatch", action="store_true")
    b.add_argument("--python-version", default="3.12")
    b.add_argument("--stub-python", help="a Python of --python-version for the resolver's stub venv (pip "
                   "evaluates environment markers with it; default: found on PATH, pyenv or uv)")
    b.add_argument("--part-mib", type=float, default=PART_MIB)
    b.add_argument("--placeholder", action="append", help="carry an empty wheel for this package instead of "
                   f"the real one (repeatable; default: {', '.join(PLACEHOLDERS)}; 'none': none)")
    b.add_argument("--hedge-mib", type=float, default=2.0, help="carry an 'assumed' package up to this size")
    r = sub.add_parser("receive", help="(GPU side) verify this call's parts, keep them for the next call")
    r.add_argument("--kit", default=".kit")
    r.add_argument("--expect-before", type=int, default=0, help="parts earlier calls delivered")
    a = sub.add_parser("assemble", help="parts -> wheels, sha256 verified")
    a.add_argument("--parts", required=True)
    a.add_argument("--manifest", help="default: <parts>/../manifest.json")
    a.add_argument("--out", required=True)
    i = sub.add_parser("install", help="pip install --no-index from the wheels")
    i.add_argument("--wheels", required=True)
    i.add_argument("--target-venv", help="install there (created if missing) instead of this interpreter")
    i.add_argument("--requirement", action="append", help="default: the manifest's (vllm==V modelopt-ext)")
    p = sub.add_parser("plan", help="print the device calls")
    p.add_argument("--kit", default=".kit")
    p.add_argument("--call-mib", type=float, default=CALL_MIB)
    p.add_argument("--engine-args", default="--attention-backend FLASH_ATTN",
                   help="arguments of gpu_engine_check.py in the last call (default: vLLM's FlashAttention backend, "
                        "since FlashInfer without its cubin package would JIT-build its kernels first)")
    h = sub.add_parser("rehearse", help="the whole install on this CPU machine, in a clean venv")
    h.add_argument("--kit", default=".kit")
    h.add_argument("--python", help="interpreter of the kit's Python version (default: found)")
    h.add_argument("--venv", default=str(Path(tempfile.gettempdir()) / "gpu-kit-rehearsal"))
    h.add_argument("--preinstalled", default=str(REPO / "scripts" / "gpu_machine_packages.txt"))
    h.add_argument("--report", default=".kit/rehearsal.json")
    return ap


COMMANDS = {"build": cmd_build, "receive": cmd_receive, "assemble": cmd_assemble, "install": cmd_install,
            "plan": cmd_plan, "rehearse": cmd_rehearse}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="gpu_kit: %(message)s")
    args = parser().parse_args(argv)
    try:
        return COMMANDS[args.cmd](args)
    except KitError as exc:
        LOG.error("%s", exc)
        return 1
    except subprocess.CalledProcessError as exc:
        LOG.error("command failed (exit %s): %s", exc.returncode, " ".join(map(str, exc.cmd)))
        return 1


if __name__ == "__main__":
    sys.exit(main())

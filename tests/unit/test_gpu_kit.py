"""scripts/gpu_kit.py without network: split into parts and back, the manifest's hashes, the device-call plan, the
preinstalled file's format (small generated files; issue #68)."""

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("gpu_kit", REPO / "scripts" / "gpu_kit.py")
kit = importlib.util.module_from_spec(_SPEC)
sys.modules["gpu_kit"] = kit
_SPEC.loader.exec_module(kit)


def _files(tmp_path: Path, sizes: list[int]) -> list[Path]:
    rng = random.Random(68)
    src = tmp_path / "src"
    src.mkdir()
    out = []
    for i, size in enumerate(sizes):
        path = src / f"pkg{i}-1.0-py3-none-any.whl"
        path.write_bytes(rng.randbytes(size))
        out.append(path)
    return out


@pytest.mark.parametrize("sizes,part", [([5000, 10, 0, 777], 1024), ([3000], 1000), ([10, 20], 4096)])
def test_pack_then_assemble_gives_back_every_file(tmp_path, sizes, part):
    files = _files(tmp_path, sizes)
    manifest = kit.pack(files, tmp_path / "kit", part, {"vllm": "x"})
    assert manifest["total_bytes"] == sum(sizes)
    assert len(manifest["parts"]) == -(-sum(sizes) // part)
    assert all(p["size"] <= part for p in manifest["parts"])
    on_disk = json.loads((tmp_path / "kit" / "manifest.json").read_text())
    assert on_disk == manifest
    written = kit.assemble(manifest, tmp_path / "kit" / "parts", tmp_path / "out")
    assert [w.read_bytes() for w in written] == [f.read_bytes() for f in files]
    assert [e["sha256"] for e in manifest["files"]] == [kit.sha256_file(f) for f in files]


def test_a_big_file_spans_parts_and_small_ones_share_a_part(tmp_path):
    manifest = kit.pack(_files(tmp_path, [2500, 100, 100]), tmp_path / "kit", 1000, {})
    assert [p["size"] for p in manifest["parts"]] == [1000, 1000, 700]
    assert [e["offset"] for e in manifest["files"]] == [0, 2500, 2600]


def test_assemble_names_a_missing_part(tmp_path):
    manifest = kit.pack(_files(tmp_path, [3000]), tmp_path / "kit", 1000, {})
    (tmp_path / "kit" / "parts" / "part-001.bin").unlink()
    with pytest.raises(kit.KitError, match="part-001.bin: missing"):
        kit.assemble(manifest, tmp_path / "kit" / "parts", tmp_path / "out")


def test_assemble_names_a_corrupt_part(tmp_path):
    manifest = kit.pack(_files(tmp_path, [3000]), tmp_path / "kit", 1000, {})
    part = tmp_path / "kit" / "parts" / "part-002.bin"
    data = bytearray(part.read_bytes())
    data[7] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(kit.KitError, match="part-002.bin: sha256 differs"):
        kit.assemble(manifest, tmp_path / "kit" / "parts", tmp_path / "out")
    part.write_bytes(bytes(data[:-1]))
    with pytest.raises(kit.KitError, match="part-002.bin: 999 bytes"):
        kit.assemble(manifest, tmp_path / "kit" / "parts", tmp_path / "out")


def test_plan_keeps_every_call_within_the_limits(tmp_path):
    manifest = kit.pack(_files(tmp_path, [9000, 1500]), tmp_path / "kit", 1000, {})
    tree = 2000
    calls = kit.plan_calls(manifest, tree, call_bytes=6000, max_carry=4)
    sizes = {p["name"]: p["size"] for p in manifest["parts"]}
    assert [n for call in calls for n in call] == [p["name"] for p in manifest["parts"]]  # all, in order, once
    man = len(json.dumps(manifest, indent=1)) + 1
    for call in calls:
        assert len(call) + 1 <= 4  # + the manifest
        assert tree + man + sum(sizes[n] for n in call) <= 6000


def test_plan_refuses_a_part_that_cannot_travel(tmp_path):
    manifest = kit.pack(_files(tmp_path, [3000]), tmp_path / "kit", 3000, {})
    with pytest.raises(kit.KitError, match="cannot travel"):
        kit.plan_calls(manifest, tree=3000, call_bytes=4000)


def test_default_part_size_leaves_room_for_the_tree_and_the_manifest():
    assert kit.PART_MIB <= 60
    assert kit.PART_MIB * kit.MIB + kit.tree_bytes() + 200_000 <= kit.CALL_MIB * kit.MIB


def test_call_commands_receive_everywhere_and_install_in_the_last_call(tmp_path):
    manifest = kit.pack(_files(tmp_path, [3000]), tmp_path / "kit", 1000, {})
    cmds = kit.call_commands(manifest, [["part-000.bin"], ["part-001.bin", "part-002.bin"]])
    assert [c["carry"][0] for c in cmds[:2]] == [".kit/manifest.json"] * 2
    assert cmds[1]["carry"][1:] == [".kit/parts/part-001.bin", ".kit/parts/part-002.bin"]
    assert "--expect-before 0" in cmds[0]["command"] and "--expect-before 1" in cmds[1]["command"]
    assert "install" not in cmds[0]["command"]
    assert "assemble" in cmds[1]["command"] and "install" in cmds[1]["command"]
    assert cmds[2]["carry"] == [] and "gpu_engine_check.py" in cmds[2]["command"]  # one more call, nothing carried
    assert all(len(c["command"]) <= 2000 and len(c["carry"]) <= 8 and c["timeout_s"] <= 600 for c in cmds)


def test_receive_moves_parts_and_detects_a_fresh_machine(tmp_path):
    kitdir = tmp_path / ".kit"
    manifest = kit.pack(_files(tmp_path, [3000]), kitdir, 1000, {})
    assert len(manifest["parts"]) == 3
    (kitdir / "parts" / "part-001.bin").unlink()
    (kitdir / "parts" / "part-002.bin").unlink()
    args = kit.parser().parse_args(["receive", "--kit", str(kitdir), "--expect-before", "0"])
    assert kit.cmd_receive(args) == 0
    assert (kitdir / "recv" / "part-000.bin").is_file() and not (kitdir / "parts" / "part-000.bin").exists()
    (kitdir / "recv" / "part-000.bin").unlink()  # a machine that went cold: the first call's part is gone
    args = kit.parser().parse_args(["receive", "--kit", str(kitdir), "--expect-before", "1"])
    with pytest.raises(kit.KitError, match="fresh machine"):
        kit.cmd_receive(args)


def test_preinstalled_file_parses_and_marks_known_and_assumed(tmp_path):
    pre = kit.read_preinstalled(REPO / "scripts" / "gpu_machine_packages.txt")
    by_name = {p.name: p for p in pre}
    assert by_name["torch"].version == kit.GPU_TORCH and by_name["torch"].known
    assert by_name["triton"].version == "3.6.0"
    assert any(not p.known for p in pre)
    bad = tmp_path / "bad.txt"
    bad.write_text("numpy>=2  # known\n")
    with pytest.raises(kit.KitError, match="bad.txt:1"):
        kit.read_preinstalled(bad)


def test_torch_pin_reads_an_exact_pin_only():
    item = {"metadata": {"requires_dist": ["numpy", "torch == 2.11.0", "torchaudio==2.11.0"]}}
    assert kit.torch_pin(item) == "2.11.0"
    assert kit.torch_pin({"metadata": {"requires_dist": ["torch>=2.9"]}}) is None


def test_exact_pins_follow_markers_and_the_extras_asked():
    meta = {"requires_dist": ["nvidia-cublas==13.1.0.3.*; sys_platform == 'linux' and extra == 'cublas'",
                              "nvidia-cufft==12.0.0.61.*; extra == 'cufft'", "filelock",
                              "triton==3.6.0; platform_system == \"Linux\"", "pywin32==1; sys_platform == 'win32'",
                              "cuda-toolkit[cublas]==13.0.2"]}
    pins = kit.exact_pins(meta, {"cublas"}, "3.12")
    assert pins == {"nvidia-cublas": ("==13.1.0.3.*", set()), "triton": ("==3.6.0", set()),
                    "cuda-toolkit": ("==13.0.2", {"cublas"})}


def test_placeholder_wheel_is_an_empty_installable_wheel(tmp_path):
    import zipfile

    path = kit.placeholder_wheel("flashinfer-cubin", "0.6.13", "not needed", tmp_path)
    assert path.name == "flashinfer_cubin-0.6.13-py3-none-any.whl"
    with zipfile.ZipFile(path) as zf:
        names = set(zf.namelist())
        meta = zf.read("flashinfer_cubin-0.6.13.dist-info/METADATA").decode()
    assert names == {f"flashinfer_cubin-0.6.13.dist-info/{n}" for n in ("METADATA", "WHEEL", "RECORD")}
    assert "Name: flashinfer-cubin\nVersion: 0.6.13\n" in meta and "placeholder" in meta
    assert "Requires-Dist" not in meta


def test_narrow_names_are_pins_compatible_releases_and_one_major_ranges():
    items = [{"metadata": {"requires_dist": ["numba==0.65.0", "opencv-python-headless>=4.13.0", "pillow",
                                            "grpcio<2.0.0,>=1.63.2", "cuda-bindings~=13.4.4",
                                            "llvmlite<0.48,>=0.47.0dev0", "pywin32==311; sys_platform == 'win32'",
                                            "z3==1; extra == 'solver'"]}}]
    assert kit.narrow_names(items, "3.12") == {"numba", "cuda-bindings", "llvmlite"}

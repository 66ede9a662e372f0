"""One source for the contract (docs/skip_softmax.md): its numbers live in Python, and nothing repeats them by hand.

- `CONTRACT_VERSION` is defined once (modelopt_ext/torch/kernels/sparsity/contract_version.py, free of torch so the
  checkpoint side can import it); the kernels' semantics.py and the checkpoint's constants.py name that object.
- The compiled CPU kernel has no copy of TILE_K, SPLIT_TOKENS, DECISION_BLOCK_ROWS, RECENT_WINDOW or the version:
  cpu_kernel.py passes semantics.py's values as -D defines, they are part of the build key, and the built library
  reports them back.
- The documents that state the current version (the contract's title, README, design.md: the marker "the contract,
  version N") name the code's version, and the mtsa docstring names modules that exist.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from modelopt_ext.torch.kernels.sparsity import contract_version
from modelopt_ext.torch.kernels.sparsity.attention import cpu_kernel, semantics

REPO = Path(__file__).resolve().parents[3]
PACKAGE = REPO / "modelopt_ext"
CSRC = cpu_kernel.SOURCE.parent
# "the contract, version N" (one line) states the current version; "Why version 5", "version 4 at 0.7" and other
# historical mentions do not use it.
MARKER = re.compile(r"the contract, version (\d+)")
MARKED_DOCS = ("docs/skip_softmax.md", "README.md", "docs/design.md")


def test_contract_version_is_defined_once():
    """One literal; the other names (semantics, the checkpoint's constants) are that object. That the checkpoint side
    still imports without torch is test_sparse_attn_config_io.py's test_importable_without_vllm_torch_or_modelopt."""
    literals = [
        path.relative_to(REPO).as_posix()
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in path.read_text(encoding="utf-8").splitlines()
        if re.match(r"\s*CONTRACT_VERSION\s*(:[^=]*)?=\s*\d", line)
    ]
    assert literals == ["modelopt_ext/torch/kernels/sparsity/contract_version.py"]

    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint import constants

    assert semantics.CONTRACT_VERSION == constants.CONTRACT_VERSION == contract_version.CONTRACT_VERSION


@pytest.mark.parametrize("doc", MARKED_DOCS)
def test_documents_name_the_codes_contract_version(doc):
    text = (REPO / doc).read_text(encoding="utf-8")
    found = [(text.count("\n", 0, m.start()) + 1, int(m.group(1))) for m in MARKER.finditer(text)]
    assert found, f'{doc} no longer states the current contract version ("the contract, version N" on one line)'
    stale = [(line, v) for line, v in found if v != contract_version.CONTRACT_VERSION]
    assert not stale, f"{doc} names contract version(s) {stale} (line, version); the code's is " \
                      f"{contract_version.CONTRACT_VERSION}"  # fmt: skip


def test_the_contracts_title_names_its_version():
    first = (REPO / "docs/skip_softmax.md").read_text(encoding="utf-8").splitlines()[0]
    assert first == f"# Skip-softmax semantics (the contract, version {contract_version.CONTRACT_VERSION})"


def _csrc_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in [cpu_kernel.SOURCE, *cpu_kernel.headers()])


def test_csrc_takes_the_contract_numbers_from_semantics():
    """Every MODELOPT_EXT_* macro the C++ uses without defining it is one of semantics.py's contract numbers, and
    the contract's constants are those macros, not literals."""
    text = _csrc_text()
    used = set(re.findall(r"\bMODELOPT_EXT_([A-Z0-9_]+)", text))
    defined_here = set(re.findall(r"#define\s+MODELOPT_EXT_([A-Z0-9_]+)", text))
    assert used - defined_here == set(cpu_kernel.CONTRACT_NAMES)
    for cpp, name in [("kContractVersion", "CONTRACT_VERSION"), ("kTileK", "TILE_K"),
                      ("kSplitTokens", "SPLIT_TOKENS"), ("kDecisionRows", "DECISION_BLOCK_ROWS"),
                      ("kRecentWindow", "RECENT_WINDOW")]:  # fmt: skip
        assert re.findall(rf"constexpr\s+int\s+{cpp}\s*=\s*([^;]+);", text) == [f"MODELOPT_EXT_{name}"], cpp
    copies = re.findall(r"=\s*[\d.]+f?;\s*//\s*semantics\.\w+", text)  # the form the hand-written copies had
    assert not copies, copies


def test_contract_defines_are_semantics_values_and_part_of_the_build_key(monkeypatch):
    defines = cpu_kernel.contract_defines()
    assert defines == tuple(f"-DMODELOPT_EXT_{n}={getattr(semantics, n)}" for n in cpu_kernel.CONTRACT_NAMES)
    key = cpu_kernel.build_key()
    monkeypatch.setattr(semantics, "RECENT_WINDOW", semantics.RECENT_WINDOW + semantics.TILE_K)
    assert cpu_kernel.build_key() != key  # a changed number builds anew
    monkeypatch.undo()
    assert cpu_kernel.build_key() == key


def test_the_built_kernel_reports_semantics_numbers():
    reason = cpu_kernel.unavailable_reason()
    if reason is not None:
        pytest.skip(f"compiled CPU kernel unavailable: {reason}")
    assert cpu_kernel.compiled_contract() == {n: getattr(semantics, n) for n in cpu_kernel.CONTRACT_NAMES}


def test_mtsa_docstring_names_what_exists():
    import modelopt_ext.torch.sparsity.attention_sparsity as mtsa

    doc = mtsa.__doc__
    for name in re.findall(r"\bmtsa\.(\w+)", doc):
        assert name in mtsa.__all__, name
    submodules = re.findall(r"`((?:checkpoint|plugins|calibration|cli)(?:\.\w+)+)`", doc)
    assert submodules, "the docstring names the light submodules"
    for sub in submodules:
        assert importlib.util.find_spec(f"{mtsa.__name__}.{sub}") is not None, sub

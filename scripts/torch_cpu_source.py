#!/usr/bin/env python3
"""Print the pip arguments that let an environment find ``torch==<version>`` (the CPU wheel).

The Makefile calls this once when it builds .venv-cpu and appends what it prints to the pip commands
that may pull torch. If pip's configured sources (pip.conf / ``PIP_*`` variables: find-links,
index-url, extra-index-url) list the wheel, it prints nothing and pip installs as configured;
otherwise it prints ``--extra-index-url <index>`` (PyTorch's CPU wheel index by default). One line
on stderr says which source was chosen.

The question goes to pip itself (``pip index versions``: names and versions only, nothing is
downloaded), run by this interpreter so that pip filters wheels by this interpreter's tags: run it
with the target environment's Python (or the Python that creates it). First with ``--no-index``
(find-links only: a local folder needs no network), then, only if that finds nothing, with the
configured indexes under a short timeout and no retries. Any failure of either query (pip too old,
no pip, network down, timeout) counts as "not found", which adds the index: a needless
``--extra-index-url`` costs little, a missing one fails the install.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

DEFAULT_INDEX = "https://download.pytorch.org/whl/cpu"


def _norm(version: str) -> str:
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:
        try:
            from pip._vendor.packaging.version import InvalidVersion, Version
        except ImportError:
            return version.strip()
    try:
        return str(Version(version))
    except InvalidVersion:
        return version.strip()


def listed_versions(package: str, pip_args: list[str], timeout: float) -> set[str]:
    """Versions of ``package`` that pip's sources list for this interpreter (empty on any failure)."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", package, "--pre",
           "--disable-pip-version-check", "--retries", "0", "--timeout", "5", *pip_args]  # fmt: skip
    env = dict(os.environ, PIP_NO_INPUT="1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return set()
    if proc.returncode != 0:
        return set()
    for line in proc.stdout.splitlines():
        if line.startswith("Available versions:"):
            return {_norm(v) for v in line.partition(":")[2].split(",") if v.strip()}
    return set()


def choose(version: str, index: str, timeout: float) -> tuple[list[str], str]:
    """(pip arguments to add, one-line reason) for installing ``torch==version``."""
    want = _norm(version)
    if want in listed_versions("torch", ["--no-index"], timeout):
        return [], f"torch=={version}: from pip's configured sources (its find-links have it); no extra index"
    if want in listed_versions("torch", [], timeout):
        return [], f"torch=={version}: from pip's configured sources (its indexes have it); no extra index"
    if not index:
        return [], f"torch=={version}: not in pip's configured sources, and TORCH_CPU_INDEX is empty: no extra index"
    return ["--extra-index-url", index], (
        f"torch=={version}: not in pip's configured sources; from --extra-index-url {index} (TORCH_CPU_INDEX)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", required=True, help="torch version to find, e.g. 2.13.0+cpu")
    ap.add_argument("--index", default=DEFAULT_INDEX, help=f"index to add when pip lacks it (default {DEFAULT_INDEX})")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds each pip query may take (default 60)")
    args = ap.parse_args(argv)
    pip_args, reason = choose(args.version, args.index, args.timeout)
    print(f"make: {reason}", file=sys.stderr)
    print(" ".join(pip_args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

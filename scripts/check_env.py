#!/usr/bin/env python3
"""Check that a virtualenv already holds what the Makefile would install into it.

The Makefile calls this before installing anything, so an environment that is already right (for
example one created by hand with the same commands) is adopted instead of rebuilt, and after
installing, so a broken environment never gets a stamp. Exit status 0 means "satisfied".
Only the standard library is needed for the metadata checks; ``--import`` needs the real packages.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import re
import sys
import tomllib
from pathlib import Path


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _requirement_problems(dist_name: str, extras: set[str]) -> list[str]:
    """Direct requirements of ``dist_name`` (with ``extras``) that are missing or the wrong version."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # a bare venv: nothing useful is installed yet
        return ["packaging is not installed"]
    problems = []
    for line in md.requires(dist_name) or []:
        req = Requirement(line)
        if req.marker is not None:
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if not any(req.marker.evaluate(env) for env in envs):
                continue
        have = _installed(req.name)
        if have is None:
            problems.append(f"{req.name} is missing (needed by {dist_name})")
        elif req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{req.name} {have} does not satisfy {req} (needed by {dist_name})")
    return problems


def _constraint_problems(path: Path) -> list[str]:
    """Installed distributions named in a pip constraints file whose version it does not allow.

    A name it pins that is not installed is fine (one file serves several envs). Plain requirement lines
    only (``name<op>version``, optional ``; marker``); pip options and includes are ignored.
    """
    try:
        from packaging.requirements import Requirement
    except ImportError:  # a bare venv still has pip's copy
        try:
            from pip._vendor.packaging.requirements import Requirement
        except ImportError:
            return ["packaging is not installed"]
    problems = []
    for raw in path.read_text().splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith(("#", "-")):
            continue
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        have = _installed(req.name)
        if have is not None and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{req.name} {have} does not satisfy {req} ({path})")
    return problems


def _editable_problems(dist_name: str, repo: Path) -> list[str]:
    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        return [f"{dist_name} is not installed"]
    raw = dist.read_text("direct_url.json")
    info = json.loads(raw) if raw else {}
    url = info.get("url", "")
    if not info.get("dir_info", {}).get("editable") or Path(url.removeprefix("file://")).resolve() != repo:
        return [f"{dist_name} is not an editable install of {repo} (direct_url: {info or 'none'})"]
    return _metadata_drift(dist, repo)


def _metadata_drift(dist: md.Distribution, repo: Path) -> list[str]:
    """An editable install freezes version and entry points at install time; pyproject edits need a reinstall.

    (Entry points matter: vLLM finds its general plugins through them.)
    """
    project = tomllib.loads((repo / "pyproject.toml").read_text()).get("project", {})
    problems = []
    if "version" in project and project["version"] != dist.version:
        problems.append(f"installed version {dist.version} != pyproject {project['version']}")
    groups = dict(project.get("entry-points", {}))
    groups["console_scripts"] = project.get("scripts", {})
    groups["gui_scripts"] = project.get("gui-scripts", {})
    want = {(g, n, v) for g, eps in groups.items() for n, v in eps.items()}
    have = {(ep.group, ep.name, ep.value) for ep in dist.entry_points}
    if want != have:
        problems.append(
            f"entry points differ from pyproject (missing {sorted(want - have)}, stale {sorted(have - want)})"
        )
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pin", action="append", default=[], metavar="NAME==VERSION", help="exact version required")
    ap.add_argument("--absent", action="append", default=[], metavar="NAME", help="distribution that must not exist")
    ap.add_argument("--present", action="append", default=[], metavar="NAME", help="distribution that must exist")
    ap.add_argument(
        "--constraints",
        action="append",
        default=[],
        metavar="FILE",
        help="pip constraints file: installed distributions it names must satisfy it",
    )
    ap.add_argument("--editable", metavar="NAME", help="distribution that must be an editable install of --repo")
    ap.add_argument("--extras", default="", help="comma-separated extras of --editable whose deps must be met")
    ap.add_argument("--repo", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE")
    ap.add_argument("--cpu-platform", action="store_true", help="vllm must resolve to its CPU platform")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args()

    problems: list[str] = []
    for pin in args.pin:
        name, _, want = pin.partition("==")
        have = _installed(name)
        if have != want:
            problems.append(f"{name}: want {want}, have {have}")
    problems += [f"{n} must not be installed (have {_installed(n)})" for n in args.absent if _installed(n)]
    problems += [f"{n} is missing" for n in args.present if not _installed(n)]
    for path in args.constraints:
        problems += _constraint_problems(Path(path))
    if args.editable:
        problems += _editable_problems(args.editable, Path(args.repo).resolve())
        if not problems:
            problems += _requirement_problems(args.editable, {e for e in args.extras.split(",") if e})
    if not problems:
        for mod in args.imports:
            try:
                importlib.import_module(mod)
            except Exception as exc:  # noqa: BLE001 - any import failure makes the env unusable
                problems.append(f"import {mod} failed: {type(exc).__name__}: {exc}")
    if not problems and args.cpu_platform:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            problems.append(f"vllm platform is {type(current_platform).__name__}, not the CPU platform")

    if problems and not args.quiet:
        print(f"{sys.prefix}: not satisfied:", *problems, sep="\n  ", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

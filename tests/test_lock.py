"""The install lock (constraints.txt): every dependency pinned with ==, consistent with pyproject.toml.

Reads pyproject.toml, constraints.txt and the installed distributions' metadata. A dependency added to
pyproject.toml without `make lock` fails here, before a fresh install would spend minutes resolving it.
"""

import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def read_lock() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        req = Requirement(line)
        (spec,) = req.specifier  # exactly one specifier ...
        assert spec.operator == "==" and not req.marker and not req.extras, line  # ... and it is a plain pin
        name = canonicalize_name(req.name)
        assert name not in pins, f"{name} pinned twice"
        pins[name] = Version(spec.version)
    return pins


def project_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]


def test_every_direct_requirement_is_pinned_within_its_range():
    pins = read_lock()
    assert "dflash-assets" not in pins
    for req in project_requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} is not in constraints.txt: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req} vs pinned {pins[name]}: run `make lock`"


def test_the_installed_dependency_tree_is_the_locked_one():
    """Walk what dflash-assets[dev] requires, transitively, in this environment: every package is pinned,
    at the installed version (a `make install` after `make lock` makes that so)."""
    try:
        metadata.distribution("dflash-assets")
    except metadata.PackageNotFoundError:
        pytest.fail("dflash-assets is not installed in this environment: run `make install`")
    pins, seen, missing, differ, env = read_lock(), set(), [], [], default_environment()
    todo = [(req, frozenset({"dev"})) for req in project_requirements()]
    while todo:
        req, extras = todo.pop()
        if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""})):
            continue
        name = canonicalize_name(req.name)
        if (name, frozenset(req.extras)) in seen:
            continue
        seen.add((name, frozenset(req.extras)))
        installed = Version(metadata.version(name))
        if name not in pins:
            missing.append(name)
        elif Version(installed.public) != pins[name]:
            differ.append(f"{name} {installed} installed, {pins[name]} pinned")
        for sub in metadata.requires(name) or []:
            todo.append((Requirement(sub), frozenset(req.extras)))
    assert not missing, f"required but not pinned in constraints.txt: {sorted(missing)}: run `make lock`"
    assert not differ, differ
    assert len({n for n, _ in seen}) > 100  # the walk did reach the transitive dependencies

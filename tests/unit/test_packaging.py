"""pyproject.toml's ranges, constraints.txt's pins and the installers that use them agree: every
dependency pinned inside its range, the generated stubs' runtime floors kept, requires-python what
the code needs, and scripts/install.sh and the Dockerfile installing at the pins."""
from __future__ import annotations

import ast
import importlib.util
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("launcher", "router", "shard", "proto")
# standard-library names that arrived after 3.10, with the Python that brought them
NEWER_STDLIB = {
    "asyncio.timeout": (3, 11), "asyncio.TaskGroup": (3, 11), "asyncio.Runner": (3, 11),
    "tomllib": (3, 11), "typing.Self": (3, 11), "enum.StrEnum": (3, 11), "datetime.UTC": (3, 11),
    "ExceptionGroup": (3, 11), "except*": (3, 11),
    "itertools.batched": (3, 12), "typing.override": (3, 12),
}
OLDEST_PYTHON = (3, 10)  # `X | Y` unions and match statements are used throughout


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements() -> list[Requirement]:
    project = _project()
    texts = project["dependencies"] + [t for extra in project["optional-dependencies"].values()
                                       for t in extra]
    return [Requirement(text) for text in texts]


def _requirement(name: str) -> Requirement:
    return next(r for r in _requirements() if canonicalize_name(r.name) == name)


def _pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        requirement = Requirement(line)
        (specifier,) = requirement.specifier
        assert specifier.operator == "==" and not requirement.marker, f"not an exact pin: {line}"
        name = canonicalize_name(requirement.name)
        assert name not in pins, f"{name} is pinned twice"
        pins[name] = Version(specifier.version)
    return pins


def _floor(specifiers: SpecifierSet) -> Version | None:
    """The highest lower bound in a range (None: unbounded below)."""
    bounds = [Version(s.version) for s in specifiers if s.operator in (">=", ">", "==", "~=")]
    return max(bounds, default=None)


def test_every_dependency_is_pinned_within_its_range():
    pins = _pins()
    for requirement in _requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} has no pin in constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject's {requirement}")


def test_constraints_pin_what_the_environment_installs():
    """constraints.txt is what scripts/freeze-constraints.py writes: every package the project pulls
    in, at the version scripts/install.sh installed (which installs with the pins)."""
    spec = importlib.util.spec_from_file_location("freeze", ROOT / "scripts/freeze-constraints.py")
    freeze = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(freeze)
    installed = freeze.installed_closure("tgi-py", {"test"})
    del installed["tgi-py"]
    # a CUDA build's runtime libraries: torch's own metadata pins them exactly
    installed = {name: version for name, version in installed.items()
                 if not name.startswith("nvidia-")}
    pins = _pins()
    unpinned = sorted(installed.keys() - pins.keys())
    # triton: pulled in on Linux x86_64 only (its marker in pyproject.toml)
    unused = sorted(pins.keys() - installed.keys() - {"triton"})
    assert not unpinned and not unused, (
        f"constraints.txt is stale (unpinned: {unpinned}, pinned but not pulled in: {unused}): "
        "install, then run .venv/bin/python scripts/freeze-constraints.py")
    differing = {name: (str(pins[name]), version) for name, version in installed.items()
                 if Version(version.split("+")[0]) != pins[name]}
    assert not differing, f"installed versions differ from the pins: {differing} (run the install)"


def _stub_floors() -> tuple[Version, Version]:
    """The oldest protobuf and grpcio runtimes the generated stubs in proto/ accept."""
    protobuf, grpc = [], []
    for path in (ROOT / "proto").glob("*_pb2.py"):
        found = re.search(r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),",
                          path.read_text())
        protobuf.append(Version(".".join(found.groups())))
    for path in (ROOT / "proto").glob("*_pb2_grpc.py"):
        grpc.append(Version(re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", path.read_text())[1]))
    assert protobuf and grpc
    return max(protobuf), max(grpc)


def test_ranges_keep_the_generated_stubs_runtime_floors():
    protobuf, grpc = _stub_floors()
    floors = {"protobuf": protobuf, "grpcio": grpc, "grpcio-health-checking": grpc,
              "grpcio-reflection": grpc}
    for name, floor in floors.items():
        specifier = _requirement(name).specifier
        assert specifier.contains(floor), f"{name}: {specifier} excludes {floor}"
        assert _floor(specifier) is not None and _floor(specifier) >= floor, (
            f"{name}: {specifier} admits runtimes older than the stubs' {floor}")
    # tests/unit/test_proto_stubs.py regenerates the stubs and compares: the exact generator
    assert _requirement("grpcio-tools").specifier == SpecifierSet(f"=={grpc}"), (
        f"grpcio-tools is pinned to {grpc}, the version that generated proto/")


def _stdlib_uses(tree: ast.AST) -> set[str]:
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            used.add(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            used.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            used.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.TryStar):
            used.add("except*")
    return used


def _oldest_admitted(requires_python: str) -> tuple[int, int]:
    specifiers = SpecifierSet(requires_python)
    return next((3, minor) for minor in range(6, 30) if f"3.{minor}.0" in specifiers)


def test_requires_python_is_the_oldest_python_the_code_runs_on():
    needed = {OLDEST_PYTHON: "the syntax"}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in _stdlib_uses(ast.parse(path.read_text())) & NEWER_STDLIB.keys():
                needed.setdefault(NEWER_STDLIB[name], f"{name} in {path.relative_to(ROOT)}")
    newest = max(needed)
    requires_python = _project()["requires-python"]
    assert _oldest_admitted(requires_python) == newest, (
        f"requires-python {requires_python}: the code needs {newest} ({needed[newest]})")
    assert sys.version_info[:2] >= newest
    image = re.search(r"^FROM python:(\d+)\.(\d+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert f"{image[1]}.{image[2]}.0" in SpecifierSet(requires_python), "the image's Python"


def test_the_package_ships_the_page_files():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package, globs in package_data["package-data"].items():
        for glob in globs:
            assert list((ROOT / package).glob(glob)), f"{package}/{glob} matches no file"
    assert "api/ui/static/*" in package_data["package-data"]["router"]


def test_installers_install_at_the_pins():
    dockerfile = (ROOT / "Dockerfile").read_text().splitlines()
    installs = [i for i, line in enumerate(dockerfile) if "pip install" in line]
    copied = [i for i, line in enumerate(dockerfile)
              if line.startswith("COPY ") and "constraints.txt" in line.split()[1:-1]]
    assert installs and copied and copied[0] < installs[0], "copy constraints.txt before installing"
    for i in installs:
        assert "-c constraints.txt" in dockerfile[i], dockerfile[i]
    torch = next(dockerfile[i] for i in installs if " torch" in dockerfile[i])
    assert '--index-url "${TORCH_INDEX}"' in torch and "--no-deps" in torch
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in dockerfile
    install_sh = (ROOT / "scripts" / "install.sh").read_text()
    assert "-c constraints.txt -e '.[test]'" in install_sh
    assert "bash scripts/install.sh" in (ROOT / ".ci" / "run").read_text()

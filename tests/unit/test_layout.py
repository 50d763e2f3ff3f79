"""The router's packages import one way: each layer may import only the layers below it."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# bottom to top; a module may import its own layer's package and anything lower
ROUTER_LAYERS = [
    {"router.errors", "router.schemas"},
    {"router.telemetry", "router.inputs"},
    {"router.kv", "router.shards"},
    {"router.scheduler"},
    {"router.core", "router.config"},
    {"router.lifecycle"},
    {"router.http", "router.state"},
    {"router.api"},
    {"router.app"},
    {"router.__main__"},
]


def _layer(module: str) -> int | None:
    for rank, names in enumerate(ROUTER_LAYERS):
        if any(module == name or module.startswith(name + ".") for name in names):
            return rank
    return None


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def _router_imports(path: Path) -> list[str]:
    modules = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("router"):
            if node.module == "router" or node.module == "router.api":
                modules += [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                modules.append(node.module)
        elif isinstance(node, ast.Import):
            modules += [a.name for a in node.names if a.name.startswith("router.")]
    return modules


def test_every_router_module_has_a_layer():
    for path in sorted((ROOT / "router").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if module.endswith("__init__") and module.count(".") <= 1:
            continue
        assert _layer(module.removesuffix(".__init__")) is not None, f"{module} belongs to no layer"


def test_router_imports_point_down():
    upward = []
    for path in sorted((ROOT / "router").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        own = _layer(module)
        if own is None:
            continue
        for target in _router_imports(path):
            rank = _layer(target)
            if rank is None or _package(target) == _package(module):
                continue
            if rank > own or (rank == own and _package(target) != _package(module)):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_api_modules_reach_the_scheduler_only_through_the_served_model():
    """No API module touches the batcher, the queue, the allocator or the session store."""
    reaching = [f"{path.relative_to(ROOT)} -> {target}"
                for path in sorted((ROOT / "router" / "api").rglob("*.py"))
                for target in _router_imports(path)
                if target.startswith(("router.scheduler", "router.kv", "router.shards"))]
    assert not reaching, "\n".join(reaching)


def test_api_families_do_not_import_each_other_but_tgi():
    """Each API family stands alone; TGI's routes are the base the others build on, and
    api/invocations.py (SageMaker's one route) dispatches to the families."""
    crossing = []
    for path in sorted((ROOT / "router" / "api").glob("*/*.py")):
        family = path.relative_to(ROOT / "router" / "api").parts[0]
        for target in _router_imports(path):
            parts = target.split(".")
            if len(parts) > 2 and parts[1] == "api" and parts[2] not in (family, "tgi"):
                crossing.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not crossing, "\n".join(crossing)

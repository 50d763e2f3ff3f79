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


# ---- what every module of the three processes keeps to ---------------------------------------

PROCESS_PACKAGES = ("router", "shard", "launcher", "proto")
MAX_MODULE_LINES = 400


def _modules() -> list[Path]:
    return [path for package in PROCESS_PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))]


def test_no_module_is_over_400_lines():
    long = [f"{path.relative_to(ROOT)}: {n} lines" for path in _modules()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, "\n".join(long)


def _docstring_problem(text: str) -> str | None:
    lines = text.split("\n")
    if len(lines[0]) > 100:
        return "its first line is over 100 characters"
    if len(lines) > 1 and lines[1].strip():
        return "its first sentence runs on past the first line"
    return None


def test_docstrings_open_with_one_short_line():
    """A docstring's first line alone says what the thing is; detail follows a blank line."""
    found = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        defined = [n for n in ast.walk(tree)
                   if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        for node in [tree, *defined]:
            text = ast.get_docstring(node, clean=True)
            problem = text and _docstring_problem(text)
            if problem:
                name = getattr(node, "name", "the module")
                found.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)} {name}: {problem}")
    assert not found, f"{len(found)} docstrings:\n" + "\n".join(found)


# Attributes that code outside a class may set on its objects: foreign types whose interface is
# attribute assignment (besides our dataclasses' fields and protobuf messages' fields).
FOREIGN_ATTRIBUTES = {
    "argtypes", "restype",  # ctypes: a C function's signature
    "msg", "args", "exc_info", "exc_text", "levelno", "levelname",  # logging.LogRecord in a filter
    "model_max_length",  # a transformers tokenizer's limit, written into the converted files
    "excepthook",  # sys's and threading's hooks for uncaught exceptions (JSON logs)
}
# PyTorch's own switches and patches, each explained where it is set: (module, attribute)
TORCH_PATCHES = {
    ("shard/decode_paths/compiled.py", "_tgi_fallback"),
    ("shard/decode_paths/compiled.py", "_mkldnn_fusion_init"),
    ("shard/decode_paths/compiled.py", "use_duck_shape"),
}


def _dataclass_fields() -> set[str]:
    """Every field name of a dataclass defined in the three processes' packages."""
    names = set()
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    "dataclass" in ast.unparse(d) for d in node.decorator_list):
                names |= {s.target.id for s in node.body
                          if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    return names


def _proto_fields() -> set[str]:
    """Every field name of a protobuf message of proto/*.proto."""
    import re
    field = re.compile(r"^\s*(?:repeated\s+|optional\s+)?[\w.]+\s+(\w+)\s*=\s*\d+\s*[;\[]", re.M)
    return {m[1] for proto in (ROOT / "proto").glob("*.proto") for m in field.finditer(proto.read_text())}


def _assigned_attributes(tree: ast.AST, classes: tuple[str, ...] = ()):
    """(assignment, attribute, the names of the classes around it) for each attribute assigned."""
    for node in ast.iter_child_nodes(tree):
        inner = (*classes, node.name) if isinstance(node, ast.ClassDef) else classes
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and isinstance(part.ctx, ast.Store):
                    yield node, part, classes
        yield from _assigned_attributes(node, inner)


def test_objects_are_not_wired_from_outside():
    """Only an object's own methods set its attributes, apart from state records' fields.

    A constructor shows what an object depends on: a callback or collaborator assigned from
    outside after it is made (`allocator.reclaim = ...`, `batcher.closed = lambda ...`) hides it."""
    allowed = _dataclass_fields() | _proto_fields() | FOREIGN_ATTRIBUTES
    found = []
    for path in _modules():
        module = str(path.relative_to(ROOT))
        for node, attribute, classes in _assigned_attributes(ast.parse(path.read_text())):
            owner = attribute.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls", *classes):
                continue
            if attribute.attr in allowed or (module, attribute.attr) in TORCH_PATCHES:
                continue
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:90]}")
    assert not found, "attributes set from outside their class:\n" + "\n".join(found)

"""The import graph of every module under shared/, services/, kernels/ and loadgen/ (every `import`, at the top, in
a function or under TYPE_CHECKING) against the layers and arrows of import_graph.toml."""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGES = ("shared", "services", "kernels", "loadgen")
GRAPH = tomllib.loads((Path(__file__).parent / "import_graph.toml").read_text())


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path = ROOT) -> Iterator[str]:
    """Every module `path` imports that belongs to this project (relative imports resolved)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            names = [module] + [f"{module}.{alias.name}" for alias in node.names]  # `from pkg import module`
        else:
            continue
        yield from (name for name in names if name.split(".")[0] in PACKAGES)


def layer_of(module: str) -> str | None:
    """The layer of the longest prefix of `module` in [layers]."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        layer = GRAPH["layers"].get(".".join(parts[:end]))
        if layer is not None:
            return layer
    return None


def has_prefix(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(root: Path = ROOT) -> dict[str, set[str]]:
    """importer -> the imported modules that break a rule (a name imported from a module counts as the module)."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            importer = module_name(path, root)
            own = layer_of(importer)
            assert own is not None, f"{importer} is in no layer of import_graph.toml"
            for imported in imported_modules(path, root):
                layer = layer_of(imported)
                allowed = layer in (own, *GRAPH["allowed"][own])
                forbidden = any(
                    has_prefix(importer, prefix) and any(has_prefix(imported, bad) for bad in banned)
                    for prefix, banned in GRAPH["forbidden"].items()
                )
                if not allowed or forbidden:
                    found.setdefault(importer, set()).add(imported)
    return {importer: _modules_only(names) for importer, names in found.items()}


def _modules_only(names: set[str]) -> set[str]:
    """Drop `pkg.module.name` where `pkg.module` is listed too (a `from pkg.module import name`)."""
    return {n for n in names if not any(n.startswith(other + ".") for other in names if other != n)}


def test_every_layer_and_arrow_is_declared() -> None:
    layers = set(GRAPH["layers"].values())
    assert set(GRAPH["allowed"]) == layers
    for layer, targets in GRAPH["allowed"].items():
        assert set(targets) <= layers, layer


def test_imports_run_only_along_the_allowed_arrows() -> None:
    found = violations()
    pending = {importer: set(names) for importer, names in GRAPH["pending"].items()}
    new = {importer: names - pending.get(importer, set()) for importer, names in found.items()}
    new = {importer: sorted(names) for importer, names in new.items() if names}
    assert not new, f"imports against import_graph.toml: {new}"
    gone = {importer: sorted(names - found.get(importer, set())) for importer, names in pending.items()}
    gone = {importer: names for importer, names in gone.items() if names}
    assert not gone, f"fixed, so take them off [pending] in import_graph.toml: {gone}"


def test_the_checker_sees_backward_lazy_and_relative_imports(tmp_path: Path) -> None:
    """What the check rests on, on a tree of its own: the wire importing the engine (lazily, in a function), a
    service importing another (relatively), the kernels importing shared/; not an import within a layer."""
    files = {
        "shared/wire/bus.py": "def f() -> None:\n    from shared.engine.engine import LLMEngine\n",
        "shared/wire/log.py": "from shared.wire import protocol\n",
        "services/decode/service.py": "from ..prefill import fetch\n",
        "kernels/op.py": "import shared.kvcompress.kvquant\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert violations(tmp_path) == {
        "shared.wire.bus": {"shared.engine.engine"}, "services.decode.service": {"services.prefill"},
        "kernels.op": {"shared.kvcompress.kvquant"},
    }

"""The project's own modules import one another without a cycle: a cycle makes import order matter and hides which
module depends on which. Imports at module level count (`if TYPE_CHECKING:` ones too); imports inside functions,
made at call time, do not."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fxsurgery", "barter")


def project_modules() -> dict[str, tuple[Path, bool]]:
    """Each module's dotted name -> (its file, whether it is a package's __init__)."""
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The import statements outside function bodies (in classes, `if` and `try` blocks too)."""
    found, pending = [], list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports: `from package import name` depends on the submodule when `name`
    is one, else on the package; relative imports resolve against the importing module's package."""
    modules = project_modules()
    graph = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        targets = set()
        for node in module_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names)
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as the modules along it (the first repeated at the end), or None."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, on_path, stack = [start], {start}, [iter(sorted(graph[start]))]
        while stack:
            target = next(stack[-1], None)
            if target is None:
                finished = path.pop()
                on_path.discard(finished)
                done.add(finished)
                stack.pop()
                continue
            if target in on_path:
                return path[path.index(target):] + [target]
            if target not in done:
                path.append(target)
                on_path.add(target)
                stack.append(iter(sorted(graph[target])))
    return None


def test_graph_sees_the_project():
    graph = import_graph()
    assert "fxsurgery.dataflow.grouping" in graph and "barter.training.loop" in graph
    assert "fxsurgery.dataflow.labeller" in graph["fxsurgery.dataflow.grouping"]
    assert "barter.training.processes" in graph["barter.training.loop"]  # `from . import processes`


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)

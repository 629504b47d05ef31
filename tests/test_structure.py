"""The layering docs/architecture.md states, checked on the source: barter reaches fxsurgery through the names
`fxsurgery/__init__.py` exports only, fxsurgery never imports barter, torch's hook dicts and a module's instance
`__deepcopy__` are reached from a compat module only, fxsurgery's functions return no string in place of a record,
and no function is longer than a screen. Imports inside functions count here (made at call time, they still cross
the line)."""
from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import fxsurgery

ROOT = Path(__file__).resolve().parents[1]
COMPAT_MODULES = {Path("fxsurgery/compat.py"), Path("barter/compat.py")}
MAX_FUNCTION_LINES = 60


def sources(package: str) -> Iterator[tuple[str, ast.Module]]:
    """(path relative to the root, parsed module) of every module of `package`."""
    for path in sorted((ROOT / package).rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), str(path))


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, definition) of every function of a module, methods and nested functions included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)


def long_functions(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """(qualified name, length in lines) of every function of a module longer than MAX_FUNCTION_LINES."""
    for name, f in functions(tree):
        if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES:
            yield name, f.end_lineno - f.lineno + 1


def imports_of(tree: ast.Module, package: str) -> Iterator[tuple[int, str, str | None]]:
    """(line, module, imported name or None) of every absolute import of `package` or its submodules, at any
    depth."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name, None) for a in node.names
                        if a.name == package or a.name.startswith(package + "."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                (node.module == package or node.module.startswith(package + ".")):
            yield from ((node.lineno, node.module, a.name) for a in node.names)


def test_barter_imports_only_the_names_fxsurgery_exports():
    exported = set(fxsurgery.__all__)
    outside = []
    for path, tree in sources("barter"):
        for line, module, name in imports_of(tree, "fxsurgery"):
            if module != "fxsurgery" or name not in exported:
                outside.append(f"{path}:{line}: {module}" + (f" import {name}" if name else ""))
        for node in ast.walk(tree):  # `import fxsurgery` then `fxsurgery.analysis.model...`
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "fxsurgery" \
                    and node.attr not in exported:
                outside.append(f"{path}:{node.lineno}: fxsurgery.{node.attr}")
    assert not outside, "barter reaches fxsurgery past its exports (fxsurgery.__all__):\n" + "\n".join(outside)


def private_attributes(cls: type) -> set[str]:
    """The private names (`_x`, not `__x__` nor an enum's `_x_`) of `cls` and of its bases defined in fxsurgery: its
    class attributes and the attributes its methods set or read on `self`."""
    names = set()
    for base in cls.__mro__:
        if base.__module__.startswith("fxsurgery"):
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
            names |= set(vars(base)) | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                                        and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return {n for n in names if n.startswith("_") and not n.endswith("_")}


def reaches_private(tree: ast.AST, private: set[str]) -> Iterator[ast.Attribute]:
    """Each `x._name` of a name in `private` on anything but `self` or `cls`."""
    return (n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in private
            and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")))


def test_barter_uses_no_private_attribute_of_fxsurgery_s_classes():
    """barter drives a Surgeon, reads an Analysis and its groups through their public names (not `Surgeon._editor`,
    `Analysis._plan`, `UnitGroup._state`)."""
    private = set().union(*(private_attributes(obj) for obj in map(fxsurgery.__dict__.get, fxsurgery.__all__)
                            if inspect.isclass(obj) and obj.__module__.startswith("fxsurgery")))
    assert {"_editor", "_plan", "_state"} <= private
    found = [f"{path}:{n.lineno}: {ast.unparse(n)}" for path, tree in sources("barter")
             for n in reaches_private(tree, private)]
    assert not found, "barter reaches private attributes of fxsurgery's classes:\n" + "\n".join(found)


def test_fxsurgery_never_imports_barter():
    found = [f"{path}:{line}: {module}" for path, tree in sources("fxsurgery")
             for line, module, _ in imports_of(tree, "barter")]
    assert not found, "fxsurgery knows nothing of barter, yet imports it:\n" + "\n".join(found)


def reaches_instance_deepcopy(node: ast.AST) -> bool:
    """`x.__dict__["__deepcopy__"]`, `x.__dict__.pop("__deepcopy__", ...)` (any method), `vars(x)[...]` or
    `setattr(x, "__deepcopy__", ...)`."""
    def is_name(value: ast.AST) -> bool:
        return isinstance(value, ast.Constant) and value.value == "__deepcopy__"

    def is_instance_dict(value: ast.AST) -> bool:
        return (isinstance(value, ast.Attribute) and value.attr == "__dict__") or \
            (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "vars")

    if isinstance(node, ast.Subscript):
        return is_instance_dict(node.value) and is_name(node.slice)
    if isinstance(node, ast.Call) and node.args and is_name(node.args[0]):
        return isinstance(node.func, ast.Attribute) and is_instance_dict(node.func.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
        return len(node.args) > 1 and is_name(node.args[1])
    return False


def test_hook_dicts_and_instance_deepcopy_are_reached_from_a_compat_module_only():
    found = []
    for package in ("fxsurgery", "barter"):
        for path, tree in sources(package):
            if Path(path) in COMPAT_MODULES:
                continue
            found += [f"{path}:{node.lineno}" for node in ast.walk(tree)
                      if (isinstance(node, ast.Attribute) and node.attr == "hooks_dict_ref")
                      or reaches_instance_deepcopy(node)]
    assert not found, ("torch's hook dicts or an instance __deepcopy__ reached outside fxsurgery/compat.py and "
                       "barter/compat.py:\n" + "\n".join(found))


def test_the_structure_checks_find_what_they_look_for():
    """Each check flags its pattern (so an empty finding means something)."""
    tree = ast.parse(
        'import fxsurgery.slicing\nfrom fxsurgery.editing import replace_data\nfrom fxsurgery import Surgeon\n'
        'from barter import wrap\nm.__dict__["__deepcopy__"] = f\nm.__dict__.pop("__deepcopy__", None)\n'
        'vars(m)["__deepcopy__"]\nh.hooks_dict_ref()\nm.__dict__["other"] = 1\n'
        'def f() -> list[int] | str: ...\ndef g() -> "str | None": ...\ndef h() -> int | None: ...\n')
    assert [(m, n) for _, m, n in imports_of(tree, "fxsurgery")] == [
        ("fxsurgery.slicing", None), ("fxsurgery.editing", "replace_data"), ("fxsurgery", "Surgeon")]
    assert [m for _, m, _ in imports_of(tree, "barter")] == ["barter"]
    assert sorted(n.lineno for n in ast.walk(tree) if reaches_instance_deepcopy(n)) == [5, 6, 7]
    assert [name for name, f in functions(tree) if returns_a_string_union(f.returns)] == ["f", "g"]
    assert sorted(ast.unparse(n) for n in reaches_private(ast.parse("s._editor.x\nself._editor\nc._count\nc.count\n"),
                                                    {"_editor", "_count"})) == ["c._count", "s._editor"]

    def body(lines: int) -> str:
        return "".join(f"    x{i} = {i}\n" for i in range(lines))
    tree = ast.parse(f"class C:\n  def fits(self):\n{body(MAX_FUNCTION_LINES - 1)}"  # 60 lines with its `def`
                     f"  def spills(self):\n{body(MAX_FUNCTION_LINES)}")
    assert list(long_functions(tree)) == [("C.spills", MAX_FUNCTION_LINES + 1)]


def returns_a_string_union(annotation: ast.expr | None) -> bool:
    """Whether a return annotation is a union with `str` as a member (`X | str`, `str | None`; as text too)."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    if not (isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr)):
        return False
    return any((isinstance(side, ast.Name) and side.id == "str") or returns_a_string_union(side)
               for side in (annotation.left, annotation.right))


def test_fxsurgery_returns_no_string_unions():
    """A failure is a typed record (`fxsurgery.reason.Reason`: the text, the module, the node), never a string in a
    union with the result; an optional name is the node or object it names."""
    found = sorted(f"{path}::{name}" for path, tree in sources("fxsurgery") for name, f in functions(tree)
                   if returns_a_string_union(f.returns))
    assert not found, "a return annotation with a string in a union (return a record): " + ", ".join(found)


def test_no_function_longer_than_a_screen():
    long = [f"{path}::{name} ({length})" for package in ("fxsurgery", "barter") for path, tree in sources(package)
            for name, length in long_functions(tree)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): " + ", ".join(long)


def test_barter_layers_import_downwards():
    """barter's core imports none of the layers above it (the pipeline, the baselines, the integrations), and the
    baselines neither the pipeline nor the integrations (module-level imports, as docs/architecture.md draws them)."""
    from test_import_graph import import_graph

    above = {"core": {"training", "baselines", "integrations"}, "baselines": {"training", "integrations"}}

    def layer(module: str) -> str:
        part = module.split(".")[1] if module.count(".") else ""
        return part if part in ("training", "baselines", "integrations", "models", "__main__") else "core"

    upward = [f"{m} -> {t}" for m, targets in import_graph().items() if m.startswith("barter")
              for t in targets if t.startswith("barter") and layer(t) in above.get(layer(m), ())]
    assert not upward, "imports that point up:\n" + "\n".join(sorted(upward))


def test_installing_and_editing_leave_the_analysis_as_it_was():
    """`Analysis` is a value: the Surgeon installs it on groups of its own, and its edits change those only."""
    import torch
    from tiny_vit import build_vit

    model = build_vit()
    analysis = fxsurgery.analyse(model, (torch.zeros(2, 3, 32, 32),))
    before = [(g.name, g.count, g.min_count, g.slices, tuple(g.notes)) for g in analysis.groups]
    surgeon = fxsurgery.Surgeon(model, analysis)
    assert not {id(g) for g in surgeon.groups} & {id(g) for g in analysis.groups}
    surgeon.remove(surgeon.groups[0], 0)
    surgeon.clone(surgeon.groups[-1], 0)
    assert [(g.name, g.count, g.min_count, g.slices, tuple(g.notes)) for g in analysis.groups] == before
    assert surgeon.groups[0].count == analysis.groups[0].count - 1


def test_the_architecture_guide_gives_the_wrap_path_as_measured():
    """docs/architecture.md's count of the modules `barter.wrap` runs through and of their entries is what
    benchmarks/wrap_path.py measures (run in a fresh interpreter, as the guide says)."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "wrap_path.py")], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.splitlines()
    modules = re.fullmatch(r"modules: (\d+) \((.*)\)", out[0])
    entries = re.fullmatch(r"entries: (\d+), re-entries: (\d+)", out[1])
    by_package = dict(re.findall(r"(\S+)/: (\d+)", modules.group(2)))
    guide = " ".join((ROOT / "docs" / "architecture.md").read_text().split())
    fxsurgery_modules = sum(int(n) for package, n in by_package.items() if package.startswith("fxsurgery"))
    assert (f"{modules.group(1)} modules run, {by_package['barter']} of barter and {fxsurgery_modules} of fxsurgery"
            in guide)
    assert f"entered anew {entries.group(1)} times in all" in guide
    assert f"{entries.group(2)} times after its first entry" in guide

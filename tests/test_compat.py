"""The private torch and Lightning APIs the project relies on: each works on the installed version (one test per
entry of ``fxsurgery.compat`` and ``barter.integrations.lightning_compat`` here, of ``barter.compat`` in
``test_compat_barter.py``, so an upgrade that removes or changes one fails by name), and none is reached from anywhere
else in the project's source."""
from __future__ import annotations

import ast
import importlib
import logging
import re
from pathlib import Path

import pytest
import torch
import torch.fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

from fxsurgery import compat

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("fxsurgery", "barter", "benchmarks")
TORCH_COMPAT = Path("fxsurgery/compat.py")
BARTER_COMPAT = Path("barter/compat.py")
LIGHTNING_COMPAT = Path("barter/integrations/lightning_compat.py")
COMPAT_MODULES = (TORCH_COMPAT, BARTER_COMPAT, LIGHTNING_COMPAT)
LIBRARIES = ("torch", "lightning", "pytorch_lightning")
# underscore names of other libraries' objects that are no private torch API: a NamedTuple's public methods, and the
# attention kernel a transformers config names, and the flags an argparse parser knows (read for typo suggestions)
OTHER_LIBRARIES = {"_replace", "_asdict", "_fields", "_make", "_attn_implementation", "_option_string_actions"}
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """``torch.utils._pytree.tree_map`` for an attribute chain whose root name is bound by an import (or a
    module-level assignment of such a chain), its alias spelled out; None for any other expression."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def aliases_of(tree: ast.Module) -> dict[str, str]:
    """Each name a module binds to an imported object -> that object's dotted path (relative imports start with a
    dot: the project's own)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                    alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
    for node in tree.body:  # ``aten = torch.ops.aten``
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            path = dotted(node.value, aliases)
            if path is not None:
                aliases[node.targets[0].id] = path
    return aliases


def names_defined(tree: ast.Module) -> set[str]:
    """The names a module defines: functions and classes, ``self.``/``cls.`` attributes, and names assigned at module
    or class level (constants, dataclass fields)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
    scopes = [tree.body] + [node.body for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    for body in scopes:
        for statement in body:
            targets = statement.targets if isinstance(statement, ast.Assign) else \
                [statement.target] if isinstance(statement, ast.AnnAssign) else []
            names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def is_library_path(path: str) -> bool:
    """A dotted path into torch or Lightning with a private part; ``torch.ops`` paths name operators
    (``aten._to_copy`` is an op of export's ATen IR), not Python attributes."""
    parts = path.split(".")
    return parts[0] in LIBRARIES and any(is_private(p) for p in parts) and not path.startswith("torch.ops.")


def private_names(tree: ast.Module, own: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every private torch or Lightning name the module reaches: imports and attribute chains of
    library paths (``torch.utils._pytree``, ``torch._C._set_grad_enabled``), private attributes of other objects that
    the project does not define itself (``graph._codegen``, also by ``getattr``), and such names in strings."""
    aliases = aliases_of(tree)
    chained = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}

    def foreign_attribute(name: str) -> bool:
        return is_private(name) and name not in own and name not in OTHER_LIBRARIES

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if is_library_path(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                      if is_library_path(f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Attribute):
            path = dotted(node, aliases)
            if path is None and foreign_attribute(node.attr):
                found.append((node.lineno, f".{node.attr}"))
            elif path is not None and id(node) not in chained and is_library_path(path):
                found.append((node.lineno, path))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            name, path = node.args[1].value, dotted(node.args[0], aliases)
            if path is not None and is_library_path(f"{path}.{name}"):
                found.append((node.lineno, f"{path}.{name}"))
            elif path is None and foreign_attribute(name):
                found.append((node.lineno, f".{name}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED.fullmatch(node.value):
            parts = node.value.split(".")
            if is_library_path(node.value) or (parts[0] not in LIBRARIES and any(map(foreign_attribute, parts[1:]))):
                found.append((node.lineno, node.value))
    return sorted(found)


@pytest.fixture(scope="module")
def sources() -> dict[Path, ast.Module]:
    """The parsed modules of the project's source, by path."""
    return {path.relative_to(ROOT): ast.parse(path.read_text(), str(path))
            for package in SCANNED for path in sorted((ROOT / package).rglob("*.py"))}


@pytest.fixture(scope="module")
def own(sources) -> set[str]:
    return set().union(*map(names_defined, sources.values()))


def test_no_private_torch_name_outside_the_compat_modules(sources, own):
    outside = [f"{path}:{line}: {name}" for path, tree in sources.items()
               if path not in COMPAT_MODULES for line, name in private_names(tree, own)]
    assert not outside, ("private torch or Lightning names reached outside the compat modules "
                         f"{', '.join(map(str, COMPAT_MODULES))} (reach them through those):\n" + "\n".join(outside))


def test_the_compat_tables_list_what_their_modules_reach(sources, own):
    lightning_compat = pytest.importorskip("barter.integrations.lightning_compat")
    import barter.compat

    for path, table, table_name in ((TORCH_COMPAT, compat.PRIVATE_TORCH_NAMES, "PRIVATE_TORCH_NAMES"),
                                    (BARTER_COMPAT, barter.compat.PRIVATE_TORCH_NAMES, "PRIVATE_TORCH_NAMES"),
                                    (LIGHTNING_COMPAT, lightning_compat.PRIVATE_LIGHTNING_NAMES,
                                     "PRIVATE_LIGHTNING_NAMES")):
        code = ast.Module([s for s in sources[path].body if not assigns(s, table_name)], [])  # the table's own text
        assert {name for _, name in private_names(code, own)} == set(table), path  # does not count


def assigns(statement: ast.stmt, name: str) -> bool:
    target = statement.target if isinstance(statement, ast.AnnAssign) else \
        statement.targets[0] if isinstance(statement, ast.Assign) else None
    return isinstance(target, ast.Name) and target.id == name


def test_every_compat_entry_is_exported_and_has_its_test():
    lightning_compat = pytest.importorskip("barter.integrations.lightning_compat")
    assert set(compat.PRIVATE_TORCH_NAMES.values()) <= set(compat.__all__)
    entries = {*compat.PRIVATE_TORCH_NAMES.values(), *lightning_compat.PRIVATE_LIGHTNING_NAMES.values()}
    assert all(hasattr(compat, e) or hasattr(lightning_compat, e) for e in entries)
    assert sorted(e for e in entries if f"test_{e.lower()}" not in globals()) == []


SAMPLE = '''
import torch
import torch.nn as nn
from torch.utils import _pytree
from torch._ops import OpOverload
aten = torch.ops.aten
LOGGER = "torch._export.non_strict_utils"

class Editor:
    def __init__(self, graph):
        self._graph = graph

    def edit(self, node, record):
        self._graph.lint()
        record._replace(x=1)
        node.target is aten._to_copy.default
        node._rename("y")
        getattr(self._graph, "_codegen", None)
        nn.modules.conv._ConvNd
        torch._C._set_grad_enabled(False)
        super()._private_of_a_torch_base()
        code = "self._in_spec"
'''


def test_the_check_finds_torch_private_names_and_not_the_projects_own():
    tree = ast.parse(SAMPLE)
    found = private_names(tree, names_defined(tree))
    assert [name for _, name in found] == [
        "torch.utils._pytree", "torch._ops.OpOverload", "torch._export.non_strict_utils", "._rename", "._codegen",
        "torch.nn.modules.conv._ConvNd", "torch._C._set_grad_enabled", "._private_of_a_torch_base", "self._in_spec"]


def structured_graph() -> torch.fx.GraphModule:
    """A graph that flattens a dict argument and builds a structured result: fx gives it pytree specs."""
    def structured(x):
        return {"sum": x["a"] + x["b"], "pair": (x["a"], x["b"])}
    return torch.fx.symbolic_trace(structured, concrete_args={"x": {"a": torch.fx.PH, "b": torch.fx.PH}})


def test_tree_leaves():
    t = torch.ones(1)
    assert compat.tree_leaves({"a": [1, (2, t)], "b": None}) == [1, 2, t, None]


def test_tree_map():
    assert compat.tree_map(lambda v: v * 2, {"a": [1, (2, 3)]}) == {"a": [2, (4, 6)]}


def test_tree_unflatten():
    spec = compat.pytree_info(structured_graph().graph).out_spec
    assert compat.tree_unflatten([3, 1, 2], spec) == {"sum": 3, "pair": (1, 2)}


def test_flatten_to_spec():
    spec = compat.pytree_info(structured_graph().graph).in_spec
    assert compat.flatten_to_spec([{"b": 2, "a": 1}], spec) == [1, 2]


def test_pytree_info():
    gm = structured_graph()
    assert compat.pytree_info(gm.graph).orig_args == ["x"]
    assert compat.pytree_info(torch.fx.symbolic_trace(lambda x: x + 1).graph) is None
    a, b = torch.randn(2), torch.randn(2)
    out = gm({"a": a, "b": b})
    assert torch.equal(out["sum"], a + b) and out["pair"] == (a, b)


def test_generated_spec_reads():
    src = structured_graph().graph.python_code(root_module="self").src
    assert all(read in src for read in compat.GENERATED_SPEC_READS)


def test_running_node():
    gm = torch.fx.symbolic_trace(lambda x: x.relu())
    node = next(n for n in gm.graph.nodes if n.op == "call_method")
    node.meta["marker"] = "relu"
    with torch.fx.traceback.preserve_node_meta(), compat.running_node(torch.fx.Interpreter(gm), node):
        assert torch.fx.traceback.get_current_meta()["marker"] == "relu"


def test_rename_node():
    gm = torch.fx.symbolic_trace(lambda x: x.relu().neg())
    relu, neg = (n for n in gm.graph.nodes if n.op == "call_method")
    compat.rename_node(neg, "negated")
    compat.rename_node(relu, "negated")  # taken: suffixed
    gm.recompile()
    assert (relu.name, neg.name) == ("negated_1", "negated")
    assert "negated_1 = x.relu()" in gm.code and "negated = negated_1.neg()" in gm.code
    assert torch.equal(gm(torch.ones(2)), -torch.ones(2))


def test_opoverload():
    assert isinstance(torch.ops.aten.add.Tensor, compat.OpOverload)
    assert not isinstance(torch.ops.aten.add, compat.OpOverload)


def test_overload_name():
    assert compat.overload_name(torch.ops.aten.add.Tensor) == "Tensor"
    assert compat.overload_name(torch.ops.aten.relu.default) == "default"


def test_switch_grad_mode():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(compat.switch_grad_mode, (False,))
    y = graph.call_function(torch.mul, (x, 2))
    graph.call_function(compat.switch_grad_mode, (True,))
    graph.output(y)
    gm = torch.fx.GraphModule(nn.Module(), graph)
    with torch.enable_grad():
        assert not gm(torch.ones(2, requires_grad=True)).requires_grad
        assert torch.is_grad_enabled()


def test_export_specialisation_logger():
    module = importlib.import_module(compat.EXPORT_SPECIALISATION_LOGGER)
    assert logging.getLogger(compat.EXPORT_SPECIALISATION_LOGGER) in vars(module).values()


def test_is_fake():
    seen = []
    make_fx(lambda x: seen.append(compat.is_fake(x)) or x + 1, tracing_mode="fake")(torch.zeros(2))
    assert seen == [True]
    assert not compat.is_fake(torch.zeros(2)) and not compat.is_fake(torch.zeros(2, device="meta"))


@pytest.mark.parametrize("trace", ["make_fx", "export"])
def test_outside_traces(trace):
    """Inside a trace, the block runs on real values and records nothing; the trace records what follows it."""
    seen = []

    class Traced(nn.Module):
        def forward(self, x):
            with compat.outside_traces(), torch.no_grad():
                made = torch.ones(2) * 3
                seen.append((compat.is_fake(made), float(made.sum())))
            return x + 1

    if trace == "make_fx":
        graph = make_fx(Traced(), tracing_mode="fake")(torch.zeros(2)).graph
    else:
        graph = torch.export.export(Traced(), (torch.zeros(2),)).graph
    assert seen == [(False, 6.0)]
    assert [str(n.target) for n in graph.nodes if n.op == "call_function"] == ["aten.add.Tensor"]


def test_an_export_run_outside_a_running_export_leaves_it_running():
    """A capture inside the block (a call of a new signature met while exporting is captured on its own) sets and
    clears torch.export's globals; the running export finds them as it left them and completes."""
    class Inner(nn.Module):
        def forward(self, x):
            return x * 2

    class Outer(nn.Module):
        def forward(self, x):
            with compat.outside_traces():
                torch.export.export(Inner(), (torch.zeros(2),))
            return x + 1

    program = torch.export.export(Outer(), (torch.zeros(2),))
    assert torch.equal(program.module()(torch.ones(2)), torch.full((2,), 2.0))


def test_module_hooks():
    module = nn.Linear(2, 2)
    assert compat.module_hooks(module) == []
    hooks = [lambda *a: None for _ in range(4)]
    module.register_forward_pre_hook(hooks[0])
    module.register_forward_hook(hooks[1])
    module.register_full_backward_pre_hook(hooks[2])
    module.register_full_backward_hook(hooks[3])
    assert compat.module_hooks(module) == hooks


def test_own_tensor_tables():
    module = nn.BatchNorm1d(3)
    parameters, buffers = compat.own_tensor_tables(module)
    assert parameters["weight"] is module.weight and buffers["running_mean"] is module.running_mean
    parameters["weight"] = nn.Parameter(torch.zeros(3))
    assert module.weight is parameters["weight"] and "weight" in dict(module.named_parameters())


def test_own_module_table():
    module = nn.Sequential(nn.Linear(2, 2))
    table = compat.own_module_table(module)
    assert table["0"] is module[0]
    table["1"] = nn.ReLU()
    assert isinstance(module[1], nn.ReLU) and len(module) == 2


def test_version_counter():
    t = torch.zeros(3)
    before = compat.version_counter(t)
    t.add_(1)
    assert compat.version_counter(t) == before + 1
    assert compat.version_counter(t.to("meta").add_(1)) == 1


def test_normbase():
    for cls in (nn.BatchNorm1d, nn.BatchNorm2d, nn.InstanceNorm2d, nn.SyncBatchNorm):
        assert issubclass(cls, compat.NormBase) and cls(3).num_features == 3
    assert not issubclass(nn.LayerNorm, compat.NormBase)


def test_convnd():
    for conv in (nn.Conv1d(2, 3, 1), nn.Conv2d(2, 3, 1), nn.ConvTranspose2d(2, 3, 1)):
        assert isinstance(conv, compat.ConvNd) and (conv.in_channels, conv.out_channels, conv.groups) == (2, 3, 1)


@pytest.mark.parametrize("norm_first", [False, True])
def test_self_attention_block(norm_first):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=norm_first)
    x = torch.randn(2, 3, 8)

    def attend(y):
        return compat.self_attention_block(layer, y, None, None, False)

    if norm_first:
        h = x + attend(layer.norm1(x))
        expected = h + compat.feed_forward_block(layer, layer.norm2(h))
    else:
        h = layer.norm1(x + attend(x))
        expected = layer.norm2(h + compat.feed_forward_block(layer, h))
    torch.testing.assert_close(layer(x), expected)


def test_feed_forward_block():
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation="relu")
    x = torch.randn(3, 8)
    torch.testing.assert_close(compat.feed_forward_block(layer, x), layer.linear2(layer.linear1(x).relu()))


def test_fits_in_child_processes():
    pl = pytest.importorskip("lightning.pytorch")
    from barter.integrations.lightning_compat import fits_in_child_processes

    def trainer(strategy: str):
        return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False)

    assert fits_in_child_processes(trainer("ddp_spawn")) and fits_in_child_processes(trainer("ddp_fork"))
    assert not fits_in_child_processes(trainer("ddp"))


def test_dispatchmode():
    seen = []

    class Record(compat.DispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Record():
        torch.ones(2, device="meta") + 1
    assert torch.ops.aten.add.Tensor in seen


def test_returns_new_tensors():
    aten = torch.ops.aten
    assert compat.returns_new_tensors(aten.add.Tensor) and compat.returns_new_tensors(aten.native_layer_norm.default)
    assert not compat.returns_new_tensors(aten.view.default)  # a view of its argument
    assert not compat.returns_new_tensors(aten.add_.Tensor)  # writes its argument
    assert not compat.returns_new_tensors(print)  # no ATen op


def test_graph_module():
    class Double(nn.Module):
        def forward(self, x):
            return x * 2

    graph = torch.fx.symbolic_trace(Double()).graph
    gm = compat.graph_module(Double(), graph, "Double")
    assert isinstance(gm, torch.fx.GraphModule) and type(gm).__name__ == "Double"
    assert torch.equal(gm(torch.ones(2)), torch.full((2,), 2.0)) and "mul" in gm.code


class _Held:
    """An object pytree does not know, holding a tensor and a flag."""

    def __init__(self, tensor: torch.Tensor, flag: str):
        self.tensor, self.flag = tensor, flag


def _flatten_held(obj: _Held) -> tuple[dict, str]:
    return {"tensor": obj.tensor}, obj.flag


def _unflatten_held(children: list, flag: str) -> _Held:
    return _Held(children[0], flag)


def test_is_pytree_node():
    assert compat.is_pytree_node(dict) and not compat.is_pytree_node(_Held)


def test_register_pytree_node():
    compat.register_pytree_node(_Held, _flatten_held, _unflatten_held)
    try:
        leaves, spec = torch.utils._pytree.tree_flatten_with_path([_Held(torch.ones(2), "a")])
        assert [str(path[-1]) for path, _ in leaves] == [".tensor"]
        spec = torch.utils._pytree.tree_flatten([_Held(torch.ones(2), "a")])[1]
        rebuilt = compat.tree_unflatten([torch.zeros(2)], spec)
        assert rebuilt[0].flag == "a" and torch.equal(rebuilt[0].tensor, torch.zeros(2))
    finally:
        torch.utils._pytree._deregister_pytree_node(_Held)


def test_pytree_node_registered():
    for _ in range(2):  # registered again after its registration ended
        with compat.pytree_node_registered(_Held, _flatten_held, _unflatten_held):
            assert compat.is_pytree_node(_Held)
            assert len(compat.tree_leaves(_Held(torch.ones(2), "a"))) == 1
        assert not compat.is_pytree_node(_Held)
    assert compat.tree_leaves(_Held(torch.ones(2), "a"))[0].flag == "a"  # a leaf again


def test_spec_with_types():
    spec = torch.utils._pytree.tree_flatten((torch.ones(1), [torch.ones(1), {"k": torch.ones(1)}]))[1]
    as_lists = compat.spec_with_types(spec, lambda t: list if t is tuple else t)
    assert compat.tree_unflatten([1, 2, 3], as_lists) == [1, [2, {"k": 3}]]


def test_set_out_spec():
    exported = torch.export.export(torch.fx.symbolic_trace(lambda x: (x, x + 1)), (torch.ones(2),)).module()
    spec = compat.pytree_info(exported.graph).out_spec
    compat.set_out_spec(exported.graph, compat.spec_with_types(spec, lambda t: list if t is tuple else t))
    exported.recompile()
    assert isinstance(exported(torch.ones(2)), list)

"""A host module's forward made of its (rewritten) fx graphs.

Tracing bakes ``self.training`` (dropout, drop path, the attention dropout probability), so a host keeps
a train graph and an eval graph and runs the one that matches ``module.training``, like torchvision's
feature extraction. The object is installed as the module instance's ``forward``: the module keeps its
class, its other methods and its ``state_dict`` keys; ``copy.deepcopy`` of the model copies it along.
"""
from __future__ import annotations

import itertools
import linecache
from typing import Any, Callable

import torch.fx
import torch.nn as nn

_serial = itertools.count()


def compile_graph(graph: torch.fx.Graph) -> Callable[..., Any]:
    """Python function ``forward(self, ...)`` generated from ``graph``."""
    code = graph.python_code(root_module="self")
    key = f"<fxsurgery-{next(_serial)}>"
    linecache.cache[key] = (len(code.src), None, code.src.splitlines(True), key)
    scope = dict(code.globals)
    exec(compile(code.src, key, "exec"), scope)
    return scope["forward"]


class GraphForward:
    """Runs the train graph while the host module trains and the eval graph otherwise."""

    def __init__(self, module: nn.Module, graphs: dict[bool, torch.fx.Graph]):
        self.module = module
        self.graphs = graphs
        self.fns: dict[bool, Callable[..., Any]] = {}
        self.compile()

    def compile(self) -> None:
        """Generate the code of both graphs (count-dependent constants are host attributes, read at run time)."""
        info = getattr(self.graphs[True]._codegen, "pytree_info", None)
        if info is not None:  # code that flattens structured arguments reads the specs from self
            self.module.__dict__["_in_spec"], self.module.__dict__["_out_spec"] = info.in_spec, info.out_spec
        compiled: dict[int, Callable[..., Any]] = {}
        for mode, g in self.graphs.items():
            if id(g) not in compiled:
                compiled[id(g)] = compile_graph(g)
            self.fns[mode] = compiled[id(g)]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fns[self.module.training](self.module, *args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {"module": self.module, "graphs": self.graphs}  # generated code is rebuilt, not pickled

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.module, self.graphs, self.fns = state["module"], state["graphs"], {}
        self.compile()

    @staticmethod
    def of(module: nn.Module) -> "GraphForward | None":
        fwd = module.__dict__.get("forward")
        return fwd if isinstance(fwd, GraphForward) else None

    def install(self) -> None:
        self.module.forward = self

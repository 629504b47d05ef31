"""A host module's forward made of its (rewritten) fx graphs, one per call signature.

Tracing bakes what a call passed: ``self.training`` (dropout, drop path), which optional arguments were
None, flags such as ``output_attentions``, tensor ranks and dtypes. So a host keeps one graph per call
signature (``call_signature``), like torchvision's feature extraction keeps a train and an eval graph, and runs
the one that matches the call. A graph ``torch.export`` captured may hold some input dims at one size (a key
length baked into an ``arange``): the call's sizes there are part of its key (``fixed_dims``). A call of a new
signature is handed to the host's ``server``, which captures a
graph for it whose count constants follow the current widths (or refuses the call, naming the argument); the
graphs are kept per signature, at most ``MAX_GRAPHS`` of them. The object is installed as the module
instance's ``forward``: the module keeps its class, its other methods and its ``state_dict`` keys;
``copy.deepcopy`` of the model copies it along.
"""
from __future__ import annotations

import inspect
import itertools
import linecache
from collections import OrderedDict
from typing import Any, Callable, Protocol

import torch
import torch.fx

from ..capture.held_objects import held_output_leaves
from ..compat import GENERATED_SPEC_READS, outside_traces, pytree_info, tree_map
from .call_signature import call_signature, call_sizes, fixed_dims, hooked_submodules

MAX_GRAPHS = 16  # graphs a host keeps (the oldest goes first); the analysed call's graphs always stay

_serial = itertools.count()


def compile_graph(graph: torch.fx.Graph) -> Callable[..., Any]:
    """Python function ``forward(self, ...)`` generated from ``graph``. A graph that flattens structured
    arguments reads its pytree specs from the function's own globals, not from ``self``, so graphs of several
    call signatures can serve one module."""
    code = graph.python_code(root_module="self")
    in_spec, out_spec = GENERATED_SPEC_READS
    src = code.src.replace(in_spec, "_fxsurgery_in_spec").replace(out_spec, "_fxsurgery_out_spec")
    key = f"<fxsurgery-{next(_serial)}>"
    linecache.cache[key] = (len(src), None, src.splitlines(True), key)
    scope = dict(code.globals)
    info = pytree_info(graph)
    if info is not None:
        scope["_fxsurgery_in_spec"], scope["_fxsurgery_out_spec"] = info.in_spec, info.out_spec
    exec(compile(src, key, "exec"), scope)
    return scope["forward"]


class CallServer(Protocol):
    """What serves a host's calls of a signature it holds no graph for."""

    def serve(self, module: torch.nn.Module, args: tuple, kwargs: dict, training: bool,
              hooked: tuple[str, ...]) -> tuple[torch.fx.Graph | None, str]:
        """A graph for this call (count constants bound to the host's current widths) and how it was made;
        or None and why the host's own forward serves it. Raises when neither can serve it."""

    def own_forward(self, key: tuple) -> Callable[..., Any]:
        """The host's own forward for calls of signature ``key``, as a function of (module, *args, **kwargs), its
        taps still run."""

    def state_forward(self, module: torch.nn.Module, key: tuple,
                      call: tuple[tuple, dict]) -> Callable[..., Any] | None:
        """For a call of signature ``key`` whose graph returns state (a key/value cache): the host's own forward,
        storing one zero unit for each group left with no units, or None where no group is empty or the own
        forward does not follow the widths."""


class GraphForward:
    """Runs the graph captured for the call's signature (train/eval mode included)."""

    def __init__(self, module: torch.nn.Module, graphs: dict[bool, torch.fx.Graph], analysed: tuple[tuple, dict],
                 server: CallServer | None = None, compiled: dict[int, Callable[..., Any]] | None = None):
        self.module = module
        self.server = server
        self.inner = [(name, m) for name, m in module.named_modules() if name]  # whose hooks a graph would skip
        # the analysed call's tensors as meta tensors of their shapes: what keying its graphs again reads
        self.analysed_call = tree_map(lambda t: t.to("meta") if torch.is_tensor(t) else t, analysed)
        # by call signature: the input dims its graphs fix, and a graph of it (whose input spec flattens a call)
        self.fixed: dict[tuple, tuple[tuple[int, int], ...]] = {}
        self.flattens: dict[tuple, torch.fx.Graph] = {}
        self.graphs: OrderedDict[tuple, torch.fx.Graph | None] = OrderedDict()
        self.served: dict[tuple, str] = {}
        self.fns: dict[tuple, Callable[..., Any]] = {}
        self.stores_state: set[tuple] = set()  # keys whose graph returns state (a cache) at the units' widths
        self.analysed_in: dict[bool, tuple] = {}
        for mode, g in graphs.items():
            self.analysed_in[mode] = self._admit(call_signature(*analysed, mode), g, analysed, "analysed")
        self.analysed = set(self.analysed_in.values())
        self.compile(compiled)

    def compile(self, compiled: dict[int, Callable[..., Any]] | None = None) -> None:
        """Generate the code of every graph (count-dependent constants are host attributes, read at run time);
        ``compiled``: code generated before, by graph id (hosts built alike share their graphs and its code)."""
        compiled = {} if compiled is None else compiled
        for key, g in self.graphs.items():
            if key in self.fns:
                continue
            if g is None:
                self.fns[key] = self.server.own_forward(key[0])
                continue
            if id(g) not in compiled:
                compiled[id(g)] = compile_graph(g)
            self.fns[key] = compiled[id(g)]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, torch.fx.Proxy) for a in (*args, *kwargs.values())):  # a symbolic trace runs through
            return self.fns[self.analysed_in[self.module.training]](self.module, *args, **kwargs)
        key = self._held(args, kwargs, self.module.training)
        fn = self.fns[key]
        if key in self.stores_state and self.server is not None:
            # a group left with no units would be stored empty, and code reading the state takes an empty tensor
            # for no entries (a cache's length read off its first layer's keys): the own forward stores one zero
            # unit, as it does for the calls that pass the state back
            fn = self.server.state_forward(self.module, key[0], (args, kwargs)) or fn
        return fn(self.module, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        """The host's own forward's parameters: frameworks read them (the HF Trainer keeps the batch columns
        the model's forward names)."""
        return inspect.signature(type(self.module).forward.__get__(self.module))

    def graph_for(self, args: tuple, kwargs: dict, training: bool) -> torch.fx.Graph | None:
        """The graph that serves this call in the given mode (None: the host's own forward serves it)."""
        return self.graphs[self._held(args, kwargs, training)]

    def _key(self, signature: tuple, args: tuple, kwargs: dict) -> tuple:
        """A call's key: its signature and its sizes at the input dims the graphs of that signature fix."""
        dims = self.fixed.get(signature, ())
        return signature, (call_sizes(self.flattens[signature], dims, args, kwargs) if dims else ())

    def _held(self, args: tuple, kwargs: dict, training: bool) -> tuple:
        """The call's key, served first if no graph (or own forward) is held for it."""
        hooked = hooked_submodules(self.inner)
        signature = call_signature(args, kwargs, training, hooked)
        key = self._key(signature, args, kwargs)
        if key not in self.fns:
            key = self._serve(signature, args, kwargs, training, hooked)
        return key

    def _admit(self, signature: tuple, graph: torch.fx.Graph | None, call: tuple[tuple, dict], how: str) -> tuple:
        """Hold ``graph`` for calls of ``signature`` with ``call``'s sizes at the dims it fixes; returns its key. A
        graph fixing dims its signature's others did not makes those dims part of the key: the analysed graphs
        are keyed again by the analysed call's sizes, the others go (served again when called)."""
        dims = {(i, d) for i, d, _ in fixed_dims(graph)} if graph is not None else set()
        if not dims <= set(self.fixed.get(signature, ())):
            self.fixed[signature] = tuple(sorted(dims | set(self.fixed.get(signature, ()))))
            self.flattens[signature] = graph
            for key in [k for k in self.graphs if k[0] == signature]:
                held, held_how = self.graphs.pop(key), self.served.pop(key)
                self.fns.pop(key, None)
                self.stores_state.discard(key)
                if held_how == "analysed":
                    mode = next(m for m, k in self.analysed_in.items() if k == key)
                    self.analysed_in[mode] = self._admit(signature, held, self.analysed_call, held_how)
            self.analysed = set(self.analysed_in.values())
        key = self._key(signature, *call)
        self.graphs[key], self.served[key] = graph, how
        if graph is not None and held_output_leaves(graph):
            self.stores_state.add(key)
        return key

    @torch.compiler.disable
    def _serve(self, signature: tuple, args: tuple, kwargs: dict, training: bool, hooked: tuple[str, ...]) -> tuple:
        """Get a graph for a call of a new key from the server (in the call's mode); returns the key it is held
        under. The server's analysis runs outside any trace of the call (``torch.export``'s: a trace would fake
        its values and record its ops); only the graph it returns runs in the trace."""
        if self.server is None:
            raise TypeError(f"{type(self.module).__name__}: this call differs from the one its graph was "
                            "captured on, and nothing can capture another")
        with outside_traces():
            graph, how = self.server.serve(self.module, args, kwargs, training, hooked)
        while len(self.graphs) >= MAX_GRAPHS + len(self.analysed):
            oldest = next(k for k in self.graphs if k not in self.analysed)
            del self.graphs[oldest], self.served[oldest]
            self.fns.pop(oldest, None)
            self.stores_state.discard(oldest)
        key = self._admit(signature, graph, (args, kwargs), how)
        self.compile()
        return key

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["fns"]  # generated code is rebuilt, not pickled
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.fns = {}
        self.compile()

    @staticmethod
    def of(module: torch.nn.Module) -> "GraphForward | None":
        fwd = module.__dict__.get("forward")
        return fwd if isinstance(fwd, GraphForward) else None

    def install(self) -> None:
        self.module.forward = self

"""The concrete-shape front end: record a module's computation with real example inputs (``torch.export``).

Symbolic tracing sees proxies, so code that branches on shapes, checks tensor types (einops) or was written for
``torch.export`` / ``torch.compile`` (Hugging Face transformers) cannot be traced. ``torch.export`` runs the
Python code on fake tensors of the example shapes, with every input dim marked dynamic (``Dim.AUTO``): sizes
that follow the batch and token counts stay symbolic in the graph (read from the inputs at run time), sizes
fixed by the parameters become literals, and those that follow unit counts are rewritten like any constant.
The ATen graph is lowered to torch-level ops (``aten``), so one op table reads both front ends.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Iterator

import torch
import torch.fx
import torch.nn as nn
from torch.export import Dim

from ..compat import EXPORT_SPECIALISATION_LOGGER, flatten_to_spec, pytree_info, tree_leaves, tree_map
from ..errors import TraceError
from ..runtime.call_signature import FIXED_SIZES
from .aten import lower
from .calls import buffers_kept, forked_rng, materialize, real_values, training_mode
from .grad_regions import inline_grad_regions
from .held_objects import holders_registered, rebuild_held_outputs, tensor_holders
from .slice_fills import fills_as_concatenation
from .tracer import CODE_CONSTANT


def _dynamic_shapes(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Dynamic dims, keyed like ``forward``'s parameters: the batch dim of every tensor input, the token dim of
    sequences (rank 2 or 3: ids, or tokens by features), and any dim of a larger input as long as the token
    dim (an attention mask [batch, 1, tokens, tokens]). Other dims stay as captured: a model's image size is
    fixed by its patch grid, and symbolic image sizes make window arithmetic slow to capture."""
    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    tensors = [t for t in tree_leaves(bound.arguments) if torch.is_tensor(t)]
    tokens = {t.shape[1] for t in tensors if t.dim() in (2, 3)}

    def dims(t: Any) -> Any:
        if not torch.is_tensor(t) or t.dim() == 0:
            return None
        if t.dim() in (2, 3):
            return {0: Dim.AUTO, 1: Dim.AUTO}
        return {d: Dim.AUTO for d in range(t.dim()) if d == 0 or t.shape[d] in tokens}

    return {name: tree_map(dims, value) for name, value in bound.arguments.items()}


def capture(module: nn.Module, name: str, args: tuple, kwargs: dict, training: bool, *,
            replayed: bool = True) -> tuple[torch.fx.GraphModule, list]:
    """Capture ``module`` in the given mode; returns the graph module (rooted at ``module``, whose parameters
    its ``get_attr`` nodes read) and the values of its placeholders. ``replayed``: a graph to install, with
    dynamic dims and checked to compute what the module does; a graph only read to locate hosts is neither. A module
    on the meta device (built without memory) is captured on meta inputs: export reads shapes, and a real input
    beside its meta weights would be a device mismatch."""
    real_args, real_kwargs = args, kwargs = materialize((args, kwargs))
    on_meta = any(t.is_meta for t in [*module.parameters(), *module.buffers()])
    if on_meta:
        args, kwargs = tree_map(lambda t: t.to("meta") if torch.is_tensor(t) else t, (args, kwargs))
    label = name or "the model"
    expected = _eager_outputs(module, args, kwargs, training=training, label=label)
    holders = tensor_holders(expected)  # a key/value cache it returns: registered for the capture (``held_objects``)
    with holders_registered(holders):
        exported = _exported(module, args, kwargs, training=training, dynamic=replayed, label=label)
        graph = exported.graph
        rebuild_held_outputs(graph, holders)
    for node in list(graph.nodes):
        if node.op == "call_module" and not node.users:  # the input guards export adds
            graph.erase_node(node)
    try:
        inline_grad_regions(exported, graph)
    except TraceError as e:
        raise TraceError(f"cannot capture {name or 'the model'} ({type(module).__name__}): {e}") from e
    fills_as_concatenation(graph)
    lower(graph)
    _drop_reassignments(exported, graph, label=name or "the model")
    for node in graph.nodes:  # the analysis reads module paths; export's fake values are neither needed nor picklable
        fixed = _fixed_sizes(node)
        node.meta = {"nn_module_stack": node.meta["nn_module_stack"]} if "nn_module_stack" in node.meta else {}
        if fixed:
            node.meta[FIXED_SIZES] = fixed
    _keep_constants(module, exported, graph)
    _follow_device(module, graph)
    values = flatten_to_spec((args, kwargs), pytree_info(graph).in_spec)
    gm = torch.fx.GraphModule(module, graph, type(module).__name__)  # run at once: no lazy code
    gm.graph.lint()  # against the module the graph now reads, with the lifted constants it was given
    if replayed:  # on real values (a meta module's stand in) and with the objects' tensors compared too
        with real_values(module, gm), holders_registered(holders):
            if on_meta:
                expected = _eager_outputs(module, real_args, real_kwargs, training=training, label=label)
            _check_replay(module, gm, (real_args, real_kwargs), expected, training=training, label=label)
    return gm, list(values)


def _fixed_sizes(node: torch.fx.Node) -> tuple[tuple[int, int], ...]:
    """The (dim, size) pairs of an input the exported graph holds at one size (2 or more; sizes 0 and 1 are in
    every call's signature): a call with another size there needs a graph of its own (``call_signature``)."""
    value = node.meta.get("val") if node.op == "placeholder" else None
    if not isinstance(value, torch.Tensor):
        return ()
    return tuple((dim, size) for dim, size in enumerate(value.shape) if type(size) is int and size > 1)


def _exported(module: nn.Module, args: tuple, kwargs: dict, *, training: bool, dynamic: bool,
              label: str) -> torch.fx.GraphModule:
    """``module`` exported in mode ``training`` (with dynamic dims if ``dynamic``), as a graph module."""
    leaves = [t for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)]
    try:
        with training_mode(module, training), forked_rng(leaves), _quiet_export():
            shapes = _dynamic_shapes(module, args, kwargs) if dynamic else None
            return torch.export.export(module, args, kwargs, dynamic_shapes=shapes, strict=False).module()
    except Exception as e:  # export raises many types; the user needs the module and the cause
        raise TraceError(f"cannot capture {label} ({type(module).__name__}) with torch.export: "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


def _eager_outputs(module: nn.Module, args: tuple, kwargs: dict, *, training: bool, label: str) -> Any:
    """What ``module`` returns on the example inputs in mode ``training`` (seeded, its buffers put back): the objects
    the capture must flatten, and what the captured graph must reproduce."""
    leaves = [t for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)]
    try:
        with training_mode(module, training), forked_rng(leaves), torch.no_grad(), buffers_kept(module):
            torch.manual_seed(0)
            return module(*args, **kwargs)
    except Exception as e:  # the module's own code refuses the call
        raise TraceError(f"cannot capture {label} ({type(module).__name__}): it fails on the example call: "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """export logs each dim it specialises (a batch of one, a fixed token count): expected, not news."""
    logger = logging.getLogger(EXPORT_SPECIALISATION_LOGGER)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _check_replay(module: nn.Module, gm: torch.fx.GraphModule, call: tuple[tuple, dict], outputs: Any, *,
                  training: bool, label: str) -> None:
    """The captured graph must compute what the module computed on the example inputs (``outputs``, same random
    draws): code that caches state between calls, or reads something the capture froze, is refused here."""
    args, kwargs = call
    leaves = [t for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)]
    expected = [t for t in tree_leaves(outputs) if torch.is_tensor(t)]
    try:  # on the buffers as given: batch norm's statistics move in training mode, caches get filled
        with training_mode(module, training), forked_rng(leaves), torch.no_grad():
            with buffers_kept(module):  # its forward, not its call: fx's call prints a failure to stderr
                torch.manual_seed(0)
                got = [t for t in tree_leaves(gm.forward(*args, **kwargs)) if torch.is_tensor(t)]
    except Exception as e:  # the graph does not even run where the module does
        raise TraceError(f"the graph captured from {label} ({type(module).__name__}) does not run: "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    shapes_agree = [t.shape for t in got] == [t.shape for t in expected]
    if not shapes_agree or any(not torch.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)
                               for a, b in zip(got, expected) if a.is_floating_point()):
        raise TraceError(f"the graph captured from {label} ({type(module).__name__}) does not reproduce its "
                         f"outputs on the example inputs")


def _drop_reassignments(exported: torch.fx.GraphModule, graph: torch.fx.Graph, *, label: str) -> None:
    """Code that assigns a new tensor of another shape to a buffer (a table of positions cached at the first call,
    ``self.table = make_table(n)``) is recorded as a ``copy_`` of the new value into the old buffer, which cannot
    run. Where nothing else reads the old buffer the new value is computed from the call alone: the graph
    computes it at every call and the write is dropped. A new value made from the old one (state that grows
    from call to call) cannot be kept by a graph: refused, naming the node."""
    for node in list(graph.nodes):
        if node.op != "call_method" or node.target != "copy_" or node.users:
            continue
        target, value = node.args[:2]
        if not isinstance(target, torch.fx.Node) or target.op != "get_attr" or not isinstance(value, torch.fx.Node):
            continue
        old, new = _lookup(exported, target.target), value.meta.get("val")
        if not torch.is_tensor(new) or _may_fit(old.shape, new.shape):
            continue
        if len(target.users) > 1:
            raise TraceError(f"cannot capture {label}: {node.name} replaces {target.target} "
                             f"{tuple(old.shape)} with a tensor of shape {tuple(new.shape)} made from its old value; "
                             "a graph cannot keep state that changes shape between calls")
        graph.erase_node(node)
        graph.erase_node(target)


def _may_fit(fixed: torch.Size, recorded: torch.Size) -> bool:
    """Whether a recorded shape may be a tensor's fixed shape at some call (a symbolic size may be any size): then
    the write is an update in place, kept."""
    return len(fixed) == len(recorded) and all(type(b) is not int or a == b for a, b in zip(fixed, recorded))


def _keep_constants(module: nn.Module, exported: torch.fx.GraphModule, graph: torch.fx.Graph) -> None:
    """Tensors the capture lifted out of the code (not parameters or buffers of ``module``) become plain
    attributes of ``module`` named like those of a symbolic trace, so the host keeps them and its state_dict
    keeps its keys."""
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            _lookup(module, node.target)
            continue
        except AttributeError:
            pass
        value = _lookup(exported, node.target)
        k = 0
        while f"{CODE_CONSTANT}{k}" in module.__dict__:
            k += 1
        module.__dict__[f"{CODE_CONSTANT}{k}"] = value
        node.target = f"{CODE_CONSTANT}{k}"


def _follow_device(module: nn.Module, graph: torch.fx.Graph) -> None:
    """Export writes the device of the tensors the code makes (``torch.arange(n, device=x.device)``) as the one it
    ran on, and the constants it lifts (``torch.tensor(..., device=x.device)``, kept as plain attributes) stay
    there: each call makes its tensor on the device of ``module``'s first tensor at run time, and each such constant
    is moved there (no copy where it is), so the graph runs where the module is moved (a model analysed on the CPU
    and trained on a GPU, or built on the meta device and allocated since)."""
    state = next((name for name, _ in (*module.named_parameters(), *module.named_buffers())), None)
    if state is None:
        return
    ran_on = _lookup(module, state).device

    def baked(value: Any) -> bool:
        return isinstance(value, torch.device) and value == ran_on

    calls = [n for n in graph.nodes if n.op in ("call_function", "call_method")
             and any(baked(v) for v in (*n.args, *n.kwargs.values()))]
    constants = [n for n in graph.nodes if n.op == "get_attr" and n.target.startswith(CODE_CONSTANT)
                 and torch.is_tensor(value := _lookup(module, n.target)) and value.device == ran_on]
    if not calls and not constants:
        return
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]) if placeholders else graph.inserting_before(None):
        tensor = graph.get_attr(state)
    with graph.inserting_after(tensor):
        device = graph.call_function(getattr, (tensor, "device"))
    for node in calls:
        node.args = tuple(device if baked(v) else v for v in node.args)
        node.kwargs = {k: device if baked(v) else v for k, v in node.kwargs.items()}
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in constants:
        with graph.inserting_after(node if order[node] > order[device] else device):
            moved = graph.call_method("to", (node, device))
        for user in [u for u in node.users if u is not moved]:
            user.replace_input_with(node, moved)


def _lookup(root: nn.Module, target: str) -> Any:
    owner, _, attr = target.rpartition(".")
    mod = root.get_submodule(owner)
    if not hasattr(mod, attr):
        raise AttributeError(target)
    return getattr(mod, attr)


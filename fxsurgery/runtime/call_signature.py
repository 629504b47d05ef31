"""What an installed graph is specialised to: the call it was captured on.

Tracing freezes every Python value a call passes (flags such as ``output_attentions``, which arguments were
None) and captures tensors of one rank and dtype, in one train/eval mode. A call's signature says all of that;
a graph serves exactly the calls of its signature, and another signature gets a graph of its own.
"""
from __future__ import annotations

import enum
import inspect
from typing import Any, Callable

import torch

from ..compat import flatten_to_spec, module_hooks, pytree_info

FIXED_SIZES = "fxsurgery_fixed_sizes"  # a placeholder's meta: the (dim, size) pairs its graph holds at one size
_CONSTANTS = (bool, int, float, str, torch.dtype, torch.device, enum.Enum)


def _container(value: Any) -> bool:
    """A tuple (named ones too), or a plain list or dict; a subclass of list or dict is an object of its own."""
    return isinstance(value, tuple) or type(value) in (list, dict)


def value_signature(value: Any) -> Any:
    """What a graph captured on ``value`` depends on: a tensor's dtype and, per dim, whether it is empty, one or
    more (a capture specialises sizes 0 and 1: a batch of one is a call of its own), a Python constant itself
    (with its type: True is not 1), the structure of a container (a ``torch.Size`` is the tuple of its sizes: an
    installed caller passes the sizes it read as a plain tuple); any other object only by its type."""
    if isinstance(value, torch.Tensor):  # a symbolic size (a capture running through) stands for many
        return torch.Tensor, value.dtype, tuple(min(size, 2) if type(size) is int else 2 for size in value.shape)
    if value is None:
        return None
    if isinstance(value, _CONSTANTS):
        return type(value), value
    if not _container(value):
        return type(value), id(type(value))
    if isinstance(value, dict):
        return dict, tuple((k, value_signature(v)) for k, v in value.items())
    return (tuple if type(value) is torch.Size else type(value)), tuple(value_signature(v) for v in value)


def call_signature(args: tuple, kwargs: dict, training: bool, hooked: tuple[str, ...] = ()) -> tuple:
    """The key of a call: train/eval mode, every argument's signature (keyword names included), and the submodules
    inside the host that carry hooks (a graph inlines their calls, so only the host's own forward runs them)."""
    return training, value_signature(args), value_signature(kwargs), hooked


def fixed_dims(graph: torch.fx.Graph) -> tuple[tuple[int, int, int], ...]:
    """The input dims ``graph`` holds at one size, as (input index, dim, size): ``torch.export`` keeps a dim
    symbolic only where its code allows and the capture asked (a key length a mask carries may be baked into an
    ``arange``); the symbolic tracer fixes none."""
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    return tuple((i, dim, size) for i, node in enumerate(inputs) for dim, size in node.meta.get(FIXED_SIZES, ()))


def call_sizes(graph: torch.fx.Graph, dims: tuple[tuple[int, int], ...], args: tuple, kwargs: dict) -> tuple:
    """The sizes of the call's inputs at ``dims`` ((input index, dim) pairs, inputs as ``graph`` flattens them)."""
    if not dims:
        return ()
    inputs = flatten_to_spec((args, kwargs), pytree_info(graph).in_spec)
    return tuple(inputs[i].shape[d] if torch.is_tensor(inputs[i]) and inputs[i].dim() > d else None
                 for i, d in dims)


def serves_sizes(graph: torch.fx.Graph, args: tuple, kwargs: dict) -> bool:
    """Whether the call has every input size ``graph`` fixed."""
    fixed = fixed_dims(graph)
    return call_sizes(graph, tuple((i, d) for i, d, _ in fixed), args, kwargs) == tuple(s for *_, s in fixed)


def hooked_submodules(inner: list[tuple[str, torch.nn.Module]]) -> tuple[str, ...]:
    """The names of the modules in ``inner`` with forward or backward hooks of their own (HF's output recorders,
    a user's feature hooks); fxsurgery's own (its call recorder, its guards of calls from outside a host) do not
    count."""
    return tuple(name for name, m in inner if any(not getattr(h, "fxsurgery_internal", False) for h in module_hooks(m)))


def holds_objects(value: Any) -> bool:
    """The call passes an object that is neither a tensor nor a Python constant (a key/value cache): a graph
    takes tensors and constants only, and would drop what the object's own methods do."""
    if value is None or isinstance(value, (torch.Tensor, *_CONSTANTS)):
        return False
    if not _container(value):
        return True
    return any(holds_objects(v) for v in (value.values() if isinstance(value, dict) else value))


def without_objects(value: Any) -> Any:
    """The call with every object argument (a key/value cache) replaced by None: the call a graph can take,
    which the analysis reads (the host's own forward serves the calls that pass the object)."""
    if not _container(value):
        return None if holds_objects(value) else value
    if isinstance(value, dict):
        return {k: without_objects(v) for k, v in value.items()}
    items = [without_objects(v) for v in value]
    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)


def differing_arguments(forward: Callable[..., Any], call: tuple[tuple, dict],
                        analysed: tuple[tuple, dict]) -> list[str]:
    """The arguments (by name, ``**kwargs`` entries included) where ``call`` differs from the ``analysed`` call,
    each told as what it is now and what it was."""
    now, then = _bound(forward, *call), _bound(forward, *analysed)
    out = []
    for name in dict.fromkeys([*now, *then]):
        a, b = now.get(name, inspect.Parameter.empty), then.get(name, inspect.Parameter.empty)
        if value_signature(a) != value_signature(b) or (a is inspect.Parameter.empty) != (b is inspect.Parameter.empty):
            out.append(f"{name}={_show(a)} (analysed with {_show(b)})")
    return out


def _bound(forward: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by parameter name, defaults applied, ``**kwargs`` entries as names of their own."""
    try:
        signature = inspect.signature(forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {**{f"argument {i}": a for i, a in enumerate(args)}, **kwargs}
    bound.apply_defaults()
    out = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            out.update({f"{name}[{i}]": v for i, v in enumerate(value)})
        else:
            out[name] = value
    return out


def _show(value: Any) -> str:
    if value is inspect.Parameter.empty:
        return "not passed"
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-d {str(value.dtype).removeprefix('torch.')} tensor"
    if value is None or isinstance(value, _CONSTANTS):
        return repr(value)
    return f"a {type(value).__name__}"

"""The public entry point: find unit groups in a model and remove or clone units in place."""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from . import constants as K
from .decompositions import CALLER_HOSTED
from .errors import AnalysisError, TraceError
from .graph_forward import GraphForward
from .grouping import Analysis, GroupSpec, Refusal, analyse, common_module
from .labelling import Labeller
from .rules import RULES
from .slicing import ParamSlice, clone_state, clone_unit, state_tensors
from .tracing import capture_inputs, forked_rng, inline_helpers, materialize, trace, training_mode


def _kind(lab: Labeller, node: torch.fx.Node) -> str:
    """What ``node`` held when ``lab`` ran its graph: "tensor", "none" or "other"."""
    shape = lab.shapes.get(node)
    if shape is not None and all(isinstance(d, int) for d in shape):
        return "tensor"
    return "none" if node in lab.values and lab.values[node] is None else "other"


def _caller(gm: torch.fx.GraphModule, path: str) -> str:
    """The module that called the module ``path`` in ``gm``'s trace ("" for the traced root)."""
    for node in gm.graph.nodes:
        stack = [p for p, _ in node.meta.get("nn_module_stack", {}).values()]
        if path in stack:
            i = stack.index(path)
            return stack[i - 1] if i else ""
    return ""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


@dataclass(eq=False)
class UnitGroup:
    """Interchangeable units (attention heads or FFN channels) of one layer, operated on together.

    ``count`` is always current; ``max_count`` is the count in the model as analysed. ``exact`` is
    True when clone and remove are function-preserving for this group."""

    name: str
    kind: str
    module: str
    count: int
    max_count: int
    exact: bool
    slices: tuple[ParamSlice, ...]
    notes: tuple[str, ...] = ()
    min_count: int = 0
    host: str = ""
    sink_module: str | None = None
    tap_outer: int = 1
    tap_inner: int = 0
    tap_dim: int = -1
    constants: list[K.ConstantSpec] = field(default_factory=list, repr=False)

    def __repr__(self) -> str:
        return f"UnitGroup({self.name!r}, {self.kind}, {self.count}/{self.max_count}, exact={self.exact})"


@dataclass
class HostAnalysis:
    """The graphs and groups found for one host module; a copy serves any host built alike."""

    graphs: dict[bool, torch.fx.Graph]
    specs: list[tuple[GroupSpec, list[K.ConstantSpec]]]
    refusals: list[Refusal]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # constants tracing created

    def copy(self) -> "HostAnalysis":
        """Fresh graphs, with every constant re-pointed to the same-named node of its graph's copy."""
        copies = {id(g): copy.deepcopy(g) for g in self.graphs.values()}
        by_name = {gid: {n.name: n for n in g.nodes} for gid, g in copies.items()}
        specs = [(spec, [K.ConstantSpec(by_name[id(c.node.graph)][c.node.name], c.path, c.per_unit) for c in consts])
                 for spec, consts in self.specs]
        return HostAnalysis({m: copies[id(g)] for m, g in self.graphs.items()}, specs, self.refusals, self.tensors)


def fingerprint(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """Everything tracing and analysis read: module types, plain attributes, parameter shapes,
    integer buffer contents, and the call's input shapes and frozen values."""
    parts = []
    for name, m in module.named_modules():
        attrs = tuple(sorted((k, repr(v)) for k, v in vars(m).items()
                             if not k.startswith("_") and not isinstance(v, (torch.Tensor, nn.Module))))
        params = tuple((k, tuple(p.shape), p.dtype) for k, p in m.named_parameters(recurse=False))
        buffers = tuple((k, tuple(b.shape), b.dtype, None if b.is_floating_point() else hash(b.cpu().numpy().tobytes()))
                        for k, b in m.named_buffers(recurse=False))
        parts.append((name, type(m), attrs, params, buffers))
    call = tuple((tuple(t.shape), t.dtype) if torch.is_tensor(t) else repr(t)
                 for t in pytree.tree_leaves((args, kwargs)))
    return tuple(parts), call


@dataclass
class LeftOut:
    """A part of the model the analysis did not turn into a group, and why."""

    module: str
    reasons: list[str]


class Surgeon:
    """Trace ``model``, find its unit groups, and operate on them in place.

    The model keeps its class, methods, parameter objects and ``state_dict`` keys; the modules that
    host units get a rewritten forward. Every group is checked once on the live model at analysis:
    a clone must leave the host's outputs unchanged and a removal must equal masking the unit."""

    def __init__(self, model: nn.Module, example_inputs: Any):
        self.model = model
        self.example_inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        self.groups: list[UnitGroup] = []
        self.left_out: list[LeftOut] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._forwards: dict[str, GraphForward] = {}
        self._inputs: dict[str, tuple[tuple, dict]] = {}
        self._checked: dict[tuple, str | None] = {}
        self._templates: dict[tuple, HostAnalysis] = {}
        self._slots: dict[str, list[tuple[str, int]]] = {}  # group name -> (host attribute, per-unit value)
        self._analyse()

    # ------------------------------------------------------------------ public API

    def group(self, name: str) -> UnitGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no group named {name!r}; groups: {[g.name for g in self.groups]}")

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep ``optimizer``'s per-parameter state in step with every remove and clone."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        for g in self.groups:
            for sl in g.slices:
                state_tensors([optimizer], self._tensor(sl.name))
        if all(o is not optimizer for o in self._optimizers):
            self._optimizers.append(optimizer)

    def remove(self, group: UnitGroup, index: int) -> None:
        """Delete unit ``index``; the remaining units keep their relative order."""
        g = self._own(group)
        if not 0 <= index < g.count:
            raise IndexError(f"{g.name}: unit {index} out of range for {g.count} units")
        self._keep(g, torch.tensor([k for k in range(g.count) if k != index], dtype=torch.long))

    def keep(self, group: UnitGroup, indices: Sequence[int]) -> None:
        """Keep only the units ``indices``, in that order, in one edit (a batched ``remove``)."""
        g = self._own(group)
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        if idx.numel() and (idx.min() < 0 or idx.max() >= g.count):
            raise IndexError(f"{g.name}: units {idx.tolist()} out of range for {g.count} units")
        if torch.unique(idx).numel() != idx.numel():
            raise ValueError(f"{g.name}: repeated units in {idx.tolist()}")
        self._keep(g, idx)

    def _keep(self, g: UnitGroup, idx: torch.Tensor) -> None:
        """The one edit behind ``remove`` and ``keep``: parameters and optimizer state alike."""
        if idx.numel() < g.min_count:
            why = "; ".join(g.notes) if g.kind == "head" else "a layer keeps at least one channel"
            raise ValueError(f"{g.name}: cannot go below {g.min_count} unit(s) ({why})")
        count = g.count
        self._edit(g, idx.numel(), lambda sl, t: sl.keep(t, count, idx), lambda sl, t: sl.keep(t, count, idx))

    def clone(self, group: UnitGroup, parent: int, noise_std: float = 0.0,
              generator: torch.Generator | None = None, relative: bool = False) -> int:
        """Append a copy of unit ``parent``; its output weights are split W/2 + ε and W/2 − ε with
        ε ~ N(0, σ²), σ = ``noise_std`` (times the std of the parent's output weights if ``relative``).
        Returns the new unit's index."""
        g = self._own(group)
        if not 0 <= parent < g.count:
            raise IndexError(f"{g.name}: parent {parent} out of range for {g.count} units")
        noise = self._noise(g, parent, noise_std, generator, relative)
        new = g.count
        self._edit(g, g.count + 1,
                   lambda sl, t: clone_unit(t, sl, g.count, parent, noise.get(sl.name)),
                   lambda sl, t: clone_state(t, sl, g.count, parent))
        return new

    def unit_norms(self, group: UnitGroup) -> torch.Tensor:
        """L2 norm of each unit's parameters (all its slices together), shape ``(count,)``."""
        g = self._own(group)
        total = None
        for sl in g.slices:
            v = sl.units(self._tensor(sl.name).detach(), g.count).float()
            sq = v.square().sum(dim=[d for d in range(v.dim()) if d != sl.dim + 1])
            total = sq if total is None else total + sq.to(total.device)
        return total.sqrt()

    def tap(self, group: UnitGroup, fn: Callable[[torch.Tensor], None]) -> torch.utils.hooks.RemovableHandle:
        """Call ``fn(a)`` in every forward with the activations that feed the group's output
        projection, viewed as ``(*lead, count, per_unit)``. ``handle.remove()`` stops it."""
        g = self._own(group)
        if g.sink_module is None:
            raise ValueError(f"{g.name}: its output projection is not a Linear or convolution module; cannot tap it")
        sink = self.model.get_submodule(g.sink_module)

        def hook(module: nn.Module, args: tuple) -> tuple:
            x = args[0].movedim(g.tap_dim, -1).unflatten(-1, (g.tap_outer, g.count, g.tap_inner))
            a = x.movedim(-3, -2).flatten(-2)  # (*lead, count, outer*inner): a view when outer is 1
            fn(a)
            x = a.unflatten(-1, (g.tap_outer, g.tap_inner)).movedim(-2, -3).flatten(-3)
            return (x.movedim(-1, g.tap_dim), *args[1:])  # the projection reads a: gradients reach it

        return sink.register_forward_pre_hook(hook)

    def explain(self) -> str:
        """A table of the groups (count / max, exactness, sliced tensors, rewritten constants) and of
        what was left out and why."""
        lines = [f"fxsurgery: {len(self.groups)} unit groups in {type(self.model).__name__}"]
        w = max([len(g.name) for g in self.groups] + [5])
        lines.append(f"{'group':<{w}}  {'kind':<7}  {'module':<{w}}  {'units':>9}  exact")
        for g in self.groups:
            lines.append(f"{g.name:<{w}}  {g.kind:<7}  {g.module:<{w}}  {f'{g.count}/{g.max_count}':>9}  "
                         f"{'yes' if g.exact else 'no'}")
            lines.append("    slices: " + ", ".join(_describe(sl) for sl in g.slices))
            if g.constants:
                lines.append("    constants: " + ", ".join(c.describe() for c in _unique_constants(g.constants)))
            for note in g.notes:
                lines.append(f"    note: {note}")
        if self.left_out:
            lines.append("left out:")
            for lo in self.left_out:
                lines.append(f"  {lo.module or '(model)'}: " + "; ".join(lo.reasons))
        return "\n".join(lines)

    # ------------------------------------------------------------------ analysis

    def _analyse(self) -> None:
        regions, failures = self._regions()
        found: list[str] = []  # modules that host a group
        for prefix, gm, values in regions:
            result = self._label(gm, values, prefix, locate=True)
            for modules in result.located:
                found.append(_join(prefix, self._host_within(prefix, gm, common_module(modules))))
            for r in result.refusals:
                self._leave_out(_join(prefix, common_module(r.modules)), r.reasons)
        hosts = sorted(set(found))
        hosts = [h for h in hosts if not any(h.startswith(o + ".") or (o == "" and h) for o in hosts if o != h)]
        if hosts:
            self._inputs = capture_inputs(self.model, self.example_inputs, [h for h in hosts if h])
            if "" in hosts:
                self._inputs[""] = (self.example_inputs, {})
        for host in hosts:
            self._install(host)
        # modules that did not trace: their parts were analysed on their own where they traced
        for name, err in failures:
            self._leave_out(name, [str(err)])
        if not self.groups:
            if failures:
                raise TraceError("; ".join(str(err) for _, err in failures))
            why = "; ".join(f"{lo.module}: {', '.join(lo.reasons)}" for lo in self.left_out) or "no attention heads or FFN channels"
            raise AnalysisError(f"no unit groups found in {type(self.model).__name__}: {why}")

    def _leave_out(self, module: str, reasons: list[str]) -> None:
        """Report ``module`` as left out (once: a region and its host may find the same refusal)."""
        if LeftOut(module, reasons) not in self.left_out:
            self.left_out.append(LeftOut(module, reasons))

    def _host_within(self, prefix: str, gm: torch.fx.GraphModule, path: str) -> str:
        """The module of ``gm`` (a region traced at ``prefix``) that hosts a group found at ``path``: the
        module itself, or for a caller-hosted torch module the nearest module that called it."""
        while path and type(self.model.get_submodule(_join(prefix, path))) in CALLER_HOSTED:
            path = _caller(gm, path)
        return path

    def _regions(self) -> tuple[list[tuple[str, torch.fx.GraphModule, list]], list[tuple[str, TraceError]]]:
        """The whole model if it traces (plus the modules it keeps as opaque fx leaves), else the
        largest submodules that do."""
        try:
            gm, values = trace(self.model, "", self.example_inputs, {}, self.model.training)
        except TraceError as e:
            return self._submodule_regions([("", e)])
        leaves = [n.target for n in gm.graph.nodes if n.op == "call_module"
                  and not type(gm.get_submodule(n.target)).__module__.startswith("torch.")]
        regions, failures = [("", gm, values)], []
        calls = capture_inputs(self.model, self.example_inputs, leaves) if leaves else {}
        for name in leaves:
            if name in calls:
                try:
                    regions.append((name, *trace(self.model.get_submodule(name), name, *calls[name],
                                                 self.model.training)))
                except TraceError as err:
                    self._leave_out(name, [f"kept opaque by the tracer and not traceable: {err}"])
        return regions, failures

    def _submodule_regions(self, failures: list[tuple[str, TraceError]]) -> tuple[list, list[tuple[str, TraceError]]]:
        names = [n for n, _ in self.model.named_modules() if n]
        calls = capture_inputs(self.model, self.example_inputs, names)
        regions = []

        def visit(prefix: str, module: nn.Module) -> None:
            for child, sub in module.named_children():
                q = _join(prefix, child)
                if q not in calls:  # containers such as ModuleList are never called themselves
                    visit(q, sub)
                    continue
                try:
                    gm, values = trace(sub, q, *calls[q], sub.training)
                    regions.append((q, gm, values))
                except TraceError as err:
                    failures.append((q, err))
                    visit(q, sub)

        visit("", self.model)
        return regions, failures

    def _label(self, gm: torch.fx.GraphModule, values: list, where: str, locate: bool = False) -> Analysis:
        """Label the graph on the meta device (shapes only); data-dependent code runs for real."""
        for meta in (True, False):
            lab = Labeller(gm, RULES, meta=meta)
            try:
                with torch.no_grad(), forked_rng([v for v in values if torch.is_tensor(v)]):
                    lab.run(*(values if meta else materialize(values)))
                break
            except Exception as e:
                if not meta:
                    raise AnalysisError(f"analysis of {where or 'the model'} failed: {type(e).__name__}: {e}") from e
        if inline_helpers(gm.graph, lambda n: _kind(lab, n)):  # helpers it could look into are now inline
            gm.recompile()
            return self._label(gm, values, where, locate)
        return analyse(lab, locate)

    def _install(self, host: str) -> None:
        module = self.model.get_submodule(host) if host else self.model
        args, kwargs = self._inputs[host]
        key = fingerprint(module, args, kwargs)
        if key not in self._templates:  # hosts built alike (every block of a ViT) are analysed once
            self._templates[key] = self._analyse_host(module, host, args, kwargs)
        found = self._templates[key].copy()
        for r in found.refusals:
            self._leave_out(_join(host, common_module(r.modules)), r.reasons)
        module.__dict__.update(found.tensors)  # plain attributes: the state_dict keeps its keys
        slots = [_bind_constants(module, consts, spec.count) for spec, consts in found.specs]
        fwd = GraphForward(module, found.graphs)
        self._forwards[host] = fwd
        fwd.install()
        for (spec, consts), group_slots in zip(found.specs, slots):
            g = self._make_group(host, spec, consts)
            self._slots[g.name] = group_slots
            # identical code, layout and inputs give identical self-check outcomes
            check = (key, tuple((sl.name[len(host):], sl.dim, sl.outer, sl.inner, sl.output) for sl in g.slices))
            if check not in self._checked:
                self._checked[check] = self._verify(g)
            if self._checked[check]:
                self._leave_out(g.module, [f"self-check failed: {self._checked[check]}"])
            else:
                self.groups.append(g)

    def _analyse_host(self, module: nn.Module, host: str, args: tuple, kwargs: dict) -> "HostAnalysis":
        """Trace the host in train and eval mode and find its groups in both graphs."""
        graphs, results, tensors = {}, {}, {}
        for mode in (True, False):
            gm, values = trace(module, host, args, kwargs, mode)
            tensors.update({n.target: getattr(gm, n.target) for n in gm.graph.nodes
                            if n.op == "get_attr" and n.target.startswith("_tensor_constant")})
            if mode is False and gm.code == graphs[True].owning_module.code:
                graphs[False], results[False] = graphs[True], results[True]
                break
            graphs[mode] = gm.graph
            with training_mode(module, mode):
                results[mode] = self._label(gm, values, host)
        eval_specs = {s.sink: s for s in results[False].groups}
        specs, refusals = [], list(results[True].refusals)
        for spec in results[True].groups:
            other = eval_specs.get(spec.sink)
            if other is None or other.count != spec.count:
                refusals.append(Refusal(spec.modules, ["train and eval graphs disagree about this group"]))
                continue
            specs.append((spec, spec.constants + ([] if other is spec else other.constants)))
        return HostAnalysis(graphs, specs, refusals, tensors)

    def _make_group(self, host: str, spec: GroupSpec, consts: list[K.ConstantSpec]) -> UnitGroup:
        module = _join(host, common_module(spec.modules))
        base = f"{module or type(self.model).__name__}:{spec.kind}"
        name = base
        for k in itertools.count(1):
            if all(g.name != name for g in self.groups):
                break
            name = f"{base}{k}"
        slices = tuple(ParamSlice(_join(host, m.name), m.dim, m.outer, m.inner, m.output) for m in spec.members)
        sink_node = spec.sink.rsplit(".", 1)[0]
        projection = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
        sink_module = _join(host, sink_node) if isinstance(self._maybe_module(_join(host, sink_node)), projection) else None
        return UnitGroup(name, spec.kind, module, spec.count, spec.count, spec.exact, slices, tuple(spec.notes),
                         spec.min_count, host, sink_module, spec.tap_outer, spec.tap_inner, spec.tap_dim, consts)

    def _maybe_module(self, name: str) -> nn.Module | None:
        try:
            return self.model.get_submodule(name)
        except AttributeError:
            return None

    def _verify(self, g: UnitGroup) -> str | None:
        """Clone and remove unit 0 on the live host, compare its outputs, and restore everything."""
        module = self.model.get_submodule(g.host) if g.host else self.model
        args, kwargs = materialize(self._inputs[g.host])
        saved = [(t, t.data, t.grad) for t in itertools.chain(module.parameters(), module.buffers())]
        count = g.count
        dtype = saved[0][1].dtype if saved else torch.float32
        tol = {torch.float64: 1e-9, torch.float32: 1e-5}.get(dtype, 1e-2)

        def run() -> list[torch.Tensor]:
            with torch.no_grad():
                return [t for t in pytree.tree_leaves(module(*args, **kwargs)) if torch.is_tensor(t)]

        def restore() -> None:
            for t, data, grad in saved:
                t.data, t.grad = data, grad
            g.count = count
            self._apply_constants(g)
            self._sync_modules(g)

        try:
            with training_mode(module, False), forked_rng(pytree.tree_leaves((args, kwargs))):
                y0 = run()
                if g.exact:
                    noise = self._noise(g, 0, 0.5, None, True)
                    self._edit(g, count + 1, lambda sl, t: clone_unit(t, sl, count, 0, noise.get(sl.name)), None)
                    err = _max_rel_diff(y0, run())
                    restore()
                    if err > tol:
                        return f"a clone changed the outputs by {err:.2e}"
                out = next(sl for sl in g.slices if sl.output)
                w = self._tensor(out.name)
                w.data = w.data.clone()
                out.unit(w.data, count, 0).zero_()
                y_mask = run()
                restore()
                rest = torch.arange(1, count)
                self._edit(g, count - 1, lambda sl, t: sl.keep(t, count, rest), None)
                y_rm = run()
                err = _max_rel_diff(y_mask, y_rm)
                if g.exact and err > tol:
                    return f"a removal differs from masking by {err:.2e}"
                if [y.shape for y in y_rm] != [y.shape for y in y0]:
                    return "a removal changed the output shapes"
        except Exception as e:  # report the group, keep the model usable
            return f"{type(e).__name__}: {e}"
        finally:
            restore()
        return None

    # ------------------------------------------------------------------ editing

    def _own(self, group: UnitGroup) -> UnitGroup:
        if not any(group is g for g in self.groups):
            raise ValueError(f"{getattr(group, 'name', group)!r} is not a group of this Surgeon")
        return group

    def _tensor(self, name: str) -> torch.Tensor:
        try:
            return self.model.get_parameter(name)
        except AttributeError:
            return self.model.get_buffer(name)

    def _noise(self, g: UnitGroup, parent: int, std: float, generator: torch.Generator | None,
               relative: bool) -> dict[str, torch.Tensor]:
        out = {}
        if std == 0:
            return out
        for sl in g.slices:
            if not sl.output:
                continue
            w = sl.unit(self._tensor(sl.name).data, g.count, parent)
            sigma = std * (float(w.float().std()) if relative and w.numel() > 1 else 1.0)
            dev = generator.device if generator is not None else w.device
            out[sl.name] = (torch.randn(w.shape, generator=generator, device=dev, dtype=torch.float32) * sigma).to(w)
        return out

    def _edit(self, g: UnitGroup, new_count: int, data_fn: Callable, state_fn: Callable | None) -> None:
        """Compute every new tensor first, then swap them in: a failure leaves the model untouched."""
        tensors = [(sl, self._tensor(sl.name)) for sl in g.slices]
        optimizers = self._optimizers if state_fn is not None else []
        states = [(sl, st, k) for sl, t in tensors for st, k in state_tensors(optimizers, t)]
        new_data = [(t, data_fn(sl, t.data)) for sl, t in tensors]
        new_state = [(st, k, state_fn(sl, st[k])) for sl, st, k in states]
        for t, d in new_data:
            replace_data(t, d)
        for st, k, v in new_state:
            st[k] = v
        g.count = new_count
        self._apply_constants(g)
        self._sync_modules(g)

    def _apply_constants(self, g: UnitGroup) -> None:
        host = self.model.get_submodule(g.host) if g.host else self.model
        for attr, per_unit in self._slots[g.name]:
            host.__dict__[attr] = per_unit * g.count

    def _sync_modules(self, g: UnitGroup) -> None:
        """Keep torch.nn modules' size attributes (used by their repr and forward) truthful."""
        for sl in g.slices:
            owner, _, pname = sl.name.rpartition(".")
            mod = self._maybe_module(owner) if owner else self.model
            sync = next((fn for types, fn in _SIZE_SYNC if isinstance(mod, types)), None)
            if sync is not None:
                sync(mod, pname)


def _sync_linear(mod: nn.Linear, pname: str) -> None:
    if pname == "weight":
        mod.out_features, mod.in_features = mod.weight.shape


def _sync_norm(mod: nn.LayerNorm | nn.RMSNorm, pname: str) -> None:
    if pname == "weight":
        mod.normalized_shape = tuple(mod.weight.shape[-len(mod.normalized_shape):])


def _sync_batch_norm(mod: nn.modules.batchnorm._NormBase, pname: str) -> None:
    mod.num_features = getattr(mod, pname).shape[0]


def _sync_conv(mod: nn.modules.conv._ConvNd, pname: str) -> None:
    """A depthwise convolution (one group per channel) stays depthwise; others keep their groups."""
    if pname == "weight":
        out, per_group = mod.weight.shape[:2]
        if mod.groups == mod.in_channels == mod.out_channels:
            mod.groups = out
        mod.out_channels, mod.in_channels = out, per_group * mod.groups


def _sync_attention(mod: nn.MultiheadAttention, pname: str) -> None:
    """The head count follows the query rows; ``embed_dim`` stays the model width, so the module's own
    forward no longer applies: its host runs the decomposed graph."""
    if pname in ("in_proj_weight", "q_proj_weight"):
        rows = getattr(mod, pname).shape[0] // (3 if pname == "in_proj_weight" else 1)
        mod.num_heads = rows // mod.head_dim


_SIZE_SYNC: list[tuple[type | tuple[type, ...], Callable[[nn.Module, str], None]]] = [
    (nn.Linear, _sync_linear),
    ((nn.LayerNorm, nn.RMSNorm), _sync_norm),
    (nn.modules.batchnorm._NormBase, _sync_batch_norm),
    (nn.modules.conv._ConvNd, _sync_conv),
    (nn.MultiheadAttention, _sync_attention),
]


def _bind_constants(module: nn.Module, consts: list[K.ConstantSpec], count: int) -> list[tuple[str, int]]:
    """Make each count-dependent argument (a literal, or a size read that follows the units) a read of
    a plain attribute of the host, so an edit sets attributes instead of regenerating the host's code."""
    slots, seen = [], set()
    for c in consts:
        if (c.node, c.path) in seen:
            continue
        seen.add((c.node, c.path))
        attr = f"_fxsurgery_constant{sum(k.startswith('_fxsurgery_constant') for k in module.__dict__)}"
        module.__dict__[attr] = c.per_unit * count
        with c.node.graph.inserting_before(c.node):
            read = c.node.graph.create_node("get_attr", attr, name=attr)
        K.set_path(c.node, c.path, read)
        slots.append((attr, c.per_unit))
    return slots


def replace_data(t: torch.Tensor, data: torch.Tensor) -> None:
    """Swap in resized data, keeping the tensor object (optimizers and EMA copies point at it).

    autograd caches a parameter's gradient accumulator with the old shape and only drops it when
    dtype or device change, so pass through another dtype first; the stale ``.grad`` goes too."""
    if isinstance(t, nn.Parameter):
        t.grad = None
        t.data = torch.empty(0, dtype=torch.float16 if data.dtype != torch.float16 else torch.float32, device=data.device)
    t.data = data


def _max_rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    if [x.shape for x in a] != [y.shape for y in b]:
        return float("inf")
    scale = max([1.0] + [float(x.abs().max()) for x in a if x.numel()])
    return max([0.0] + [float((x - y).abs().max()) for x, y in zip(a, b) if x.numel()]) / scale


def _describe(sl: ParamSlice) -> str:
    lay = "·".join(([str(sl.outer)] if sl.outer > 1 else []) + ["n"] + ([str(sl.inner)] if sl.inner > 1 else []))
    return f"{sl.name}[dim {sl.dim}: {lay}{' out' if sl.output else ''}]"


def _unique_constants(consts: list[K.ConstantSpec]) -> list[K.ConstantSpec]:
    seen, out = set(), []
    for c in consts:
        key = (c.node.name, c.path)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out

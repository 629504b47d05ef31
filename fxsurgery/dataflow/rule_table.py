"""The op table: for each op, its labelling rule and, where its arguments hold sizes of the unit
axis, its count-constant hook. One op family registers both in one file under ``rules``."""
from __future__ import annotations

from typing import Any, Callable, Iterable

from torch.fx.node import Node

from .constants import ConstantSpec, Site
from .labeller import Step

Rule = Callable[[Step], Any]
ConstantHook = Callable[[Site], list[ConstantSpec]]
HookDecorator = Callable[[ConstantHook], ConstantHook]


class RuleTable:
    """Maps a node to its rule: call_function by target, call_method by name, call_module by type."""

    def __init__(self) -> None:
        self.functions: dict[Any, Rule] = {}
        self.methods: dict[str, Rule] = {}
        self.modules: list[tuple[type, Rule]] = []
        self.always: dict[str, Rule] = {}  # op kinds labelled even without labelled inputs
        self.fallback: Rule | None = None
        self.function_constants: dict[Any, ConstantHook] = {}
        self.method_constants: dict[str, ConstantHook] = {}

    def function(self, *targets: Any) -> Callable[[Rule], Rule]:
        def deco(fn: Rule) -> Rule:
            for t in targets:
                self.functions[t] = fn
            return fn
        return deco

    def method(self, *names: str) -> Callable[[Rule], Rule]:
        def deco(fn: Rule) -> Rule:
            for n in names:
                self.methods[n] = fn
                self.methods[n + "_"] = fn  # in-place variants tie the same coordinates
            return fn
        return deco

    def module(self, *types: type) -> Callable[[Rule], Rule]:
        def deco(fn: Rule) -> Rule:
            for t in types:
                self.modules.append((t, fn))
            return fn
        return deco

    def constants(self, *, functions: Iterable[Any] = (), methods: Iterable[str] = ()) -> HookDecorator:
        """Register the hook that finds the arguments of these ops spanning the unit axis."""
        def deco(hook: ConstantHook) -> ConstantHook:
            for t in functions:
                self.function_constants[t] = hook
            for n in methods:
                self.method_constants[n] = hook
            return hook
        return deco

    def find(self, s: Step) -> Rule | None:
        n = s.node
        if n.op == "call_function":
            return self.functions.get(n.target)
        if n.op == "call_method":
            return self.methods.get(n.target)
        if n.op == "call_module":
            mod = s.lab.module.get_submodule(n.target)
            for t, fn in self.modules:
                if isinstance(mod, t):
                    return fn
        return None

    def label(self, s: Step) -> Any:
        if s.node.op in self.always:
            return self.always[s.node.op](s)
        rule = self.find(s)
        if rule is not None and getattr(rule, "always", False):
            return rule(s)
        if not s.has_labels():
            return None
        if rule is None:
            return self.fallback(s) if self.fallback else None
        return rule(s)

    def constants_hook(self, n: Node) -> ConstantHook | None:
        """The hook that finds ``n``'s count-dependent arguments, if its op has one."""
        if n.op == "call_function":
            return self.function_constants.get(n.target)
        if n.op == "call_method":
            return self.method_constants.get(n.target)
        return None

    def constants_of(self, site: Site) -> list[ConstantSpec]:
        """The count-dependent arguments of ``site``'s node (none for ops without a hook)."""
        hook = self.constants_hook(site.node)
        return hook(site) if hook is not None else []


def always(fn: Rule) -> Rule:
    """Mark a rule that runs even when no input carries ids (producers start ids)."""
    fn.always = True  # type: ignore[attr-defined]
    return fn

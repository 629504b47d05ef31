"""The op table: for each op, its labelling rule and, where its arguments hold sizes of the unit axis, its
count-constant hook. One op family registers both in one file under ``rules``; a user registers a rule for an op
of their own with ``fxsurgery.register_rule`` (``RuleTable.register``).

Registration does not depend on import order: an op has at most one rule (registering a second is an error
unless it explicitly replaces the first), and a module call takes the rule of the most derived registered class
in its class hierarchy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch.nn as nn
from torch.fx.node import Node

from .constants import ConstantSpec, Site
from .labeller import Step

Rule = Callable[[Step], Any]
ConstantHook = Callable[[Site], list[ConstantSpec]]
HookDecorator = Callable[[ConstantHook], ConstantHook]
Key = tuple[str, Hashable]  # (fx node op, target): what a rule or hook is registered under


@dataclass(frozen=True)
class NodeKind:
    """Graph nodes matched by their kind, whatever their target: ``"placeholder"`` (graph inputs), ``"get_attr"``
    (reads of parameters, buffers and constants), ``"output"``; or ``"unmatched"`` (``FALLBACK``)."""

    op: str


FALLBACK = NodeKind("unmatched")  # the rule of a call that no other rule matches, run once ids reach it


@dataclass(frozen=True, eq=False)
class Registration:
    """A rule as registered: ``always`` rules run even when no input carries ids (rules that start ids)."""

    rule: Rule
    always: bool


def keys(target: Any) -> list[Key]:
    """The table keys a registration target stands for (see ``RuleTable.register``)."""
    if isinstance(target, NodeKind):
        return [(target.op, None)]
    if isinstance(target, str):  # a tensor method; its in-place variant ties the same coordinates
        return [("call_method", target), ("call_method", target + "_")]
    if isinstance(target, type) and issubclass(target, nn.Module):
        return [("call_module", target)]
    if callable(target):
        return [("call_function", target)]
    raise TypeError(f"cannot register a rule for {target!r}: give a function, a method name, an nn.Module class "
                    f"or a NodeKind")


def describe_key(key: Key) -> str:
    """A key as an error names it: ``call_function gelu``, ``call_method view``, ``placeholder nodes``."""
    op, target = key
    return f"{op} {getattr(target, '__qualname__', target)}" if target is not None else f"{op} nodes"


class RuleHandle:
    """Removes what one ``register`` call added (``remove()``, or leaving a ``with`` block), restoring any rule it
    replaced."""

    def __init__(self, table: RuleTable, entries: list[tuple[Key, Registration]]):
        self.table, self.entries = table, entries

    def remove(self) -> None:
        for key, registration in self.entries:
            self.table.withdraw(key, registration)
        self.entries = []

    def __enter__(self) -> RuleHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


class RuleTable:
    """Maps a node to its rule: call_function by target, call_method by name, call_module by class, other nodes by
    kind; a call with no rule of its own gets the ``FALLBACK`` rule once ids reach it."""

    def __init__(self) -> None:
        self.rules: dict[Key, list[Registration]] = {}  # the last of a list replaced the ones before it
        self.hooks: dict[Key, ConstantHook] = {}

    def register(self, *targets: Any, rule: Rule | None = None, always: bool = False,
                 replace: bool = False) -> Any:
        """Label the nodes of ``targets`` with ``rule``, which gets the node's ``Step`` (its argument values,
        their labels ``largs``/``lkwargs``, its output ``out``) and returns the output's ``Label`` (a tuple of them
        for several outputs, None for none), recording ties, pins and mixes on ``step.rec`` on the way. A rule that
        passes its input's coordinates through position by position is ``lambda step: step.largs[0]``.

        A target is a function or other callable (graphs calling it: a torch function, ``MyFunction.apply``, a
        torch.library op as graphs call it, ``torch.ops.mylib.op.default``), a method name (``"view"`` and its
        in-place ``"view_"``), an ``nn.Module`` class (calls of its instances and of its subclasses'), or a
        ``NodeKind``. A rule runs only once ids reach the node, unless ``always`` (rules that start ids).
        Registering an op that already has a rule is an error unless ``replace``.

        With ``rule``, returns a ``RuleHandle`` whose ``remove()`` undoes the registration; without, a decorator
        that registers the function it decorates."""
        if rule is None:
            def decorate(fn: Rule) -> Rule:
                self.register(*targets, rule=fn, always=always, replace=replace)
                return fn
            return decorate
        registration = Registration(rule, always)
        entries = [(key, registration) for key in dict.fromkeys(k for t in targets for k in keys(t))]
        taken = [describe_key(key) for key, _ in entries if key in self.rules and not replace]
        if taken:
            raise ValueError(f"already registered: {', '.join(taken)} (pass replace=True to replace a rule)")
        for key, _ in entries:
            self.rules.setdefault(key, []).append(registration)
        return RuleHandle(self, entries)

    def withdraw(self, key: Key, registration: Registration) -> None:
        """Drop one registration of ``key`` (the one it replaced, if any, applies again)."""
        stack = self.rules.get(key, [])
        if registration in stack:
            stack.remove(registration)
        if not stack:
            self.rules.pop(key, None)

    def constants(self, *targets: Any) -> HookDecorator:
        """Register the hook that finds the arguments of these ops (targets as for ``register``) spanning the unit
        axis."""
        def deco(hook: ConstantHook) -> ConstantHook:
            for key in (k for t in targets for k in keys(t)):
                if key in self.hooks:
                    raise ValueError(f"{describe_key(key)} already has a count-constant hook")
                self.hooks[key] = hook
            return hook
        return deco

    def find(self, s: Step) -> Registration | None:
        """The registration that labels ``s``'s node (None if its op has no rule of its own)."""
        n = s.node
        if n.op != "call_module":
            return self.current(node_key(n))
        classes = type(s.lab.module.get_submodule(n.target)).__mro__
        return next((self.current(("call_module", c)) for c in classes if ("call_module", c) in self.rules), None)

    def current(self, key: Key) -> Registration | None:
        """The registration in force for ``key``: the last one, which replaced any before it."""
        stack = self.rules.get(key)
        return stack[-1] if stack else None

    def label(self, s: Step) -> Any:
        found = self.find(s)
        if found is not None and found.always:
            return found.rule(s)
        if not s.has_labels():
            return None
        found = found or self.current(keys(FALLBACK)[0])
        return found.rule(s) if found is not None else None

    def constants_hook(self, n: Node) -> ConstantHook | None:
        """The hook that finds ``n``'s count-dependent arguments, if its op has one."""
        return self.hooks.get(node_key(n))

    def constants_of(self, site: Site) -> list[ConstantSpec]:
        """The count-dependent arguments of ``site``'s node (none for ops without a hook)."""
        hook = self.constants_hook(site.node)
        return hook(site) if hook is not None else []


def node_key(n: Node) -> Key:
    """The key a call_function or call_method node, or a node of another kind, is looked up under."""
    return (n.op, n.target) if n.op in ("call_function", "call_method") else (n.op, None)

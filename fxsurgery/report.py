"""``Surgeon.explain``: a table of the groups and of what was left out and why."""
from __future__ import annotations

from .capture.front_ends import FrontEndUse
from .dataflow.constants import ConstantSpec
from .groups import GroupPlumbing, LeftOut, UnitGroup
from .slicing import ParamSlice


def explain(model_name: str, groups: list[UnitGroup], left_out: list[LeftOut],
            plumbing: dict[UnitGroup, GroupPlumbing], *, front_ends: dict[str, FrontEndUse],
            served: dict[str, list[str]]) -> str:
    """Each group's count / max, exactness, sliced tensors and rewritten constants; then the left out; then
    the front end of each host module and the calls it serves, how (hosts alike share a line)."""
    lines = [f"fxsurgery: {len(groups)} unit groups in {model_name}"]
    w = max([len(g.name) for g in groups] + [5])
    lines.append(f"{'group':<{w}}  {'kind':<7}  {'module':<{w}}  {'units':>9}  exact")
    for g in groups:
        lines.append(f"{g.name:<{w}}  {g.kind:<7}  {g.module:<{w}}  {f'{g.count}/{g.max_count}':>9}  "
                     f"{'yes' if g.exact else 'no'}")
        lines.append("    slices: " + ", ".join(_describe_slice(sl) for sl in g.slices))
        if plumbing[g].constants:
            lines.append("    constants: " + ", ".join(c.describe() for c in _unique_constants(plumbing[g].constants)))
        for note in g.notes:
            lines.append(f"    note: {note}")
    if left_out:
        lines.append("left out:")
        for lo in left_out:
            lines.append(f"  {lo.module or '(model)'}: " + "; ".join(lo.reasons))
    if front_ends:
        lines.append("front ends:")
        hosts_of: dict[str, list[str]] = {}
        for host, front_end in front_ends.items():
            hosts_of.setdefault(front_end, []).append(host or "(model)")
        lines += [f"  {_hosts(hosts)}: {front_end}" for front_end, hosts in hosts_of.items()]
    if served:
        lines.append("calls served (a graph per call signature; the analysed call in train and eval mode):")
        hosts_of = {}
        for host, ways in served.items():
            hosts_of.setdefault(_served(ways), []).append(host or "(model)")
        lines += [f"  {_hosts(hosts)}: {ways}" for ways, hosts in hosts_of.items()]
    return "\n".join(lines)


def _hosts(hosts: list[str]) -> str:
    return ", ".join(hosts[:3]) + (f" and {len(hosts) - 3} more" if len(hosts) > 3 else "")


def _served(ways: list[str]) -> str:
    """How many calls a host serves each way: 'analysed', 'captured for this call', 'its own forward (why)'."""
    counts: dict[str, int] = {}
    for way in ways:
        counts[way] = counts.get(way, 0) + 1
    graphs = sum(n for way, n in counts.items() if not way.startswith("its own forward"))
    parts = [f"{graphs} graph{'s' if graphs != 1 else ''}"]
    parts += [f"{n} by {way}" for way, n in counts.items() if way.startswith("its own forward")]
    return "; ".join(parts)


def _describe_slice(sl: ParamSlice) -> str:
    lay = "·".join(([str(sl.outer)] if sl.outer > 1 else []) + ["n"] + ([str(sl.inner)] if sl.inner > 1 else []))
    return f"{sl.name}[dim {sl.dim}: {lay}{f' from {sl.start}' if sl.start else ''}{' out' if sl.output else ''}]"


def _unique_constants(consts: list[ConstantSpec]) -> list[ConstantSpec]:
    """One entry per node name and argument (the train and eval graphs hold alike-named copies)."""
    seen, out = set(), []
    for c in consts:
        key = (c.node.name, c.path)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out

"""The method's tunable constants, with the paper's values as defaults (`barter.wrap(**options)`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from .method_names import Family, named
from .transfer_policy import POLICIES, POLICY_ENUMS, CloneState, PolicyName, Removal, TransferParts, TransferPolicy

METHODS = named(Family.WRAP)  # what `barter.wrap` runs
INITS = ("first", "magnitude", "random", "score")  # which units compact initialisation keeps
RANKED_INITS = ("magnitude", "score")  # the inits that rank units by importance, as global allocation needs
ALLOCATIONS = ("uniform", "global")  # how compact initialisation chooses each layer's width


@dataclass(frozen=True)
class Options:
    """beta: EMA decay; head_ratio / channel_ratio: K per initial unit; noise_std: split noise sigma (relative to
    std of the parent's output weights when noise_relative, absolute otherwise; 0 allowed); init: which units
    compact initialisation keeps (the first, a random subset, the largest norms, or the largest D measured on
    calibration batches: `barter.compact_init`);
    allocation: each layer's initial width, uniform (rho of it) or global (units ranked across layers by init's
    importance under the uniform allocation's parameter budget).
    transfer_policy: the named policy (`barter.transfer_policy.POLICIES`, "paper") that sets the parts of a
    transfer left None here: transfer_parts (both, removals or clones only), count_scale (K times this),
    window (the reallocation window as fractions of T), clone_state (optimizer state at a clone: paper, carry or
    restart), removal (paper or fade), min_heads (the fewest heads a transfer leaves in a layer); `policy` is the
    result."""

    beta: float = 0.99
    head_ratio: float = 2 / 34
    channel_ratio: float = 60 / 1067
    noise_std: float = 0.01
    noise_relative: bool = True
    init: str = "first"
    allocation: str = "uniform"
    transfer_policy: PolicyName = PolicyName.PAPER
    transfer_parts: TransferParts | None = None
    count_scale: float | None = None
    window: tuple[float, float] | None = None
    clone_state: CloneState | None = None
    removal: Removal | None = None
    min_heads: int | None = None

    @property
    def policy(self) -> TransferPolicy:
        """The named policy with the parts given here in place of its own."""
        given = {f.name: getattr(self, f.name) for f in fields(TransferPolicy) if getattr(self, f.name) is not None}
        return replace(POLICIES[self.transfer_policy], **given)

    @classmethod
    def from_kwargs(cls, **options: object) -> "Options":
        """Build from `wrap`'s keyword options, rejecting unknown names and bad values."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown barter option(s) {unknown}; known: {sorted(known)}")
        if options.get("window") is not None:
            options["window"] = tuple(options["window"])  # type: ignore[arg-type]
        for name, kind in POLICY_ENUMS.items():
            if options.get(name) is not None:
                try:
                    options[name] = kind(options[name])
                except ValueError:
                    choices = [k.value for k in kind]
                    raise ValueError(f"{name} must be one of {choices}, got {options[name]!r}") from None
        opts = cls(**options)  # type: ignore[arg-type]
        if not isinstance(opts.transfer_policy, PolicyName):
            raise ValueError(f"transfer_policy must be one of {[k.value for k in PolicyName]}, got None")
        if not 0 <= opts.beta < 1:
            raise ValueError(f"beta must be in [0, 1), got {opts.beta}")
        policy = opts.policy
        lo, hi = policy.window
        if not 0 <= lo <= hi <= 1:
            raise ValueError(f"window must satisfy 0 <= start <= end <= 1, got {policy.window}")
        scale = policy.count_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"count_scale multiplies the transfer counts: it must be a number > 0, got {scale!r}")
        if isinstance(policy.min_heads, bool) or not isinstance(policy.min_heads, int) or policy.min_heads < 0:
            raise ValueError(f"min_heads is the fewest heads a transfer leaves in a layer: an integer >= 0, got "
                             f"{policy.min_heads!r}")
        if opts.noise_std < 0:
            raise ValueError(f"noise_std must be >= 0, got {opts.noise_std}")
        if opts.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {opts.init!r}")
        if opts.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {opts.allocation!r}")
        if opts.allocation == "global" and opts.init not in RANKED_INITS:
            raise ValueError(f"allocation='global' ranks units by importance: it needs init in {RANKED_INITS}, "
                             f"got init={opts.init!r}")
        return opts

"""The method's tunable constants, with the paper's values as defaults (`barter.wrap(**options)`)."""
from __future__ import annotations

from dataclasses import dataclass, fields

METHODS = ("static", "barter", "random_receiver", "random_donor", "random_pair")  # what `barter.wrap` runs
INITS = ("first", "magnitude", "random", "score")  # which units compact initialisation keeps
RANKED_INITS = ("magnitude", "score")  # the inits that rank units by importance, as global allocation needs
ALLOCATIONS = ("uniform", "global")  # how compact initialisation chooses each layer's width


@dataclass(frozen=True)
class Options:
    """beta: EMA decay; window: reallocation window as fractions of T; head_ratio / channel_ratio: K per
    initial unit; noise_std: split noise sigma (relative to std of the parent's output weights when
    noise_relative, absolute otherwise; 0 allowed); init: which units compact initialisation keeps (the first, a
    random subset, the largest norms, or the largest D measured on calibration batches: `barter.compact_init`);
    allocation: each layer's initial width, uniform (rho of it) or global (units ranked across layers by init's
    importance under the uniform allocation's parameter budget)."""

    beta: float = 0.99
    window: tuple[float, float] = (0.1, 0.4)
    head_ratio: float = 2 / 34
    channel_ratio: float = 60 / 1067
    noise_std: float = 0.01
    noise_relative: bool = True
    init: str = "first"
    allocation: str = "uniform"

    @classmethod
    def from_kwargs(cls, **options: object) -> "Options":
        """Build from `wrap`'s keyword options, rejecting unknown names and bad values."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown barter option(s) {unknown}; known: {sorted(known)}")
        if "window" in options:
            options["window"] = tuple(options["window"])  # type: ignore[arg-type]
        opts = cls(**options)  # type: ignore[arg-type]
        if not 0 <= opts.beta < 1:
            raise ValueError(f"beta must be in [0, 1), got {opts.beta}")
        lo, hi = opts.window
        if not 0 <= lo <= hi <= 1:
            raise ValueError(f"window must satisfy 0 <= start <= end <= 1, got {opts.window}")
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

"""The baselines' names (`barter.baselines.registry.BUILDERS` builds each), without importing torch: the
training config and the `barter` command's parser list them."""

METHODS = ("rigl", "set", "snfs", "srigl", "s2vite")

"""Analysis of a whole model: which graphs to trace (``regions``), which modules host groups and how
one analysis serves every host built alike (``host``), installing hosts and making groups (``model``),
and the one self-check every group passes on the live model (``verify``)."""

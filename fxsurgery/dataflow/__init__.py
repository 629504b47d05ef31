"""Dataflow: label every value of a graph with id tensors of unit coordinates (``labeller`` with the op
table in ``rules``), then turn ties, pins and mixes into unit groups (``grouping``) and the graph
constants that follow their counts (``constants``)."""

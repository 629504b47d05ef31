"""Dataflow: label every value of a graph with id tensors of unit coordinates (``labeller``, with the op
table ``rules``; facts kept in ``records``), then turn ties, pins and mixes into unit groups
(``grouping``, on ``classes`` of tied ids and the ``unit_layout`` of each tensor) and the graph
constants that follow their counts (``constants``)."""

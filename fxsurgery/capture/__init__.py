"""Capture: from a module and example inputs to fx graphs the dataflow analysis can label.

The torch.fx front end traces symbolically (``tracer``), traces torch's composite modules through plain
ops (``decompositions``), inlines wrapped helpers that take counts (``inline``), and records the calls of
submodules and runs forwards without side effects (``calls``). A front end hands the analysis a
``torch.fx.GraphModule`` over the module and the values of its placeholders. The installed forward that runs the
rewritten graphs is the ``runtime``'s.
"""

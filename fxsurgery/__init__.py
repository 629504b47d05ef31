"""fxsurgery: find attention-head and FFN-channel groups in any torch.fx-traceable transformer, and
remove or clone units with parameters, graph constants and optimizer state kept consistent.

Layout: ``capture`` turns a module into fx graphs; ``dataflow`` labels them and groups units;
``analysis`` runs that over a whole model (``analyse``: an ``Analysis`` value, found and self-checked on a copy,
that installs nothing on the model) and installs the hosts of a plan (``analysis.install``); ``runtime`` is the
installed forward and serves calls of new signatures; ``editing`` operates on groups; ``Surgeon`` (``surgeon``)
installs an analysis and is the facade for every edit.

Glossary (as the code uses the words):

- *id*: a unit coordinate. Labelling runs each op on id tensors beside the real values; a position
  that carries no coordinate holds ``NO_ID``. A *class* is a set of ids tied together.
- *space*: the fresh ids a linear map (Linear, ``F.linear``, pointwise convolution) gives its output
  features. A class that holds space ids is a unit; units that share a tensor axis form a group.
- *sink*: the weight whose columns read a unit's coordinates (the output projection). A group has
  one sink weight, or several that all read one value (FFN channels fanned out to parallel maps, such as a
  query and a key/value projection); their column slices are ``output`` slices, and ``tap`` sees their input
  (each installed graph passes that input through the group's tap point).
- *member*: a parameter or buffer whose elements carry ids (weight rows and columns, biases, norm
  weights); a member whose ids line up with the units along one axis becomes a ``ParamSlice``. A
  heads×heads map that mixes attention heads (talking heads) is a member along both dims: the dim that
  reads a head is an ``output`` slice too (split on a clone, zeroed when masking the head), the dim that
  makes it is copied.
- *tie*: a pair of ids that must belong to one unit (an elementwise op of two activations, a dim
  contracted between two activations, a reshape folding positions together).
- *pin*: ids that cannot be sliced, with the reason (an op without a rule, a contraction against a
  plain tensor); a group holding a pinned class is refused and reported as left out.
- *benign*: a pin that only says the coordinates are no unit axis (the residual stream, the model
  output); a would-be group with a benign class is dropped without being reported. A pin that names a
  dim applies only if the units turn out to lie along that dim.
- *mix*: ids normalised or reduced together (softmax, layer norm, a sum): removing one unit changes
  the others, so the group is kept but not ``exact``.
"""
from .analysis.value import Analysis, analyse
from .clone_state import StateAtClone, correct_restarted
from .dataflow.rules import register_rule
from .editing import TensorAccess, replace_data
from .errors import AnalysisError, OptimizerStateError, TraceError, UnservedCall
from .groups import GroupDescription, LeftOut, UnitGroup
from .slicing import ParamSlice, solve_counts
from .surgeon import Surgeon
from .unit_kind import UnitKind

__all__ = ["analyse", "Analysis", "Surgeon", "UnitGroup", "GroupDescription", "UnitKind", "ParamSlice", "LeftOut",
           "TraceError", "AnalysisError", "OptimizerStateError", "UnservedCall", "register_rule", "TensorAccess",
           "replace_data", "solve_counts", "StateAtClone", "correct_restarted"]

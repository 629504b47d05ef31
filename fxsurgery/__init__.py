"""fxsurgery: find attention-head and FFN-channel groups in any torch.fx-traceable transformer, and
remove or clone units with parameters, graph constants and optimizer state kept consistent."""
from .errors import AnalysisError, OptimizerStateError, TraceError
from .slicing import ParamSlice
from .surgeon import LeftOut, Surgeon, UnitGroup

__all__ = ["Surgeon", "UnitGroup", "ParamSlice", "LeftOut", "TraceError", "AnalysisError", "OptimizerStateError"]

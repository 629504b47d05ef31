"""Errors raised by fxsurgery; each message names the module or graph node at fault."""
import traceback


class TraceError(RuntimeError):
    """The model (or a module that hosts units) cannot be traced with torch.fx."""


class AnalysisError(ValueError):
    """The graph was traced but holds no unit group that can be operated on safely."""


class OptimizerStateError(TypeError):
    """An attached optimizer keeps per-parameter state that surgery cannot map."""


class UnservedCall(TypeError):
    """A host was called in a way no graph serves (its graphs were captured on other calls), no capture for this
    call finds its groups again, and its own forward does not follow the widths; the message names the host
    and the arguments that differ from the analysed call."""


def unforeseen(what: str, err: Exception) -> str:
    """The reason an unforeseen exception gives for refusing ``what`` (a host, a region): the error and the traceback
    of where it arose, so that a bug of the analysis is a refusal a user can report, never a raw exception."""
    return f"{what} failed: {type(err).__name__}: {err}\n{traceback.format_exc()}"

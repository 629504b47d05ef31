"""`compile_model`: `torch.compile` of a wrapped model, with room for every topology its transfers make.

A transfer resizes parameters, and dynamo guards on parameter shapes (and on the count constants the installed
host forwards read), so each new topology compiles the forward once; a topology seen before reuses its cached
graph. Dynamo's default recompile limit (8) would send the model back to eager after the eighth transfer, so the
limit is raised to the number of scheduled proposals plus one. Score collection compiles into the graph: the taps'
gradient hooks write tensors only (`barter.scores`), so they cause no graph break. Recompiling once per topology was
chosen over dynamic unit dims: dynamo keeps parameter shapes static, and over `torch.compiler.reset()` after each
edit, which would also discard the graphs of every other compiled function.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .compat import dynamo_config
from .controller import Controller


def compile_model(model: nn.Module, controller: Controller | None = None, **options: Any) -> nn.Module:
    """`torch.compile(model, **options)`, the recompile limit raised to fit `controller`'s transfers (one new
    topology per scheduled proposal; Static and a finished schedule need none), and dynamo made to guard on module
    hooks (score taps are hooks where a host serves a call through its own forward; unguarded, a graph traced with
    or without them would be reused after they are added or removed, or for another model of the class)."""
    if controller is not None:
        allow_recompiles(sum(len(steps) for steps in controller.schedule.values()) + 1)
    dynamo_config().skip_nnmodule_hook_guards = False
    return torch.compile(model, **options)


def allow_recompiles(count: int) -> None:
    """Let dynamo compile one frame `count` more times than its defaults allow (never lowers a limit)."""
    config = dynamo_config()
    config.recompile_limit = max(config.recompile_limit, count + 8)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, count + 256)

"""The example call a model is analysed on, as JSON: recorded (`call_record`) in an export's topology and in a
Hugging Face model's config, and replayed (`recorded_call`) on the model rebuilt, so that its analysis finds the
groups the first one found."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .files import ExportError

RECORDED_VALUES = 16_384  # the integer and boolean example tensors up to this size are recorded with their values


def call_record(inputs: tuple, input_kwargs: dict[str, Any]) -> dict[str, Any]:
    """{"inputs": [spec, ...], "input_kwargs": {name: spec}} of the call `model(*inputs, **input_kwargs)`: a
    tensor's spec is its shape and dtype (and the values of a small integer or boolean one, where it has values: not
    on the meta device); a flag's, number's, string's or None's, its value."""
    return {"inputs": [input_spec(value, f"example_inputs[{i}]") for i, value in enumerate(inputs)],
            "input_kwargs": {name: input_spec(value, f"example_kwargs[{name!r}]")
                             for name, value in input_kwargs.items()}}


def input_spec(value: Any, label: str) -> dict[str, Any]:
    if torch.is_tensor(value):
        spec = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
        if not (value.is_floating_point() or value.is_complex() or value.is_meta) and value.numel() <= RECORDED_VALUES:
            spec["values"] = value.detach().cpu().flatten().tolist()
        return spec
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise ExportError(f"{label} is a {type(value).__name__}; an example call is recorded from tensors, flags, "
                      "numbers, strings and None")


def recorded_call(model: nn.Module, call: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The recorded call (a topology's or `call_record`'s) on `model`'s device: its integer and boolean tensors with
    their recorded values (zeros where a large one's were not kept: zero token ids are valid ones), floating ones
    as zeros in `model`'s dtype (a half-precision export's base is built in single precision), and its plain
    values."""
    p = next(model.parameters())

    def value(spec: dict[str, Any]) -> Any:
        if "value" in spec:
            return spec["value"]
        dtype = getattr(torch, spec["dtype"])
        if "values" in spec:
            return torch.tensor(spec["values"], dtype=dtype, device=p.device).reshape(spec["shape"])
        return torch.zeros(spec["shape"], dtype=p.dtype if dtype.is_floating_point else dtype, device=p.device)

    return tuple(value(s) for s in call["inputs"]), {k: value(s) for k, s in call["input_kwargs"].items()}

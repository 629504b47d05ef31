"""Blocks built alike are labelled once: the records replayed for a later block equal what labelling it records (ids,
nodes, names and reasons), a block whose inputs or real values differ is labelled as it is, and a Surgeon finds the
same groups and left-out parts as with every block labelled."""
from __future__ import annotations

import dataclasses

import pytest
import timm
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import fxsurgery.analysis.find as find
from fxsurgery import Surgeon
from fxsurgery.analysis.regions import find_regions
from fxsurgery.capture.calls import buffers_kept
from fxsurgery.dataflow.labeller import Label, Labeller
from fxsurgery.dataflow.records import Pin
from fxsurgery.dataflow.repeats import LISTS, Call, Repeat, Template, Translation, Untranslatable, find_repeats
from fxsurgery.dataflow.rules import RULES

DIM = 8


class Residual(nn.Module):
    """Two pre-norm FFN layers, each added to its input: the block passes the stream's ids on."""

    def __init__(self):
        super().__init__()
        self.norm1, self.fc1, self.fc2 = nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)
        self.norm2, self.fc3, self.fc4 = nn.LayerNorm(DIM), nn.Linear(DIM, 3 * DIM), nn.Linear(3 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.fc2(F.gelu(self.fc1(self.norm1(x))))
        return x + self.fc4(F.gelu(self.fc3(self.norm2(x))))


class Plain(Residual):
    """The same layers, not added to their inputs: each block's output carries ids of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc2(F.gelu(self.fc1(self.norm1(x))))
        return self.fc4(F.gelu(self.fc3(self.norm2(x))))


class Gated(Residual):
    """A residual block whose gate is computed for real from a parameter alone (its value may differ per block)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * torch.sigmoid(self.gate)


def tiny_vit() -> nn.Module:
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=4, num_heads=2,
                             num_classes=5)


MODELS = {  # model, input shape, calls replayed
    "vit": (tiny_vit, (1, 3, 32, 32), 3),
    "residual": (lambda: nn.Sequential(*[Residual() for _ in range(4)]), (2, 5, DIM), 2),  # the first reads no ids
    "plain": (lambda: nn.Sequential(*[Plain() for _ in range(4)]), (2, 5, DIM), 0),
    "gated": (lambda: nn.Sequential(*[Gated() for _ in range(3)]), (2, 5, DIM), 0),
}


def labelled(gm: torch.fx.GraphModule, values: list, repeats: dict) -> Labeller:
    lab = Labeller(gm, RULES, meta=True, repeats=repeats)
    with torch.no_grad(), buffers_kept(gm):
        lab.run(*values)
    return lab


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


@pytest.mark.parametrize("name", MODELS)
def test_replayed_records_equal_a_full_labelling(name: str) -> None:
    make, shape, replayed = MODELS[name]
    torch.manual_seed(0)
    model = make()
    (_, gm, values), = find_regions(model, ((torch.randn(shape),), {}), lambda *a: None)[0]
    repeats = find_repeats(gm)
    full, fast = labelled(gm, values, {}), labelled(gm, values, repeats)
    assert len(repeats) >= 2 and len(fast.replayed) == replayed
    assert fast.rec.next_id == full.rec.next_id and fast.rec.size_reads == full.rec.size_reads
    for records in LISTS:
        assert same(getattr(fast.rec, records), getattr(full.rec, records)), records
    for node in gm.graph.nodes:
        assert same(fast.labels.get(node), full.labels.get(node)), node.name
    assert fast.shapes == full.shapes and fast.dtypes == full.dtypes and fast.strides == full.strides


@pytest.mark.parametrize("name", ["vit", "residual"])
def test_a_surgeon_finds_what_it_finds_with_every_block_labelled(name: str, monkeypatch) -> None:
    make, shape, _ = MODELS[name]
    torch.manual_seed(0)
    model, x = make(), torch.randn(shape)
    fast = Surgeon(model, (x,))
    monkeypatch.setattr(find, "find_repeats", lambda gm: {})
    full = Surgeon(make(), (x,))
    assert fast.explain() == full.explain() and fast.left_out == full.left_out
    assert [(g.name, g.count, g.slices) for g in fast.groups] == [(g.name, g.count, g.slices) for g in full.groups]


def test_a_translation_moves_new_ids_and_renames_what_it_can_tell_from_words() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    first = [graph.call_function(torch.relu, (x,), name="linear")]
    later = [graph.call_function(torch.relu, (first[0],), name="relu_1")]
    repeat = Repeat(Call("a.0", first, [x], first), Call("a.1", later, first, later))
    pin = Pin(torch.tensor([-1, 3, 10, 11]).expand(2, 4), "linear: reads a.0.fc.weight")
    template = Template({"pins": [pin]}, [Label(torch.tensor([10]))], 10)
    translation = Translation(repeat, template, 20)
    moved, = [translation.record(r) for r in template.records["pins"]]
    assert torch.equal(moved.ids, torch.tensor([-1, 3, 20, 21]).expand(2, 4)) and moved.ids.stride() == (0, 1)
    assert moved.reason == "relu_1: reads a.1.fc.weight"
    assert torch.equal(translation.record(template.labels[0]).ids, torch.tensor([20]))
    assert translation.text("read at a.0.fc.") == "read at a.1.fc."
    assert translation.text("mixed by a.0.fc.weight (relu_1)") == "mixed by a.1.fc.weight (relu_1)"
    assert translation.text("a.01.fc") == "a.01.fc"
    for text in ("no linear map reads these units", "read at linear."):
        with pytest.raises(Untranslatable):
            translation.text(text)

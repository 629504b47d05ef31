"""What the tests of barter.wrap on a meta-device model share: the meta path against the materialised one."""
from __future__ import annotations

from typing import Callable

import torch

import barter


def assert_meta_path_equals_materialised(direct: barter.Controller, on_meta: barter.Controller,
                                         train: Callable[[barter.Controller], None]) -> None:
    """The model wrapped on meta, materialised with the weights of the same model wrapped on the CPU, has its
    widths, makes the same transfers (some executed) and ends with bit-equal weights after the same training."""
    on_meta.model.to_empty(device="cpu")
    on_meta.model.load_state_dict(direct.model.state_dict())
    assert {g.name: g.count for g in on_meta.surgeon.groups} == {g.name: g.count for g in direct.surgeon.groups}
    train(direct)
    train(on_meta)
    assert [e.record() for e in on_meta.events] == [e.record() for e in direct.events]
    assert any(e.skipped is None for e in direct.events)
    after, expected = on_meta.model.state_dict(), direct.model.state_dict()
    assert after.keys() == expected.keys() and all(torch.equal(after[k], expected[k]) for k in expected)

"""A state serialised with the sha256 of its bytes, for a file of someone else's checkpoint (the integrations'), so
that a damaged one is named rather than loaded."""
from __future__ import annotations

import hashlib
import io
from typing import Any

import torch

from .files import ExportError


def pack_state(state: Any) -> dict[str, Any]:
    """`state` serialised by `torch.save` with the sha256 of the bytes, for a file of someone else's checkpoint
    (the integrations') that `unpack_state` verifies."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    return {"state": data, "sha256": hashlib.sha256(data).hexdigest()}


def unpack_state(packed: Any, source: str) -> Any:
    """The state `pack_state` packed, after checking its sha256; ExportError naming `source` when it is damaged."""
    if not isinstance(packed, dict) or not isinstance(packed.get("state"), bytes) or "sha256" not in packed:
        raise ExportError(f"{source} is damaged (no checksummed state)")
    digest = hashlib.sha256(packed["state"]).hexdigest()
    if digest != packed["sha256"]:
        raise ExportError(f"{source}: checksum mismatch (sha256 {digest}, recorded {packed['sha256']}); the state "
                          "is damaged or was changed after it was saved")
    return torch.load(io.BytesIO(packed["state"]), map_location="cpu", weights_only=True)

"""Project models registered in timm's registry on import (``timm.create_model("cct_7_3x1_32")``)."""

from . import cct, vit_paper

__all__ = ["cct", "vit_paper"]

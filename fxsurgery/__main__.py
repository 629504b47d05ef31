"""``python -m fxsurgery MODEL``: print the unit groups fxsurgery finds in a timm model."""
from __future__ import annotations

import argparse
import importlib
import sys

import torch

from . import Surgeon


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fxsurgery", description=__doc__)
    p.add_argument("model", help="a timm model name, e.g. vit_tiny_patch16_224")
    p.add_argument("--img-size", type=int, default=None, help="build the model for this image size")
    args = p.parse_args(argv)
    timm = importlib.import_module("timm")  # optional: only this command builds models by name
    kwargs = {"pretrained": False}
    if args.img_size:
        kwargs["img_size"] = args.img_size
    model = timm.create_model(args.model, **kwargs)
    if args.img_size:
        shape = (3, args.img_size, args.img_size)
    else:
        shape = model.pretrained_cfg.get("input_size", (3, 224, 224))
    s = Surgeon(model, (torch.randn(1, *shape),))
    print(s.explain())
    return 0


if __name__ == "__main__":
    sys.exit(main())

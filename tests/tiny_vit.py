"""The tiny timm ViT that the barter tests train (img 32, patch 8, depth 3, width 64, 4 heads), and its batches."""
import torch


def build_vit() -> torch.nn.Module:
    import timm

    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", num_classes=5, img_size=32, patch_size=8, depth=3,
                             mlp_ratio=1.0, embed_dim=64, num_heads=4)


def vit_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of training step ``step``: the same at every call, different between steps."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 5, (4,), generator=g)

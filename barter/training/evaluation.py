"""Evaluation of a model on a data set: loss, accuracy and macro-F1."""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from .loading import batches_of

EVAL_BATCH = 256


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, num_classes: int, device: torch.device, workers: int | None
             ) -> dict[str, float]:
    """Cross-entropy, accuracy, top-5 accuracy and macro-F1 of `model` on `dataset` (eval mode, batches of 256)."""
    model.eval()
    outputs, labels = [], []
    batches = [range(i, min(i + EVAL_BATCH, len(dataset))) for i in range(0, len(dataset), EVAL_BATCH)]
    for images, target in batches_of(dataset, batches, device, workers=workers):
        outputs.append(model(images).float().cpu())
        labels.append(target.cpu())
    model.train()
    logits, target = torch.cat(outputs), torch.cat(labels)
    pred = logits.argmax(1)
    top5 = (logits.topk(min(5, logits.shape[1]), dim=1).indices == target[:, None]).any(1)
    return {"loss": nn.functional.cross_entropy(logits, target).item(),
            "acc": (pred == target).double().mean().item(), "top5": top5.double().mean().item(),
            "macro_f1": macro_f1(pred, target, num_classes)}


def macro_f1(pred: Tensor, target: Tensor, num_classes: int) -> float:
    """Unweighted mean of per-class F1 = 2TP / (2TP + FP + FN) over the classes that occur in the targets or
    the predictions (scikit-learn's "macro" average)."""
    confusion = torch.bincount(target * num_classes + pred, minlength=num_classes ** 2).view(num_classes, -1)
    tp = confusion.diag().double()
    occurrences = (confusion.sum(0) + confusion.sum(1)).double()  # 2TP + FP + FN
    present = occurrences > 0
    return (2 * tp[present] / occurrences[present]).mean().item()

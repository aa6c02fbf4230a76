"""The labels of a torchvision dataset read from its own list, without loading a sample (the last stage's read).

    labels = listed_labels(dataset)   # index -> label, or None: read the samples
    labels(i) == dataset[i][1]

A pipeline's last stage needs only a step's targets; a map-style Dataset answers them only inside its items, so the
last stage used to load (decode, augment) every image stage 0 loads. torchvision's classification datasets keep
their labels in a list (`targets`) and their `__getitem__` returns `targets[index]` beside the sample, passed through
`target_transform` only. So for those classes exactly (not a subclass, which may return other labels) and no
`target_transform`, the label is read off the list; a `Subset` of one maps its indices. Anything else: None.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

# torchvision.datasets classes whose __getitem__ returns (sample, target_transform(targets[index])), targets an int
# list (ImageFolder, DatasetFolder, CIFAR) or an int64 tensor (the MNIST family): read in torchvision 0.19-0.28.
LISTING = frozenset({"ImageFolder", "DatasetFolder", "CIFAR10", "CIFAR100", "MNIST", "FashionMNIST", "KMNIST"})


def listed_labels(dataset: Any) -> Optional[Callable[[int], int]]:
    """index -> the label `dataset[index]` holds, read without loading the sample; None where that is not known."""
    from torch.utils.data import Subset

    if type(dataset) is Subset:
        inner = listed_labels(dataset.dataset)
        indices = dataset.indices
        return None if inner is None else (lambda i: inner(int(indices[i])))
    kind = type(dataset)
    if not (kind.__module__.startswith("torchvision.datasets.") and kind.__name__ in LISTING):
        return None
    targets = getattr(dataset, "targets", None)
    if targets is None or getattr(dataset, "target_transform", None) is not None:
        return None
    return lambda i: int(targets[i])

"""The last stage reads a torchvision classification dataset's labels off its list, without loading an image
(runtime/data/listed_labels.py through MapData.targets), and reads whole what it cannot vouch for."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import Subset

from model_parallel.compat import import_torchvision
from model_parallel.runtime.data.listed_labels import listed_labels
from model_parallel.runtime.data.sources import MapData, read_targets
from support.images import image_folder


class _Counting:
    """An ImageFolder loader that counts the images it opens."""

    def __init__(self) -> None:
        self.opened = 0

    def __call__(self, path: str):
        from PIL import Image

        self.opened += 1
        with open(path, "rb") as handle:
            return Image.open(handle).convert("RGB")


def _folder(tmp_path: Path, **kwargs):
    datasets, transforms = import_torchvision().datasets, import_torchvision().transforms
    loader = _Counting()
    return datasets.ImageFolder(str(image_folder(tmp_path / "images")), loader=loader, transform=transforms.ToTensor(),
                                **kwargs), loader


def test_an_image_folders_targets_are_read_without_opening_an_image(tmp_path: Path) -> None:
    dataset, loader = _folder(tmp_path)
    data = MapData(dataset, 4, seed=3)
    for step in range(5):  # past one epoch: another shuffle
        loader.opened = 0
        got = data.targets(step)
        assert loader.opened == 0
        assert torch.equal(got, data.batch(step)[1]) and got.dtype == torch.int64
    loader.opened = 0
    assert torch.equal(read_targets(data, 2, verify=True), data.batch(2)[1])  # the first read's check holds
    # A Subset (a train/validation split) maps its indices; still no image opened.
    subset = MapData(Subset(dataset, [7, 0, 5, 2, 3]), 2, seed=1)
    loader.opened = 0
    got = [subset.targets(step) for step in range(3)]
    assert loader.opened == 0
    assert all(torch.equal(g, subset.batch(step)[1]) for step, g in enumerate(got))


@pytest.mark.parametrize("case", ["target_transform", "subclass", "collate_fn"])
def test_what_the_list_may_not_hold_is_read_whole(tmp_path: Path, case: str) -> None:
    # A target_transform, a subclass (its __getitem__ may return other labels) or the user's collate_fn: the list is
    # not what the batch holds, so the last stage reads the samples as before.
    dataset, loader = _folder(tmp_path, **({"target_transform": lambda t: 1 - t} if case == "target_transform" else {}))
    if case == "subclass":
        class Flipped(type(dataset)):
            def __getitem__(self, index):
                sample, label = super().__getitem__(index)
                return sample, 1 - label

        dataset.__class__ = Flipped
    assert listed_labels(dataset) is None or case == "collate_fn"
    collate = (lambda items: (torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items]))) \
        if case == "collate_fn" else None
    data = MapData(dataset, 4, **({"collate_fn": collate} if collate else {}))
    got = data.targets(0)
    assert loader.opened > 0 and torch.equal(got, data.batch(0)[1])

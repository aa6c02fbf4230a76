"""Small ImageFolder trees on disk (cat/ and dog/ of PNGs) for the data tests."""
from __future__ import annotations

from pathlib import Path


def image_folder(root: Path) -> Path:
    """root/cat and root/dog with four small PNGs each; returns root."""
    from PIL import Image

    for label in ("cat", "dog"):
        (root / label).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (40, 36), (30 * i, 100 if label == "cat" else 200, 7)).save(root / label / f"{i}.png")
    return root


def corrupt_image_folder(root: Path) -> Path:
    """root/cat and root/dog with one good PNG each, plus a PNG whose data is garbage; returns the broken file."""
    from PIL import Image

    for name in ("cat", "dog"):
        (root / name).mkdir(parents=True)
        Image.new("RGB", (40, 40), (10, 200, 30)).save(root / name / "ok.png")
    (root / "dog" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00garbage" * 8)
    return root / "dog" / "broken.png"

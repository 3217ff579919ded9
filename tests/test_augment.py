"""Consistent augmentation for distillation: shapes, seeding, and what mixup/cutmix may produce."""

from __future__ import annotations

import pytest
import torch

from onnxprune.recovery.augment import augment_images, mix, resized_crop_flip


def _x(n: int = 6) -> torch.Tensor:
    return torch.randn(n, 3, 20, 24, generator=torch.Generator().manual_seed(1))


def test_seeded_and_shape_preserving() -> None:
    x = _x()
    a = augment_images(x, torch.Generator().manual_seed(0), "cutmix")
    b = augment_images(x, torch.Generator().manual_seed(0), "cutmix")
    c = augment_images(x, torch.Generator().manual_seed(1), "cutmix")
    assert a.shape == x.shape and a.dtype == x.dtype
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_full_crop_is_identity_or_mirror() -> None:
    """With the whole image as the box (area 1, aspect drawn but clamped), each output is the input
    or its mirror."""
    x = _x()
    y = resized_crop_flip(x, torch.Generator().manual_seed(0), min_area=1.0)
    for xi, yi in zip(x, y):
        side = (yi - xi).abs().max() if (yi - xi).abs().max() < 1e-4 else (yi - xi.flip(-1)).abs().max()
        # the aspect jitter stretches one axis slightly: only the exact-square draws are exact copies
        assert side < 1e-4 or torch.corrcoef(torch.stack([yi.flatten(), xi.flatten()]))[0, 1] > 0.5 \
            or torch.corrcoef(torch.stack([yi.flatten(), xi.flip(-1).flatten()]))[0, 1] > 0.5


def test_mixup_is_convex_and_cutmix_pastes() -> None:
    x = _x()
    m = mix(x, torch.Generator().manual_seed(3), "mixup")
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(3))
    lo, hi = torch.minimum(x, x[perm]), torch.maximum(x, x[perm])
    assert bool(((m >= lo - 1e-6) & (m <= hi + 1e-6)).all())
    c = mix(x, torch.Generator().manual_seed(3), "cutmix")
    assert bool(((c == x) | (c == x[perm])).all())
    assert torch.equal(mix(x, torch.Generator(), "none"), x)
    with pytest.raises(ValueError, match="mix"):
        mix(x, torch.Generator(), "blend")


def test_nhwc_matches_nchw() -> None:
    x = _x()
    a = augment_images(x, torch.Generator().manual_seed(0), "mixup")
    b = augment_images(x.permute(0, 2, 3, 1), torch.Generator().manual_seed(0), "mixup", "nhwc")
    assert torch.allclose(a, b.permute(0, 3, 1, 2), atol=1e-6)

"""Consistent augmentation for distillation: shapes, seeding, and what mixup/cutmix may produce."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from onnxprune.recovery.augment import (
    STEER_SIZE, STEER_STEPS, augment_images, dead_leaves, jitter_colour, mix, mosaic, resized_crop_flip, steer,
)


def _x(n: int = 6) -> torch.Tensor:
    return torch.randn(n, 3, 20, 24, generator=torch.Generator().manual_seed(1))


def test_seeded_and_shape_preserving() -> None:
    x = _x()
    a = augment_images(x, torch.Generator().manual_seed(0), "cutmix")
    b = augment_images(x, torch.Generator().manual_seed(0), "cutmix")
    c = augment_images(x, torch.Generator().manual_seed(1), "cutmix")
    assert a.shape == x.shape and a.dtype == x.dtype
    assert torch.equal(a, b) and not torch.equal(a, c)


def _bilinear(img: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``img`` (C, H, W) sampled at source coordinates ``rows`` (H,) × ``cols`` (W,), each in [0, size - 1]."""
    r0, c0 = np.floor(rows).astype(int), np.floor(cols).astype(int)
    r1, c1 = np.minimum(r0 + 1, img.shape[1] - 1), np.minimum(c0 + 1, img.shape[2] - 1)
    fr, fc = (rows - r0)[:, None], (cols - c0)[None, :]
    return ((1 - fr) * ((1 - fc) * img[:, r0][:, :, c0] + fc * img[:, r0][:, :, c1])
            + fr * ((1 - fc) * img[:, r1][:, :, c0] + fc * img[:, r1][:, :, c1]))


def test_full_crop_is_the_image_or_its_mirror_stretched_along_one_axis() -> None:
    """With the whole image as the box (area 1, the aspect jitter clamped to the image), one axis is the
    identity (or, across, the mirror) and the other a stretch by at most sqrt(4/3) (the aspect jitter); the
    pixels are exactly the bilinear resampling there. Channels 0 and 1 are the column and row
    index, so each output pixel tells where it was sampled; channel 2 is random and checked against numpy."""
    n, h, w = 8, 20, 24
    x = torch.zeros(n, 3, h, w)
    x[:, 0], x[:, 1] = torch.arange(w, dtype=torch.float32), torch.arange(h, dtype=torch.float32)[:, None]
    x[:, 2] = _x(n)[:, 0]
    y = resized_crop_flip(x, torch.Generator().manual_seed(0), min_area=1.0).numpy()
    stretched = {"rows": 0, "cols": 0}
    for xi, yi in zip(x.numpy(), y):
        cols, rows = yi[0, 0], yi[1, :, 0]
        np.testing.assert_allclose(yi[0], np.broadcast_to(cols, (h, w)), atol=1e-5)  # separable: no rotation
        np.testing.assert_allclose(yi[1], np.broadcast_to(rows[:, None], (h, w)), atol=1e-5)
        if np.allclose(cols, np.arange(w), atol=1e-5) or np.allclose(cols, np.arange(w)[::-1], atol=1e-5):
            axis, other, size = "rows", rows, h
        else:
            np.testing.assert_allclose(rows, np.arange(h), atol=1e-5)
            axis, other, size = "cols", cols, w
        stretched[axis] += 1
        step = np.abs(np.diff(other[(other > 0) & (other < size - 1)]))
        assert np.all(step >= (3 / 4) ** 0.5 - 1e-5) and np.all(step <= 1 + 1e-5), step  # the box's side / the image's
        np.testing.assert_allclose(yi[2:], _bilinear(xi[2:], rows, cols), atol=1e-5)
    assert stretched["rows"] and stretched["cols"], stretched


def _colours(n: int) -> torch.Tensor:
    """``n`` constant images, image k of colour (t, t², t³) with t = (k + 1) / n: no three colours are
    collinear, so a blend of two names both of them and its weight."""
    t = torch.arange(1, n + 1, dtype=torch.float64) / n
    return torch.stack([t, t**2, t**3], 1)[:, :, None, None].expand(n, 3, 20, 24).clone()


def _blend(colour: np.ndarray, colours: np.ndarray, own: int) -> tuple[int, float]:
    """(j, lam) with ``colour`` = lam·colours[own] + (1 - lam)·colours[j], lam in [0, 1]; (own, 1) for its own."""
    if np.allclose(colour, colours[own], atol=1e-9):
        return own, 1.0
    for j, other in enumerate(colours):
        if j == own:
            continue
        d = colours[own] - other
        lam = float(np.dot(colour - other, d) / np.dot(d, d))
        if np.allclose(colour, other + lam * d, atol=1e-9) and 0 <= lam <= 1:
            return j, lam
    raise AssertionError(f"{colour} is no blend of image {own} with another")


def test_mixup_blends_each_image_with_a_permuted_partner() -> None:
    """Every output image is lam·its own colour + (1 - lam)·its partner's, one lam for the batch, the partners
    a permutation, and at least one image actually blended."""
    x = _colours(6)
    m = mix(x, torch.Generator().manual_seed(3), "mixup").numpy()
    colours = x[:, :, 0, 0].numpy()
    assert np.allclose(m, m[:, :, :1, :1], atol=1e-12)  # a constant image stays constant
    found = [_blend(mi[:, 0, 0], colours, i) for i, mi in enumerate(m)]
    partners = [j for j, _ in found]
    mixed = [(i, j, lam) for i, (j, lam) in enumerate(found) if j != i]
    assert sorted(partners) == list(range(6)) and mixed, found
    assert max(lam for *_, lam in mixed) - min(lam for *_, lam in mixed) < 1e-9, found


def test_cutmix_pastes_one_box_of_the_partner() -> None:
    """Every output pixel is its own image's colour or, inside one rectangle shared by the batch, its
    partner's; the partners form a permutation and the box is not empty."""
    x = _colours(6)
    c = mix(x, torch.Generator().manual_seed(3), "cutmix").numpy()
    colours = x[:, :, 0, 0].numpy()
    own = np.all(c == colours[:, :, None, None], axis=1)
    boxes = set()
    partners = []
    for i, ci in enumerate(c):
        pasted = np.argwhere(~own[i])
        j = i
        if len(pasted):
            (j,) = {int(np.flatnonzero((colours == ci[:, r, q]).all(1))[0]) for r, q in pasted}
            (r0, q0), (r1, q1) = pasted.min(0), pasted.max(0) + 1
            assert (~own[i, r0:r1, q0:q1]).all(), "the pasted pixels fill a rectangle"
            boxes.add((r0, r1, q0, q1))
        partners.append(j)
    assert sorted(partners) == list(range(6)) and len(boxes) == 1, (partners, boxes)


def test_mix_none_and_unknown() -> None:
    x = _x()
    assert torch.equal(mix(x, torch.Generator(), "none"), x)
    with pytest.raises(ValueError, match="mix"):
        mix(x, torch.Generator(), "blend")


def test_nhwc_matches_nchw() -> None:
    x = _x()
    a = augment_images(x, torch.Generator().manual_seed(0), "mixup")
    b = augment_images(x.permute(0, 2, 3, 1), torch.Generator().manual_seed(0), "mixup", "nhwc")
    assert torch.allclose(a, b.permute(0, 3, 1, 2), atol=1e-6)
    a = augment_images(x, torch.Generator().manual_seed(0), "mixup", mosaics=0.5, leaves=0.5)
    b = augment_images(x.permute(0, 2, 3, 1), torch.Generator().manual_seed(0), "mixup", "nhwc", mosaics=0.5,
                       leaves=0.5)
    assert torch.allclose(a, b.permute(0, 3, 1, 2), atol=1e-6)


def test_colour_jitter_is_an_affine_change_within_its_strength() -> None:
    """A grey image (all channels equal) stays grey with the saturation; its spread about its mean scales by the
    contrast factor, within [1 - s, 1 + s]; strength 0 returns the input; the same seed gives the same images."""
    x = _x()
    assert torch.equal(jitter_colour(x, torch.Generator().manual_seed(0), 0.0), x)
    grey = x[:, :1].expand(-1, 3, -1, -1).clone()
    y = jitter_colour(grey, torch.Generator().manual_seed(0), 0.4)
    torch.testing.assert_close(y[:, 0], y[:, 1])
    torch.testing.assert_close(y[:, 1], y[:, 2])
    ratio = y.std(dim=(1, 2, 3)) / grey.std(dim=(1, 2, 3))
    assert torch.all(ratio >= 0.6 - 1e-5) and torch.all(ratio <= 1.4 + 1e-5) and ratio.std() > 0.01, ratio
    torch.testing.assert_close(y, jitter_colour(grey, torch.Generator().manual_seed(0), 0.4))
    colourful = jitter_colour(x, torch.Generator().manual_seed(3), 0.4)
    assert colourful.shape == x.shape and not torch.allclose(colourful, x)


def test_both_draws_mixup_or_cutmix_per_batch() -> None:
    """'both' gives, for each seed, exactly what mixup or cutmix gives with the draw that follows its coin."""
    x, kinds = _colours(6), set()
    for seed in range(12):
        got = mix(x, torch.Generator().manual_seed(seed), "both")
        g = torch.Generator().manual_seed(seed)
        kind = "mixup" if float(torch.rand((), generator=g)) < 0.5 else "cutmix"
        torch.testing.assert_close(got, mix(x, g, kind))
        kinds.add(kind)
    assert kinds == {"mixup", "cutmix"}


@pytest.mark.parametrize("h, w", [(20, 24), (21, 25)])
def test_a_mosaic_tiles_four_images_of_the_batch_at_half_size(h: int, w: int) -> None:
    """With share 1 every image becomes four quadrants, the top-left its own colour, each one constant colour of the
    batch (an odd side repeats its last row or column); share 0 returns the batch; a share in between tiles some."""
    x = _colours(6)[:, :, :1, :1].expand(6, 3, h, w).clone()
    colours = x[:, :, 0, 0].numpy()
    y = mosaic(x, torch.Generator().manual_seed(0), 1.0).numpy()
    for i in range(6):
        quadrants = [y[i, :, :h // 2, :w // 2], y[i, :, :h // 2, w // 2:], y[i, :, h // 2:, :w // 2],
                     y[i, :, h // 2:, w // 2:]]
        for k, q in enumerate(quadrants):
            flat = q.reshape(3, -1)
            assert np.allclose(flat, flat[:, :1], atol=1e-9), (i, k)
            assert np.isclose(colours, flat[:, 0], atol=1e-9).all(1).sum() == 1
        assert np.allclose(quadrants[0].reshape(3, -1)[:, 0], colours[i], atol=1e-9)
    assert mosaic(x, torch.Generator().manual_seed(0), 0.0) is x
    some = mosaic(x, torch.Generator().manual_seed(3), 0.5)
    tiled = [not torch.equal(some[i], x[i]) for i in range(6)]
    assert any(tiled) and not all(tiled)


def test_dead_leaves_paint_shapes_in_the_batch_colours() -> None:
    """With share 1 every image becomes regions of the batch's own colours (blended only along the shapes' edges by
    the resize), several of them, of sizes from a few pixels to most of the image; share 0 returns the batch; a share
    in between replaces some images and leaves the others as they were."""
    x = _colours(6)[:, :, :1, :1].expand(6, 3, 128, 128).clone()
    colours = x[:, :, 0, 0]
    y = dead_leaves(x, torch.Generator().manual_seed(0), 1.0)
    assert y.shape == x.shape
    pixels = y.permute(0, 2, 3, 1).reshape(-1, 1, 3)
    exact = (pixels - colours[None]).abs().amax(2).min(1).values < 1e-6
    assert exact.float().mean() > 0.6, exact.float().mean()
    lo, hi = colours.min(0).values, colours.max(0).values
    assert bool(((pixels[:, 0] >= lo - 1e-6) & (pixels[:, 0] <= hi + 1e-6)).all())  # blends of the batch's colours
    for image, clean in zip(y, exact.reshape(6, -1)):
        assert len(torch.unique(image.reshape(3, -1).T[clean], dim=0)) >= 3
    assert not torch.equal(y, dead_leaves(x, torch.Generator().manual_seed(1), 1.0))
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    assert dead_leaves(x, gen, 0.0) is x and torch.equal(gen.get_state(), state)  # no draw: the default's stream kept
    some = dead_leaves(x, torch.Generator().manual_seed(0), 0.5)
    replaced = [not torch.equal(some[i], x[i]) for i in range(6)]
    assert any(replaced) and not all(replaced)


def test_steering_raises_the_probability_of_a_drawn_class_by_small_steps() -> None:
    """On a linear classifier each steered image moves, by at most ``STEER_STEPS`` steps of ``STEER_SIZE`` of its
    spread a pixel, to where the class drawn for it is likelier than before (the draws replayed from the seed); an image
    left out stays as it was; share 0 returns the batch and draws nothing."""
    x = _x(8)
    weights = torch.randn(3 * 20 * 24, 7, generator=torch.Generator().manual_seed(2)) / 20

    def logits(v: torch.Tensor) -> torch.Tensor:
        return v.flatten(1) @ weights

    y = steer(x, logits, torch.Generator().manual_seed(0), 1.0)
    replay = torch.Generator().manual_seed(0)
    torch.rand(8, generator=replay)
    target = torch.randint(7, (8, 1), generator=replay)
    before, after = (torch.log_softmax(logits(v), 1).gather(1, target)[:, 0] for v in (x, y))
    assert bool((after > before + 0.1).all()), (before, after)
    moved = (y - x).abs().flatten(1)
    bound = STEER_STEPS * STEER_SIZE * x.std(dim=(1, 2, 3))
    assert bool((moved.amax(1) <= bound * (1 + 1e-5)).all()) and bool((moved.mean(1) > 0.5 * bound).all())
    some = steer(x, logits, torch.Generator().manual_seed(0), 0.5)
    changed = [not torch.equal(some[i], x[i]) for i in range(8)]
    assert any(changed) and not all(changed)
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    assert steer(x, logits, gen, 0.0) is x and torch.equal(gen.get_state(), state)

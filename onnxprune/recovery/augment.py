"""Consistent augmentation for distillation: the teacher and the student see the same new image.

Random resized crop and horizontal flip are one affine resampling per image (``grid_sample``), optionally a
random change of brightness, contrast and saturation and, for a share of the images, a mosaic of four of the batch's
at half their size (the objects smaller than any crop shows them) or a dead-leaves image (shapes no photo holds, in
the photos' colours), then mixup or cutmix mixes each image with another of the batch. They create inputs that neither
the pruner nor the teacher's cached outputs have seen, which is what keeps distillation on a few hundred images from
overfitting them ("function matching", Beyer et al. 2022). ``steer`` moves a share of them, by a few gradient steps on a
classifier, towards random classes of its output.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import StrEnum

import torch
import torch.nn.functional as F


class Mix(StrEnum):
    """How the distillation mixes each image with another of its batch."""

    MIXUP = "mixup"
    CUTMIX = "cutmix"
    BOTH = "both"  # mixup or cutmix, drawn for each batch
    NONE = "none"


MIXES = tuple(m.value for m in Mix)


def resized_crop_flip(x: torch.Tensor, gen: torch.Generator, min_area: float = 0.25) -> torch.Tensor:
    """Each NCHW image resampled from a random box (area ≥ ``min_area``, aspect 3/4–4/3), mirrored
    with probability 1/2, back to the same size."""
    n, c, h, w = x.shape
    side = torch.empty(n).uniform_(min_area, 1.0, generator=gen).sqrt()
    aspect = torch.exp(torch.empty(n).uniform_(math.log(3 / 4), math.log(4 / 3), generator=gen)).sqrt()
    sx, sy = (side * aspect).clamp(max=1.0), (side / aspect).clamp(max=1.0)
    tx = (torch.rand(n, generator=gen) * 2 - 1) * (1 - sx)
    ty = (torch.rand(n, generator=gen) * 2 - 1) * (1 - sy)
    flip = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0], theta[:, 0, 2], theta[:, 1, 1], theta[:, 1, 2] = sx * flip, tx, sy, ty
    grid = F.affine_grid(theta.to(x), [n, c, h, w], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False)


def jitter_colour(x: torch.Tensor, gen: torch.Generator, strength: float) -> torch.Tensor:
    """Each NCHW image's contrast, saturation and brightness scaled by factors drawn in [1 - strength,
    1 + strength], about the image's own mean and grey level, so it holds in any normalisation of the input."""
    if strength <= 0:
        return x
    n = len(x)

    def factor() -> torch.Tensor:
        return (1 + (torch.rand(n, 1, 1, 1, generator=gen) * 2 - 1) * strength).to(x)

    grey = x.mean(dim=1, keepdim=True)
    x = grey + factor() * (x - grey)  # saturation
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    x = mean + factor() * (x - mean)  # contrast
    return x + (factor() - 1) * x.std(dim=(1, 2, 3), keepdim=True)  # brightness, in units of the image's spread


def mosaic(x: torch.Tensor, gen: torch.Generator, share: float) -> torch.Tensor:
    """Each NCHW image, with probability ``share``, replaced by a 2x2 mosaic of itself and three random images of the
    batch, each at half its height and width (area-averaged)."""
    if share <= 0:
        return x
    n, _, h, w = x.shape
    small = F.interpolate(x, size=(h // 2, w // 2), mode="area")
    others = [small[torch.randint(n, (n,), generator=gen).to(x.device)] for _ in range(3)]
    tiles = torch.cat([torch.cat([small, others[0]], dim=3), torch.cat([others[1], others[2]], dim=3)], dim=2)
    tiles = F.pad(tiles, (0, w - tiles.shape[3], 0, h - tiles.shape[2]), mode="replicate")  # odd sizes
    chosen = (torch.rand(n, generator=gen) < share).to(x.device)
    return torch.where(chosen[:, None, None, None], tiles, x)


LEAVES = 128  # shapes painted over one another in a dead-leaves image
LEAF_RADII = (0.03, 0.5)  # of the image's side: a leaf's radius r has density ∝ r^-3 between them (scale-invariant)
LEAF_SCALE = 2  # leaves are painted at 1/LEAF_SCALE of the image's size (a fourth of the pixels), then resized


def dead_leaves(x: torch.Tensor, gen: torch.Generator, share: float) -> torch.Tensor:
    """Each NCHW image, with probability ``share``, replaced by a dead-leaves image (Lee et al. 2001; Baradad et al.
    2021 distil and pretrain on them): ``LEAVES`` discs and boxes (alternately) of scale-invariant sizes, each over the
    ones before, on a background, each the colour of a random pixel of the batch (so it holds in any normalisation of
    the input)."""
    if share <= 0:  # draws nothing: the other augmentations' random numbers stay as they were without it
        return x
    n, c, h, w = x.shape
    chosen = torch.rand(n, generator=gen) < share
    m = int(chosen.sum())
    if m == 0:
        return x
    pixels = x.detach().permute(0, 2, 3, 1).reshape(-1, c)

    def colours() -> torch.Tensor:
        return pixels[torch.randint(len(pixels), (m,), generator=gen).to(x.device)][:, :, None, None]

    def draw(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen).to(x)

    sh, sw = -(-h // LEAF_SCALE), -(-w // LEAF_SCALE)
    ys, xs = torch.linspace(0, 1, sh).to(x)[:, None], torch.linspace(0, 1, sw).to(x)[None, :]
    lo, hi = (r**-2 for r in LEAF_RADII)
    out = colours().expand(m, c, sh, sw)
    for k in range(LEAVES):
        r = (lo - draw(m) * (lo - hi)) ** -0.5  # inverse of the radius's distribution function
        cy, cx, aspect = draw(m), draw(m), 2 ** (draw(m) * 2 - 1)
        r, cy, cx, aspect = (v[:, None, None] for v in (r, cy, cx, aspect))
        if k % 2:
            mask = ((ys - cy) ** 2 + (xs - cx) ** 2) < r**2
        else:
            mask = ((ys - cy).abs() < r * aspect) & ((xs - cx).abs() < r / aspect)
        out = torch.where(mask[:, None], colours(), out)
    out = F.interpolate(out, size=(h, w), mode="bilinear", align_corners=False)
    x = x.clone()
    x[chosen.to(x.device)] = out
    return x


STEER_STEPS = 2  # signed-gradient steps moving a steered image
STEER_SIZE = 0.03  # each step, in units of the image's own standard deviation: two made the drawn class the original
# MobileNetV2's top one on 28 of 32 dev photos, with a median probability of 0.78 (benchmarks/steer_probe.py)


def steer(x: torch.Tensor, logits: Callable[[torch.Tensor], torch.Tensor], gen: torch.Generator,
          share: float) -> torch.Tensor:
    """Each image (any layout), with probability ``share``, moved ``STEER_STEPS`` signed-gradient steps up the
    log-probability that ``logits`` (a classifier's, (N, classes)) gives a class drawn uniformly for it: inputs on
    which the classifier puts its mass on classes no training image shows. Heo et al. (2019) distil on samples
    pushed across the teacher's decision boundaries; Ilyas et al. (2019) train on images pushed towards a target class,
    labelled as it, and generalise to clean ones."""
    if share <= 0:  # draws nothing: the other augmentations' random numbers stay as they were without it
        return x
    chosen = (torch.rand(len(x), generator=gen) < share).to(x.device)
    m = int(chosen.sum())
    if m == 0:
        return x
    z = x[chosen].detach()
    size = STEER_SIZE * z.std(dim=tuple(range(1, z.ndim)), keepdim=True)
    target = None
    with torch.enable_grad():
        for _ in range(STEER_STEPS):
            z.requires_grad_(True)
            log_p = torch.log_softmax(logits(z), dim=1)
            if target is None:
                target = torch.randint(log_p.shape[1], (m, 1), generator=gen).to(x.device)
            grad, = torch.autograd.grad(log_p.gather(1, target).sum(), z)
            z = (z + size * grad.sign()).detach()
    x = x.clone()
    x[chosen] = z
    return x


def mix(x: torch.Tensor, gen: torch.Generator, kind: str) -> torch.Tensor:
    """Mixup (a convex blend) or cutmix (a pasted box) of each image with a random other one of the
    batch, with a mixing weight drawn uniformly (Beta(1, 1)); 'both' draws one of them for the batch; 'none'
    returns ``x``."""
    if kind not in MIXES:
        raise ValueError(f"mix {kind!r} not in {MIXES}")
    if kind == "none" or len(x) < 2:
        return x
    if kind == "both":
        kind = "mixup" if float(torch.rand((), generator=gen)) < 0.5 else "cutmix"
    perm = torch.randperm(len(x), generator=gen).to(x.device)
    lam = float(torch.rand((), generator=gen))
    if kind == "mixup":
        return lam * x + (1 - lam) * x[perm]
    h, w = x.shape[-2:]
    bh, bw = int(h * math.sqrt(1 - lam)), int(w * math.sqrt(1 - lam))
    cy, cx = int(torch.randint(h, (), generator=gen)), int(torch.randint(w, (), generator=gen))
    y0, y1, x0, x1 = max(cy - bh // 2, 0), min(cy + bh // 2, h), max(cx - bw // 2, 0), min(cx + bw // 2, w)
    out = x.clone()
    out[..., y0:y1, x0:x1] = x[perm][..., y0:y1, x0:x1]
    return out


def augment_images(x: torch.Tensor, gen: torch.Generator, kind: str, layout: str = "nchw",
                   colour: float = 0.0, mosaics: float = 0.0, leaves: float = 0.0) -> torch.Tensor:
    """Crop, flip, change the colours (``jitter_colour``) of, make a share ``mosaics`` of them mosaics (``mosaic``)
    and a share ``leaves`` dead-leaves images (``dead_leaves``) and mix a batch of images in ``layout`` ('nchw' or
    'nhwc')."""
    if layout == "nhwc":
        return augment_images(x.permute(0, 3, 1, 2), gen, kind, colour=colour, mosaics=mosaics,
                              leaves=leaves).permute(0, 2, 3, 1).contiguous()
    views = mosaic(jitter_colour(resized_crop_flip(x, gen), gen, colour), gen, mosaics)
    return mix(dead_leaves(views, gen, leaves), gen, kind)

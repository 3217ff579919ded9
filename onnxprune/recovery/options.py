"""What ``recover`` is asked to do: its stages, what they train, and the checked options."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from enum import StrEnum

import torch

from onnxprune.errors import OptionError, check_choice
from onnxprune.progress import clock_text
from onnxprune.recovery.augment import Mix
from onnxprune.recovery.train import Optimizer
from onnxprune.ir.store import Store, check_memory, default_budget


class Train(StrEnum):
    """What a stage trains: every float weight of a changed segment, or only the weights pruning changed."""

    SEGMENT = "segment"
    CHANGED = "changed"


class Layout(StrEnum):
    """The layout of an image input, for the augmentation."""

    NCHW = "nchw"
    NHWC = "nhwc"


TRAIN = tuple(t.value for t in Train)


class Method(StrEnum):
    """The recovery stages to run: block-wise reconstruction, distillation, or both in this order."""

    BLOCK_DISTILL = "block+distill"
    BLOCK = "block"
    DISTILL = "distill"

    @property
    def block(self) -> bool:
        """Whether the block-wise reconstruction stage runs."""
        return self in (Method.BLOCK_DISTILL, Method.BLOCK)

    @property
    def distill(self) -> bool:
        """Whether the distillation stage runs."""
        return self in (Method.BLOCK_DISTILL, Method.DISTILL)


METHODS = tuple(m.value for m in Method)
STAGE_OPTIONS = {"block": ("steps", "lr", "block_window"),  # what only one stage reads (``RecoverOptions``)
                 "distill": ("distill_steps", "distill_lr", "distill_segments", "distill_views", "distill_features",
                             "mix", "colour", "mosaic", "leaves", "steer", "whole_share", "temperature", "average",
                             "pool")}
Progress = Callable[[str, int, int, float | None], None]
Augment = Callable[[list[torch.Tensor], torch.Generator], list[torch.Tensor]]


DEFAULT_TIME = 900.0  # seconds: what a 2-core CPU needs for MobileNetV2 on a few hundred photos (docs/results.md)
WHOLE_SHARE = 0.5  # of a time budget, what a distillation of the whole model gets after the block stage
STEPS, DISTILL_STEPS = 200, 600  # the step counts where steps bound the run and one of them is left out
# the distillation's candidate learning rates where none is given: YOLOv8n's neck and head (2M weights, one segment)
# lose mAP within ten steps at 1e-4 and gain at 3e-6, MobileNetV2's classifier gains at neither after the block stages
# (the notebook's "Choosing the distillation's learning rate"); the gentlest first, as the one tried where the
# budget affords one trial (``train.TRIALS_OVERRUN``)
DISTILL_LRS = (3e-6, 1e-5, 3e-5, 1e-4)


@dataclass
class RecoverOptions:
    """The recovery's settings, checked when built (a bad value raises OptionError naming the field). A time
    budget bounds the run (``time``, by default ``DEFAULT_TIME``), or step counts do where ``steps`` or
    ``distill_steps`` is given without ``time``.

    ``method``, ``train``, ``mix``, ``layout`` and ``optimizer`` are enums (``Method``, ``Train``, ``Mix``,
    ``Layout``, ``Optimizer``) or their values ('block+distill', 'segment', 'mixup', 'nchw', 'adam', ...); they are
    stored as the enums."""

    method: Method | str = Method.BLOCK_DISTILL
    steps: int | None = None  # Adam steps per trainable segment (block stage; None: STEPS when steps bound the run)
    lr: float = 1e-3
    block_window: int = 3  # changed segments the block stage trains together, to the tensor at the last one's end
    distill_steps: int | None = None  # Adam steps of the distillation stage (None: DISTILL_STEPS)
    distill_lr: float | None = None  # None: the best of ``DISTILL_LRS`` after a short trial each (``train.choose_lr``)
    distill_segments: int | None = None  # trailing segments the distillation trains; 0 = the whole model; None:
    # the whole model where it is affordable, else the head (``distill_part``)
    distill_views: int = 8  # augmented views of every training sample cached for a head distillation
    distill_features: float = 1.0  # whole-model distillation: weight of the block outputs' relative squared error
    mix: Mix | str = Mix.MIXUP  # mixing of the distillation images (after random resized crop and flip)
    colour: float = 0.0  # strength of the distillation images' random brightness, contrast and saturation changes
    mosaic: float = 0.0  # share of the distillation images made 2x2 mosaics of four at half size (``augment.mosaic``)
    leaves: float = 0.0  # share of the distillation images replaced by dead-leaves images (``augment.dead_leaves``)
    steer: float = 0.0  # whole-model distillation of a classifier: share of its images moved towards random classes of
    # the teacher (``augment.steer``)
    whole_share: float = WHOLE_SHARE  # of the time, what a distillation of the whole model gets after the blocks
    temperature: float = 1.0  # distillation of a classifier: the KL's softening (``train.softened_kl``)
    pool: int = 1  # distillation of a classifier: candidates drawn per batch image, the batch keeps the ``batch_size``
    # the student disagrees with most (``train.hardest``)
    average: float = 0.0  # distillation: the weights kept are a moving average of its steps', each step weighing
    # 1 - average (0: the last step's; ``train.train_loop``)
    layout: Layout | str = Layout.NCHW  # of an image input, for the augmentation
    batch_size: int = 32
    holdout: float = 0.2  # fraction of the calibration samples kept aside to choose checkpoints
    train: Train | str = Train.SEGMENT  # every float weight (of a changed segment), or only the changed ones
    pull: float = 0.0  # decay towards the starting weights
    optimizer: Optimizer | str = Optimizer.ADAM  # both stages' update rule (``train.TensorAdam``: one scale a tensor)
    seed: int = 0
    provider: str = "auto"  # onnxruntime provider computing the teacher's tensors
    device: str = "auto"  # torch device of the training: 'auto' = CUDA when torch sees one, else CPU
    memory: int | None = None  # bytes of cached tensors held in RAM, the rest spilled (None: half the available)
    time: float | None = None  # seconds the whole recovery may take: each loop runs for its share of them instead
    # of ``steps`` / ``distill_steps`` (``Clock``), the best checkpoint kept. None: DEFAULT_TIME, unless ``steps`` or
    # ``distill_steps`` is given (then the step counts bound the run)
    spill_dir: str | None = None  # where spilled tensors go (None: the system's temporary folder)

    def torch_device(self) -> torch.device:
        return torch.device("cuda" if self.device == "auto" and torch.cuda.is_available() else
                            "cpu" if self.device == "auto" else self.device)

    def __post_init__(self) -> None:
        for name, kind in (("method", Method), ("train", Train), ("mix", Mix), ("layout", Layout),
                           ("optimizer", Optimizer)):
            check_choice(name, getattr(self, name), tuple(k.value for k in kind))
            setattr(self, name, kind(getattr(self, name)))
        for stage, names in STAGE_OPTIONS.items():
            unused = [f.name for f in fields(self) if f.name in names and getattr(self, f.name) != f.default]
            if unused and not getattr(self.method, stage):
                raise OptionError(f"{', '.join(unused)} set, and method {self.method.value!r} runs no {stage} stage: "
                                  f"leave {'them' if len(unused) > 1 else 'it'} out, or choose method "
                                  f"{Method.BLOCK_DISTILL.value!r}", option=unused[0])
        if self.time is None and self.steps is None and self.distill_steps is None:
            self.time = DEFAULT_TIME
        if self.time is not None and not self.time > 0:
            raise OptionError(f"time {self.time} must be a positive number of seconds", option="time")
        for name, least in (("steps", 1), ("block_window", 1), ("distill_steps", 1), ("distill_views", 1),
                            ("distill_segments", 0), ("pool", 1)):
            if getattr(self, name) is not None and getattr(self, name) < least:
                raise OptionError(f"{name} {getattr(self, name)} must be at least {least}", option=name)
        if self.distill_lr is not None and not self.distill_lr >= 0:
            raise OptionError(f"distill_lr {self.distill_lr} must be a non-negative learning rate",
                              option="distill_lr")
        if not 0 <= self.colour < 1:
            raise OptionError(f"colour {self.colour} must be in [0, 1): factors are drawn in [1 - colour, 1 + colour]",
                              option="colour")
        for name in ("mosaic", "leaves", "steer"):
            if not 0 <= getattr(self, name) <= 1:
                raise OptionError(f"{name} {getattr(self, name)} must be a share of the images in [0, 1]", option=name)
        if not 0 < self.whole_share < 1:
            raise OptionError(f"whole_share {self.whole_share} must be a share of the time in (0, 1)",
                              option="whole_share")
        if not self.temperature > 0:
            raise OptionError(f"temperature {self.temperature} must be positive", option="temperature")
        if not 0 <= self.average < 1:
            raise OptionError(f"average {self.average} must be in [0, 1): each step weighs 1 - average in the mean",
                              option="average")
        if not self.distill_features >= 0:
            raise OptionError(f"distill_features {self.distill_features} must be a non-negative weight",
                              option="distill_features")
        check_memory(self.memory)

    def step_counts(self) -> tuple[int, int]:
        """The block stage's Adam steps per loop and the distillation's, where steps bound the run (``STEPS`` and
        ``DISTILL_STEPS`` for the one not given)."""
        return (STEPS if self.steps is None else self.steps,
                DISTILL_STEPS if self.distill_steps is None else self.distill_steps)

    def store(self) -> Store:
        """Where the run's cached tensors live (``ir.store``)."""
        return Store(default_budget() if self.memory is None else self.memory, self.spill_dir)


RESERVE = 0.05  # of a time budget, kept for the written model's check and the verdict
ROUND_SHARE = 0.05  # of a time budget, the least left after the stages for another round of the block windows
PASSES_SHARE = 0.3  # of a time budget, at most for the block stage's forward passes over every sample (the teacher's
# and the student's at each segment), which no loop's clock bounds: YOLOv8s at 640² spent 4 of a one-minute budget's
# minutes on them over 436 photos
PASSES_COST = 3  # those passes, in passes of the teacher over the same samples
PASSES_FLOOR = 30.0  # seconds those passes may always take (a small model's, sessions included, cost nothing a user
# waits for, whatever a loaded machine makes of them)
HEAD_SEGMENTS = 2  # the head a distillation trains where the whole model's is not chosen (``distill_part``)
WHOLE_STEP_COST = 5  # a whole-model distillation step per sample, in passes of the teacher in onnxruntime (MobileNetV2
# at 224², batch 32: 0.9-1.3 s a step against 7-11 ms a sample)
WHOLE_MIN_STEPS = 100  # the least steps of the whole model's distillation in its share of the time, else the head
VIEWS_SHARE = 0.25  # of a head distillation's time, at most for caching its augmented views: YOLOv8n 320 on 441
# photos cached 8 views of 353 under `--time 1m` and took 104 s, with the share 1 view and 64 s


@dataclass
class Clock:
    """A recovery's time budget (``RecoverOptions.time``): its deadline, and the seconds each loop gets."""

    seconds: float | None
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float | None:
        """Seconds left before the verdict's reserve (None: no budget)."""
        if self.seconds is None:
            return None
        return self.seconds * (1 - RESERVE) - (time.monotonic() - self.start)

    def loop(self, share: float = 1.0) -> float | None:
        """Seconds for one loop: ``share`` of what is left, at least one."""
        left = self.left()
        return None if left is None else max(1.0, share * left)

    def label(self) -> str:
        """' · m:ss left' of the whole budget, or ''."""
        if self.seconds is None:
            return ""
        return f" · {clock_text(self.seconds - (time.monotonic() - self.start))} left"


def distill_part(options: RecoverOptions, classifier: bool, per_sample: float) -> tuple[int, str]:
    """The segments the distillation trains where ``distill_segments`` is not given, and why: the whole model (0)
    for a classifier (on two class-range splits of MobileNetV2 170M it carried to unseen classes 2 points of top-1 and
    17% of KL more than the head: ``benchmarks/results/recovery_classes``) where ``WHOLE_MIN_STEPS`` of its steps fit
    in its share of the time (``per_sample``: the teacher's seconds a sample in onnxruntime), else ``HEAD_SEGMENTS``."""
    if options.distill_segments is not None:
        return options.distill_segments, "as asked"
    if not classifier:
        return HEAD_SEGMENTS, "the head: the whole model's distillation is measured on classifiers only"
    if options.time is None:
        return 0, "the whole model"
    steps = options.whole_share * options.time / (WHOLE_STEP_COST * per_sample * options.batch_size)
    if steps < WHOLE_MIN_STEPS:
        return HEAD_SEGMENTS, (f"the head: about {steps:.0f} steps of the whole model's would fit in its share of --time, "
                               f"fewer than {WHOLE_MIN_STEPS}")
    return 0, f"the whole model: about {steps:.0f} steps fit in {options.whole_share:.0%} of --time"

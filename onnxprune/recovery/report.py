"""What ``recover`` did: per stage, and the verdict on held-out samples."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SegmentReport:
    end: list[str]
    parameters: int
    held_before: float
    held_after: float
    best_step: int
    seconds: float
    stopped: bool = False  # ended early: none of its first held-out measures beat the start (``train.PATIENCE``)
    round: int = 1  # the block windows' round it belongs to (``stages.another_round``: 2 and on, with time left)


@dataclass
class DistillReport:
    parameters: int
    whole_model: bool  # every weight trained on batches augmented on the fly (else the head on cached views)
    trained_from: list[str]  # the tensors the trained part starts at
    samples: int  # training samples seen: cached views of a head, or on-the-fly augmented batches
    augment: str  # what the inputs went through
    held_before: float  # held-out metric (the report's) when the stage started
    held_after: float
    best_step: int
    seconds: float
    lr: float = 0.0  # the learning rate trained with
    lr_trials: list[tuple[float, float]] = field(default_factory=list)  # (lr, held-out loss after its trial) where
    # the rate was chosen among candidates
    stopped: bool = False  # ended early, as ``SegmentReport.stopped``


@dataclass
class RecoverReport:
    samples_train: int
    samples_held: int  # the held-out samples: those that picked the checkpoints, then those that judged
    samples_verdict: int  # the held-out samples that judged the result (before / after), none of which picked
    held_unseen: bool  # the held-out samples were given apart (True) or split off the calibration set
    metric: str  # "kl" (KL(teacher || student) of 2-D outputs' rows as probabilities) or "rel_mse"
    before: float  # metric of the input model on the verdict samples
    after: float  # ... of the recovered weights (returned only if lower)
    agreement_before: float | None  # top-1 agreement with the teacher on the verdict samples (classifiers)
    agreement_after: float | None
    improved: bool  # False: the input model was returned unchanged
    writeback_error: float = 0.0  # relative difference, onnxruntime on the written model vs the trained torch
    # (on the checkpoint-picking samples); past ``writeback_tolerance`` recover raises instead
    seconds: float = 0.0
    device: str = "cpu"  # where torch trained
    options: dict = field(default_factory=dict)
    segments: list[SegmentReport] = field(default_factory=list)
    block_skipped: list[str] = field(default_factory=list)  # the end of the segment left to the distillation
    distill: DistillReport | None = None
    with_objects: int | None = None  # a detector's held-out samples on which the teacher finds an object
    verdict_with_objects: int | None = None  # ... of them, those that judged the result
    tie_objective: tuple[float, float] | None = None  # a detector's mAP50-95 tied on the verdict samples: the
    # training objective there of the input and of the recovered weights, which then decides
    confidence: float | None = None  # the share of bootstrap resamples of the verdict samples on which the
    # recovered weights score better (``verdict.confidence``): how sure the verdict is
    distill_choice: str = ""  # what the distillation trains and why, where --distill-segments was not given
    # (``options.distill_part``)
    samples_given: int = 0  # training samples given; more than ``samples_train`` where the time budget left room for
    # the forward passes over fewer (``options.PASSES_SHARE``)
    train_metric: str = ""  # ``samples.discrepancy``'s metric on the training samples (the held-out one's, but
    # "rel_mse" for a detector whose teacher finds no object in any of them)
    train_before: float | None = None  # that metric on the training samples: the input model's, and the recovered
    train_after: float | None = None  # weights' (what they reach on samples they trained on; the held-out score's
    # distance from it is what the samples did not teach)
    train_agreement_before: float | None = None  # ... and the top-1 agreement there (classifiers)
    train_agreement_after: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)

"""Training, once: the loop every model edgetorch trains runs, its checkpoint format, its losses and evaluation."""

from .evaluate import evaluate_accuracy
from .loop import (
    Checkpointing,
    LastBatch,
    Loop,
    Step,
    TrainingDiverged,
    TrainRun,
    Watch,
    epoch_orders,
    one_cycle_adamw,
    supervised,
    train_epochs,
)
from .losses import Loss, cross_entropy, kd_loss
from .rng import seeded

__all__ = [
    "Checkpointing",
    "LastBatch",
    "Loop",
    "Loss",
    "Step",
    "TrainRun",
    "TrainingDiverged",
    "Watch",
    "cross_entropy",
    "epoch_orders",
    "evaluate_accuracy",
    "kd_loss",
    "one_cycle_adamw",
    "seeded",
    "supervised",
    "train_epochs",
]

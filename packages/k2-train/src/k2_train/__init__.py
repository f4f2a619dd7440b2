"""k2-train: the training loop K2's pretraining, SFT and RL share.

    from k2_train import Trainer, TrainerConfig, NextTokenLoss, TrainState, ModelState, OptimizerState

- `Trainer(model, optimizer, loss, scheduler, config=TrainerConfig(steps=...))`: `train_step(batch)
  -> StepMetrics` (micro-batches, gradient accumulation normalised over the whole step, grad-norm
  clip, optimizer step with QK-Clip, schedule, aux-loss-free bias update) and `fit(loader, state)`.
- Losses are pluggable (`k2_train.losses.Loss`): next-token cross-entropy for pretraining, the
  same masked by the data for SFT, the RL objective in k2-rl.
- `TrainState`: named stateful components saved atomically; exact resume, 1 or N processes.
- `run_training(PretrainConfig | SFTConfig)`: a whole run (what `k2 pretrain` / `k2 sft` call).
"""

__version__ = "0.1.0"

from k2_train.config import PretrainConfig, SFTConfig
from k2_train.distributed import DistInfo
from k2_train.losses import Loss, NextTokenLoss
from k2_train.metrics import Callback, JSONLMetrics, PlainProgress, StepMetrics
from k2_train.run import RunResult, run_training
from k2_train.state import ModelState, OptimizerState, RNGState, TrainState
from k2_train.trainer import FitResult, Trainer, TrainerConfig

__all__ = [
    "Callback",
    "DistInfo",
    "FitResult",
    "JSONLMetrics",
    "Loss",
    "ModelState",
    "NextTokenLoss",
    "OptimizerState",
    "PlainProgress",
    "PretrainConfig",
    "RNGState",
    "RunResult",
    "SFTConfig",
    "StepMetrics",
    "TrainState",
    "Trainer",
    "TrainerConfig",
    "run_training",
]

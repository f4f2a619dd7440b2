"""k2-rl: reinforcement learning for K2 with the Kimi K1.5 objective.

    from k2_rl import RLConfig, run_rl, kimi_k15_loss

- `k2_rl.loss`: `kimi_k15_loss` (the contract), a GRPO-style clipped objective, PTX; both as
  k2-train losses (`KimiK15Loss`, `GRPOClippedLoss`).
- `k2_rl.rewards`: verifiable rewards (math with math-verify, code in k2-data's sandbox,
  instruction following with a hack-check), a registry users extend, a process pool.
- `k2_rl.rollout`: the rollout worker (k2-model's engine + k2-ckpt's receiver) and its client.
- `k2_rl.loop.run_rl`: the loop (`k2 rl`), `k2_rl.tasks`: generated verifiable tasks.
"""

__version__ = "0.1.0"

from k2_rl.config import RLConfig
from k2_rl.loss import GRPOClippedLoss, KimiK15Loss, grpo_clipped_loss, kimi_k15_loss


def __getattr__(name: str):
    # the loop pulls in the engine, k2-ckpt and the HTTP stack; keep `import k2_rl` light
    if name in ("run_rl", "RLResult"):
        from k2_rl import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'k2_rl' has no attribute {name!r}")


__all__ = [
    "GRPOClippedLoss",
    "KimiK15Loss",
    "RLConfig",
    "RLResult",
    "grpo_clipped_loss",
    "kimi_k15_loss",
    "run_rl",
]

"""k2-rl: reinforcement learning for K2 (the K1.5 objective, verifiable and rubric rewards,
budget control, PTX loss, colocated rollouts). Not implemented yet: see the package README."""

__version__ = "0.1.0"

"""k2-model: the Kimi K2 / DeepSeek-V3 architecture (MLA + fine-grained MoE) in PyTorch."""

from k2_model.config import PRESETS, K2Config

__all__ = ["K2Config", "PRESETS"]
__version__ = "0.1.0"

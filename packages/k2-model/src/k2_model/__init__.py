"""k2-model: the Kimi K2 / DeepSeek-V3 architecture (MLA + fine-grained MoE) in PyTorch."""

from k2_model.config import PRESETS, K2Config
from k2_model.model import K2CausalLMOutput, K2ForCausalLM, K2Model
from k2_model.spec import ModelSpec

__all__ = ["K2Config", "K2ForCausalLM", "K2Model", "K2CausalLMOutput", "ModelSpec", "PRESETS"]
__version__ = "0.1.0"
from k2_model.engine import Completion, Engine, SamplingParams  # noqa: F401  (generation: k2_model.engine)

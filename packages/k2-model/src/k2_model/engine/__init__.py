"""k2_model.engine: batched generation over MLA's compressed KV cache (absorbed-weight decode).

from k2_model.engine import Engine, SamplingParams
engine = Engine(model, detokenize=tok.decode)
outs = engine.generate([ids_a, ids_b], SamplingParams(max_tokens=64, temperature=0.7, seed=1))
"""

from k2_model.engine.cache import MLACache
from k2_model.engine.engine import Completion, Engine, StepOutput
from k2_model.engine.forward import decode, prefill
from k2_model.engine.sampling import SamplingParams, process_logits, sample
from k2_model.engine.thread import EngineThread

__all__ = [
    "Completion", "Engine", "EngineThread", "MLACache", "SamplingParams", "StepOutput", "decode", "prefill", "process_logits", "sample",
]  # fmt: skip

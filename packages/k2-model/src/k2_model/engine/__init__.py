"""k2_model.engine: batched generation over MLA's compressed KV cache (absorbed-weight decode).

from k2_model.engine import Engine, SamplingParams
engine = Engine(model, detokenize=tok.decode)
outs = engine.generate([ids_a, ids_b], SamplingParams(max_tokens=64, temperature=0.7, seed=1))
samples = engine.generate([ids_a], SamplingParams(n=8, temperature=1.0, seed=1))  # one prefill, 8 streams
"""

from k2_model.engine.cache import MLACache, block_key
from k2_model.engine.engine import Completion, Engine, EngineStats, StepOutput
from k2_model.engine.forward import decode, prefill
from k2_model.engine.sampling import SamplingParams, process_logits, sample, sample_seed
from k2_model.engine.thread import EngineThread

__all__ = [
    "Completion", "Engine", "EngineStats", "EngineThread", "MLACache", "SamplingParams", "StepOutput", "block_key",
    "decode", "prefill", "process_logits", "sample", "sample_seed",
]  # fmt: skip

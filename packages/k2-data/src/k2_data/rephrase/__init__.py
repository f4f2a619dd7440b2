"""Knowledge rephrasing and math learning notes (Kimi K2 section 3.3), checked for fidelity.

    from k2_data.rephrase import RephraseConfig, rephrase

    manifest = rephrase(["docs.jsonl"], "data/rephrased", base_url="http://127.0.0.1:8000/v1",
                        config=RephraseConfig(model="k2-tiny", rounds=2))

Modules, one job each: `chunking` (sentence-boundary chunks with spans, stitching), `prompts` (the
prompt library and chunk messages), `fidelity` (numbers, formulas, entities, similarity), `embed`
(all-MiniLM-L6-v2 in plain torch), `judge` (the optional LLM judge), `pipeline` (the resumable run
writing shards), `loopback` (a scriptable OpenAI-protocol server for tests and benchmarks), `cli`.
"""

from k2_data.rephrase.chunking import Chunk, chunk_text, split_sentences, stitch
from k2_data.rephrase.fidelity import FidelityConfig, FidelityReport, check
from k2_data.rephrase.pipeline import MAX_ROUNDS, SCHEMA, RephraseConfig, default_corpus, read_rows, rephrase
from k2_data.rephrase.prompts import Prompt, load_prompts

__all__ = [
    "MAX_ROUNDS",
    "SCHEMA",
    "Chunk",
    "FidelityConfig",
    "FidelityReport",
    "Prompt",
    "RephraseConfig",
    "check",
    "chunk_text",
    "default_corpus",
    "load_prompts",
    "read_rows",
    "rephrase",
    "split_sentences",
    "stitch",
]

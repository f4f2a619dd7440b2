"""k2-data: Arrow-based data for K2 — tokenizers, tokenized shards, packing and a stateful loader.

from k2_data import load_tokenizer, tokenize_corpus, PackedDataset, StatefulLoader
"""

from k2_data._version import __version__ as __version__
from k2_data.chat import ToolCallStreamParser, parse_tool_calls, render_chat, render_ids
from k2_data.config import DataConfig
from k2_data.corpus import default_corpus_files
from k2_data.ingest import BadRecordError, TokenizeConfig, ensure_tokenized, load_manifest, tokenize_corpus
from k2_data.mixture import MixedDataset, parse_mixture
from k2_data.packing import IGNORE_INDEX, PackedDataset
from k2_data.sft import ChatTokenizeConfig, tokenize_chat
from k2_data.special_tokens import NUM_RESERVED_SPECIAL_TOKENS, special_token_table
from k2_data.tokenizer import BPETokenizer, KimiTokenizer, Tokenizer, load_tokenizer


def __getattr__(name: str):
    # the loader pulls in torch; keep `import k2_data` light for tokenizer-only users
    if name == "StatefulLoader":
        from k2_data.loader import StatefulLoader

        return StatefulLoader
    raise AttributeError(f"module 'k2_data' has no attribute {name!r}")


__all__ = [
    "BPETokenizer",
    "BadRecordError",
    "IGNORE_INDEX",
    "KimiTokenizer",
    "MixedDataset",
    "NUM_RESERVED_SPECIAL_TOKENS",
    "PackedDataset",
    "ChatTokenizeConfig",
    "DataConfig",
    "StatefulLoader",
    "TokenizeConfig",
    "Tokenizer",
    "default_corpus_files",
    "ensure_tokenized",
    "load_manifest",
    "load_tokenizer",
    "parse_mixture",
    "special_token_table",
    "tokenize_chat",
    "tokenize_corpus",
]
__all__ += ["ToolCallStreamParser", "parse_tool_calls", "render_chat", "render_ids"]  # the chat format

"""`k2 pretrain`: pretraining a K2-architecture model with MuonClip, end to end.

This is the composition layer (k2-model + k2-optim + k2-data); each piece it uses is a public API
of its package. Modules: `config` (the run configuration), `data` (default corpus -> tokenized
shards -> packed loader), `checkpoint` (atomic, resumable state), `plots`, `trainer` (the loop).
"""

from k2_stack.pretrain.config import PretrainConfig
from k2_stack.pretrain.trainer import run_pretrain

__all__ = ["PretrainConfig", "run_pretrain"]

"""k2-ckpt: the checkpoint engine. Bucketed, pipelined weight sync from trainers to inference engines.

Training side: `ParameterServer` (one per rank). Inference side: `update_weights_from_ipc`
with a loader (`ModuleAdapter` for any nn.Module by HF names; vLLM/SGLang in `k2_ckpt.adapters`).
HTTP: `k2_ckpt.api`.
"""

from k2_ckpt.adapters.module import ModuleAdapter
from k2_ckpt.errors import (
    BadCheckpoint,
    CheckpointExists,
    CheckpointNotFound,
    CkptError,
    FileMissing,
    RankFailure,
    TensorMismatch,
    UpdateAborted,
    UpdateError,
)
from k2_ckpt.server import ParameterServer, ServerConfig, UpdateStats
from k2_ckpt.types import TensorMeta
from k2_ckpt.worker import FunctionLoader, ReceiveResult, WeightLoader, update_weights_from_ipc

__version__ = "0.1.0"

__all__ = [
    "ParameterServer",
    "ServerConfig",
    "UpdateStats",
    "TensorMeta",
    "update_weights_from_ipc",
    "WeightLoader",
    "FunctionLoader",
    "ReceiveResult",
    "ModuleAdapter",
    "CkptError",
    "CheckpointNotFound",
    "CheckpointExists",
    "FileMissing",
    "BadCheckpoint",
    "TensorMismatch",
    "UpdateAborted",
    "UpdateError",
    "RankFailure",
]

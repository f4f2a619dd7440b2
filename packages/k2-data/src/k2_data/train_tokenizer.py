"""Train a byte-level BPE with K2's 256 reserved specials after its BPE ids.

`python -m k2_data.train_tokenizer` regenerates the shipped default tokenizer (7936 BPE ids on the
default corpus + 256 specials = 8192). `k2 data train-tokenizer` calls `train_bpe` on any corpus.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
from collections.abc import Iterable
from pathlib import Path

from k2_data.corpus import default_corpus_files, expand_inputs, iter_texts
from k2_data.special_tokens import NUM_RESERVED_SPECIAL_TOKENS, special_token_table
from k2_data.tokenizer import KIMI_PAT_STR, BPETokenizer, default_tokenizer_path

DEFAULT_VOCAB_SIZE = 8192


def train_bpe(
    texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, min_frequency: int = 2
) -> BPETokenizer:
    """A byte-level BPE with exactly `vocab_size` ids: `vocab_size - 256` BPE ids, then the specials.

    Pre-tokenization is the Kimi split pattern, so both tokenizers cut text the same way.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    num_base = vocab_size - NUM_RESERVED_SPECIAL_TOKENS
    if num_base < 257:
        raise ValueError(
            f"vocab_size={vocab_size} leaves no room for merges (need > {256 + NUM_RESERVED_SPECIAL_TOKENS})"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=num_base,
        min_frequency=min_frequency,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != num_base:
        raise ValueError(
            f"the corpus supports only {got} BPE ids, fewer than the {num_base} asked for; use a smaller vocab_size"
        )
    specials = special_token_table(num_base)
    ordered = [name for name, _ in sorted(specials.items(), key=lambda kv: kv[1])]
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in ordered])
    return BPETokenizer(tok, source="trained")


def train_on_files(inputs: Iterable[str | Path] | None, vocab_size: int = DEFAULT_VOCAB_SIZE) -> BPETokenizer:
    """Train on the text of `inputs` (files or directories), or on the default corpus when None."""
    files = default_corpus_files() if inputs is None else expand_inputs(inputs)
    return train_bpe(iter_texts(files), vocab_size=vocab_size)


TRAINING_RECORD = "TRAINING.json"


def corpus_sha256(files: list[Path]) -> str:
    """Identity of a training corpus: its files' contents, in order."""
    h = hashlib.sha256()
    for p in files:
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=default_tokenizer_path(), help="output directory")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    args = parser.parse_args(argv)
    files = default_corpus_files()
    tok = train_bpe(iter_texts(files), vocab_size=args.vocab_size)
    tok.save(args.out)
    # what it was trained on, so a test can retrain and compare where the corpus is the same
    record = {
        "python": platform.python_version(),
        "corpus": "default (stdlib *.py, tests and site-packages skipped)",
        "corpus_files": len(files),
        "corpus_sha256": corpus_sha256(files),
        "vocab_size": tok.vocab_size,
        "tokenizer_sha256": tok.fingerprint(),
    }
    (Path(args.out) / TRAINING_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out} ({tok.vocab_size} ids, sha256 {tok.fingerprint()[:16]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The tiktoken path (Kimi K2's released tokenizer format), on a small ranks file made here.

Reference: a plain-Python rank-merge BPE over the pieces that the `regex` module cuts with the
same split pattern, i.e. the algorithm tiktoken implements, written out.
"""

from __future__ import annotations

import json

import pytest
from k2_data import KimiTokenizer, load_tokenizer
from k2_data.tokenizer import KIMI_PAT_STR, MAX_NO_WHITESPACES_CHARS, write_tiktoken_ranks
from k2_data.train_tokenizer import train_bpe

regex = pytest.importorskip("regex")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-ins for bytes, the alphabet byte-level BPE vocabularies are written in."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _ranks_from_bpe(texts: list[str], vocab_size: int) -> dict[bytes, int]:
    """Bytes 0..255 first, then each merged token in merge order: a valid tiktoken ranks table."""
    bpe = train_bpe(texts, vocab_size=vocab_size)
    to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    vocab = json.loads(bpe.hf_tokenizer.to_str())["model"]["vocab"]
    merged = sorted((i, tok) for tok, i in vocab.items() if len(tok) > 1)
    ranks = {bytes([b]): b for b in range(256)}
    for _, tok in merged:
        ranks[bytes(to_byte[c] for c in tok)] = len(ranks)
    return ranks


def _reference_encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    out = []
    for piece in regex.findall(KIMI_PAT_STR, text, flags=regex.V1):
        parts = [bytes([b]) for b in piece.encode()]
        while len(parts) > 1:
            best = None
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and (best is None or r < best[0]):
                    best = (r, i)
            if best is None:
                break
            i = best[1]
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        out.extend(ranks[p] for p in parts)
    return out


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    from k2_data.corpus import default_corpus_files

    files = [
        p for p in default_corpus_files() if p.name in ("abc.py", "bisect.py", "colorsys.py", "keyword.py")
    ]
    texts = [p.read_text() for p in files] + ["你好，世界。中文分词测试 naïve café"] * 3
    ranks = _ranks_from_bpe(texts, vocab_size=256 + 400 + 256)
    d = tmp_path_factory.mktemp("kimi")
    write_tiktoken_ranks(d / "tiktoken.model", ranks)
    base = len(ranks)
    # released-style config: names keyed by absolute id, only some slots listed
    added = {
        str(base + 0): {"content": "[BOS]", "special": True},
        str(base + 1): {"content": "[EOS]", "special": True},
        str(base + 2): {"content": "<|im_end|>", "special": True},
        str(base + 7): {"content": "<|custom|>", "special": True},
    }
    (d / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    return load_tokenizer(d), ranks, texts


def test_loads_with_k2_special_layout(kimi):
    tok, ranks, _ = kimi
    base = len(ranks)
    assert isinstance(tok, KimiTokenizer) and tok.kind == "tiktoken"
    assert tok.num_base_tokens == base and tok.vocab_size == base + 256
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (base, base + 1, base + 255, base + 254)
    assert tok.token_to_id("<|tool_call_end|>") == base + 15 and tok.token_to_id("<|im_middle|>") == base + 17
    assert tok.token_to_id("<|custom|>") == base + 7  # tokenizer_config.json names win
    assert tok.token_to_id(f"<|reserved_token_{base + 5}|>") == base + 5


def test_encode_matches_reference_bpe(kimi):
    tok, ranks, texts = kimi
    samples = texts[:4] + ["Hello World's THE'S don't 12345 \n\n\t  x", "中文English混合123", "x" * 50]
    for text in samples:
        ids = tok.encode(text)
        assert ids == _reference_encode(text, ranks)
        assert tok.decode(ids) == text
    assert tok.encode_batch(samples) == [tok.encode(t) for t in samples]
    # the merges are real: code compresses well beyond one byte per token
    assert len(texts[0].encode()) / len(tok.encode(texts[0])) > 2.0


def test_special_tokens_and_long_runs(kimi, tmp_path):
    tok, _, _ = kimi
    chat = "<|im_user|>user<|im_middle|>hi<|im_end|>"
    ids = tok.encode(chat, allow_special=True)
    assert ids[0] == tok.token_to_id("<|im_user|>") and ids[-1] == tok.token_to_id("<|im_end|>")
    assert tok.token_to_id("<|im_end|>") not in tok.encode(chat)  # text, unless allowed
    assert tok.decode(ids) == chat and tok.decode(ids, skip_special=True) == "userhi"
    long = "a" * (MAX_NO_WHITESPACES_CHARS + 10) + " " * (MAX_NO_WHITESPACES_CHARS * 2) + "end"
    assert tok.decode(tok.encode(long)) == long
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.fingerprint() == tok.fingerprint() and again.encode(chat, allow_special=True) == ids


def test_bad_ranks_file_is_named(tmp_path):
    (tmp_path / "tiktoken.model").write_text("not base64!! x\n")
    with pytest.raises(ValueError, match="tiktoken.model"):
        load_tokenizer(tmp_path)


def test_ingest_and_pack_with_kimi_tokenizer(kimi, tmp_path):
    from k2_data import PackedDataset, TokenizeConfig, load_manifest, tokenize_corpus

    tok, ranks, texts = kimi
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenize_corpus(
        [src], tmp_path / "out", tokenizer=tok.directory, config=TokenizeConfig(workers=2, shard_bytes=2000)
    )
    m = load_manifest(tmp_path / "out")
    assert m["tokenizer"]["kind"] == "tiktoken" and m["tokenizer"]["eos_id"] == len(ranks) + 1
    assert m["num_tokens"] == sum(len(tok.encode(t)) for t in texts)
    ds = PackedDataset(tmp_path / "out", seq_len=32, shuffle=False)
    assert ds[0]["input_ids"].tolist() == tok.encode(texts[0])[:32]
    assert load_tokenizer(tmp_path / "out" / "tokenizer").fingerprint() == tok.fingerprint()

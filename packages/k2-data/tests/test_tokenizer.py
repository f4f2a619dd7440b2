"""The shipped byte-level BPE: K2's special-token layout, exact round trips, HF compatibility."""

from __future__ import annotations

import json

import pytest
from k2_data import load_tokenizer
from k2_data.special_tokens import NAMED_SPECIAL_OFFSETS, special_token_table
from k2_data.tokenizer import BPETokenizer, default_tokenizer_path
from k2_data.train_tokenizer import train_bpe

# K2's released ids (MISSION.md) minus its base 163584 = the offsets every k2 tokenizer uses
K2_IDS = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|im_end|>": 163586,
    "<|im_user|>": 163587,
    "<|im_assistant|>": 163588,
    "[EOT]": 163593,
    "<|im_system|>": 163594,
    "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598,
    "<|tool_call_end|>": 163599,
    "<|im_middle|>": 163601,
    "[UNK]": 163838,
    "[PAD]": 163839,
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_k2_table_matches_released_ids():
    table = special_token_table(163584)
    for name, i in K2_IDS.items():
        assert table[name] == i
    assert len(table) == 256 and sorted(table.values()) == list(range(163584, 163840))
    assert table["<|reserved_token_163589|>"] == 163589  # unnamed slots use the absolute id


def test_default_tokenizer_layout(tok):
    assert tok.kind == "hf-bpe"
    assert tok.vocab_size == 8192 and tok.num_base_tokens == 7936
    for name, i in K2_IDS.items():
        assert tok.token_to_id(name) == i - 163584 + 7936
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.pad_id) == (7936, 7937, 8190, 8191)
    assert set(NAMED_SPECIAL_OFFSETS.values()) <= set(tok.special_tokens)
    # the shipped files are small and carry the layout in tokenizer_config.json
    d = default_tokenizer_path()
    assert sum(f.stat().st_size for f in d.iterdir()) < 1_000_000
    config = json.loads((d / "tokenizer_config.json").read_text())
    assert config["added_tokens_decoder"]["7937"]["content"] == "[EOS]"
    assert config["added_tokens_decoder"]["7941"]["content"] == "<|reserved_token_7941|>"


def test_round_trip_and_compression(tok, stdlib_texts):
    texts = stdlib_texts()
    texts["unicode"] = "naïve café — 你好，世界 🙂 \t\r\n  \u00a0end"
    for name, text in texts.items():
        ids = tok.encode(text)
        assert tok.decode(ids) == text, name
        assert all(0 <= i < 7936 for i in ids), name  # plain text never yields special ids
    code = "".join(texts[n] for n in ("abc.py", "bisect.py", "colorsys.py"))
    bytes_per_token = len(code.encode()) / len(tok.encode(code))
    assert bytes_per_token > 3.0  # trained on this kind of text; bytes alone would be 1.0


def test_special_strings_are_text_unless_allowed(tok):
    s = "<|im_user|>user<|im_middle|>hi<|im_end|>"
    plain = tok.encode(s)
    assert not set(plain) & set(tok.special_tokens.values())
    assert tok.decode(plain) == s
    special = tok.encode(s, allow_special=True)
    assert special[0] == tok.token_to_id("<|im_user|>") and special[-1] == tok.token_to_id("<|im_end|>")
    assert tok.decode(special) == s
    assert tok.decode(special, skip_special=True) == "userhi"
    assert tok.encode_batch([s, "x"], allow_special=True) == [special, tok.encode("x")]


def test_transformers_loads_saved_tokenizer(tok, tmp_path, stdlib_texts):
    transformers = pytest.importorskip("transformers")
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = stdlib_texts(["colorsys.py"])["colorsys.py"]
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id, hf.unk_token_id) == (7937, 7936, 8191, 8190)
    assert len(hf) == 8192
    assert load_tokenizer(tmp_path).fingerprint() == tok.fingerprint()


def test_train_small_bpe_is_deterministic(tmp_path, stdlib_texts):
    texts = list(stdlib_texts().values())
    a, b = train_bpe(texts, vocab_size=1024), train_bpe(texts, vocab_size=1024)
    assert a.vocab_size == 1024 and a.eos_id == 1024 - 256 + 1
    assert a.fingerprint() == b.fingerprint()
    a.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert isinstance(again, BPETokenizer) and again.encode(texts[0]) == a.encode(texts[0])
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(texts, vocab_size=300)


def test_missing_tokenizer_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither tiktoken.model nor tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


@pytest.mark.slow
def test_shipped_tokenizer_regenerates_from_its_script():
    """`python -m k2_data.train_tokenizer` reproduces the shipped files where the corpus is the same."""
    from k2_data.corpus import default_corpus_files
    from k2_data.train_tokenizer import TRAINING_RECORD, corpus_sha256

    record = json.loads((default_tokenizer_path() / TRAINING_RECORD).read_text())
    shipped = load_tokenizer()
    assert record["tokenizer_sha256"] == shipped.fingerprint() and record["vocab_size"] == 8192
    files = default_corpus_files()
    if corpus_sha256(files) != record["corpus_sha256"]:
        pytest.skip(f"this Python's stdlib differs from the training corpus (Python {record['python']})")
    from k2_data.corpus import iter_texts

    assert train_bpe(iter_texts(files)).fingerprint() == shipped.fingerprint()

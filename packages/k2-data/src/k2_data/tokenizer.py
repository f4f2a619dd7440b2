"""One tokenizer interface for the two tokenizers K2 uses.

- `KimiTokenizer`: the released Kimi K2 tokenizer (`tiktoken.model` + `tokenizer_config.json`),
  run by `tiktoken` with the released split pattern; 256 reserved specials after the BPE ranks.
- `BPETokenizer`: a byte-level BPE from HF `tokenizers` with the same split pattern and the same
  256 specials at the same offsets. k2-data ships one (8192 ids) trained on the default corpus.

`load_tokenizer(path | None)` picks the right one for a directory (or the shipped default).
Encoding treats special-token strings in the text as plain text unless `allow_special=True`, so
a corpus that happens to contain `<|im_end|>` cannot inject control tokens.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path

from k2_data.special_tokens import BOS, EOS, NUM_RESERVED_SPECIAL_TOKENS, PAD, UNK, special_token_table

# The split pattern of the released tokenization_kimi.py: Han runs, words (case-aware, with English
# contractions), 1-3 digit groups, punctuation runs, newlines and whitespace.
KIMI_PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

# tiktoken panics on very long inputs and is quadratic on very long runs without a split point;
# the released tokenizer cuts text at these sizes first, and so do we.
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000

TOKENIZER_CONFIG = "tokenizer_config.json"
TIKTOKEN_MODEL = "tiktoken.model"
HF_TOKENIZER = "tokenizer.json"
DEFAULT_TOKENIZER_DIR = "assets/default_tokenizer"


class Tokenizer(ABC):
    """What k2 needs from a tokenizer: ids in, ids out, the special ids, and a way to save it."""

    kind: str
    special_tokens: dict[str, int]

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def num_base_tokens(self) -> int: ...

    @abstractmethod
    def encode(self, text: str, allow_special: bool = False) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str], allow_special: bool = False) -> list[list[int]]:
        return [self.encode(t, allow_special=allow_special) for t in texts]

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str: ...

    @abstractmethod
    def save(self, directory: str | Path) -> Path: ...

    @abstractmethod
    def _model_bytes(self) -> bytes:
        """The bytes that define the mapping (hashed into `fingerprint`)."""

    def token_to_id(self, token: str) -> int:
        if token not in self.special_tokens:
            raise KeyError(f"{token!r} is not a special token of this tokenizer")
        return self.special_tokens[token]

    @property
    def bos_id(self) -> int:
        return self.special_tokens[BOS]

    @property
    def eos_id(self) -> int:
        return self.special_tokens[EOS]

    @property
    def pad_id(self) -> int:
        return self.special_tokens[PAD]

    @property
    def unk_id(self) -> int:
        return self.special_tokens[UNK]

    def fingerprint(self) -> str:
        """sha256 over the model bytes and the special-token table: equal iff ids mean the same."""
        h = hashlib.sha256(self._model_bytes())
        h.update(json.dumps(sorted(self.special_tokens.items(), key=lambda kv: kv[1])).encode())
        return h.hexdigest()

    def identity(self) -> dict:
        """What a tokenized dataset records about the tokenizer that produced it."""
        return {
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "num_base_tokens": self.num_base_tokens,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "sha256": self.fingerprint(),
        }

    def _hf_config(self, tokenizer_class: str) -> dict:
        """A tokenizer_config.json in the released layout (added_tokens_decoder keyed by id)."""
        return {
            "tokenizer_class": tokenizer_class,
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "unk_token": UNK,
            "model_max_length": 1_000_000_000,
            "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": {
                str(i): {
                    "content": name,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
                for name, i in sorted(self.special_tokens.items(), key=lambda kv: kv[1])
            },
        }


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; written files should read like any other
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_added_tokens(config_path: Path) -> dict[int, str]:
    if not config_path.is_file():
        return {}
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from e
    decoder = config.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise ValueError(f"{config_path}: field 'added_tokens_decoder' must be an object keyed by id")
    out: dict[int, str] = {}
    for key, value in decoder.items():
        content = value.get("content") if isinstance(value, dict) else value
        if not isinstance(content, str):
            raise ValueError(f"{config_path}: added_tokens_decoder[{key!r}] has no string 'content'")
        out[int(key)] = content
    return out


# ----------------------------------------------------------------------------- tiktoken (Kimi K2)


def _split_long_runs(text: str, max_run: int) -> Iterator[str]:
    """Cut `text` where a run of only-whitespace or only-non-whitespace exceeds `max_run` chars."""
    start = 0
    run = 0
    current_is_space: bool | None = None
    for i, ch in enumerate(text):
        is_space = ch.isspace()
        if is_space == current_is_space:
            run += 1
            if run > max_run:
                yield text[start:i]
                start = i
                run = 1
        else:
            current_is_space = is_space
            run = 1
    yield text[start:]


class KimiTokenizer(Tokenizer):
    """The released Kimi K2 tokenizer: tiktoken BPE ranks plus 256 reserved specials."""

    kind = "tiktoken"

    def __init__(self, directory: str | Path):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        self.directory = Path(directory)
        model = self.directory / TIKTOKEN_MODEL
        if not model.is_file():
            raise FileNotFoundError(f"{model} not found (a Kimi tokenizer directory holds {TIKTOKEN_MODEL})")
        self._model_data = model.read_bytes()
        try:
            ranks = load_tiktoken_bpe(str(model))
        except Exception as e:  # tiktoken raises bare ValueError/binascii errors without the path
            raise ValueError(
                f"{model}: not a tiktoken BPE ranks file (base64 token, space, rank per line): {e}"
            ) from e
        n = len(ranks)
        if sorted(ranks.values()) != list(range(n)):
            raise ValueError(f"{model}: ranks must be exactly 0..{n - 1}")
        self._num_base = n
        self.special_tokens = special_token_table(n, _read_added_tokens(self.directory / TOKENIZER_CONFIG))
        self._special_ids = frozenset(self.special_tokens.values())
        self._enc = tiktoken.Encoding(
            name=f"kimi-{n}", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=self.special_tokens
        )

    @property
    def vocab_size(self) -> int:
        return self._num_base + NUM_RESERVED_SPECIAL_TOKENS

    @property
    def num_base_tokens(self) -> int:
        return self._num_base

    def _pieces(self, text: str) -> Iterator[str]:
        for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
            yield from _split_long_runs(text[i : i + TIKTOKEN_MAX_ENCODE_CHARS], MAX_NO_WHITESPACES_CHARS)

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        out: list[int] = []
        for piece in self._pieces(text):
            if allow_special:
                out.extend(self._enc.encode(piece, allowed_special="all", disallowed_special=()))
            else:
                out.extend(self._enc.encode_ordinary(piece))
        return out

    def encode_batch(self, texts: Sequence[str], allow_special: bool = False) -> list[list[int]]:
        if any(len(t) > MAX_NO_WHITESPACES_CHARS for t in texts):
            return [self.encode(t, allow_special=allow_special) for t in texts]
        if allow_special:
            return self._enc.encode_batch(list(texts), allowed_special="all", disallowed_special=())
        return self._enc.encode_ordinary_batch(list(texts))

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        if skip_special:
            ids = [i for i in ids if i not in self._special_ids]
        return self._enc.decode(list(ids), errors="replace")

    def _model_bytes(self) -> bytes:
        return self._model_data

    def save(self, directory: str | Path) -> Path:
        out = Path(directory)
        _atomic_write_bytes(out / TIKTOKEN_MODEL, self._model_data)
        config = self._hf_config("TikTokenTokenizer")
        _atomic_write_bytes(out / TOKENIZER_CONFIG, json.dumps(config, indent=2).encode())
        return out


def write_tiktoken_ranks(path: str | Path, ranks: dict[bytes, int]) -> None:
    """Write a `tiktoken.model` file: one `base64(token) rank` line per token, by rank."""
    lines = [
        f"{base64.b64encode(tok).decode()} {rank}"
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    _atomic_write_bytes(Path(path), ("\n".join(lines) + "\n").encode())


# ----------------------------------------------------------------------------- HF byte-level BPE


def _byte_level_alphabet() -> dict[str, int]:
    """The printable stand-in character of each byte in byte-level BPE vocabularies -> the byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _tiktoken_engine(hf_json: str):
    """The same BPE as a tiktoken Encoding (ranks = BPE ids), or None if the model is not a plain
    byte-level BPE with the Kimi split.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank, the HF BPE the pair
    whose merge rule has the lowest priority. For a trained BPE (id = creation order) the two agree
    except where a token can also be formed from a pair that is not its own rule; on the default
    corpus they agree on every document (tested), and ingest spot-checks documents against HF.
    """
    try:
        import tiktoken
    except ImportError:  # e.g. a GPU machine without it: HF tokenizers alone give the same ids
        return None

    data = json.loads(hf_json)
    model, pre = data.get("model", {}), data.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if (
        model.get("type") != "BPE"
        or len(steps) != 2
        or steps[0].get("type") != "Split"
        or steps[0].get("pattern", {}).get("Regex") != KIMI_PAT_STR
        or steps[1].get("type") != "ByteLevel"
        or data.get("normalizer") is not None
    ):
        return None
    to_byte = _byte_level_alphabet()
    try:
        ranks = {bytes(to_byte[c] for c in tok): i for tok, i in model["vocab"].items()}
    except KeyError:
        return None
    if sorted(ranks.values()) != list(range(len(ranks))) or any(bytes([b]) not in ranks for b in range(256)):
        return None
    return tiktoken.Encoding(name="k2-bpe", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens={})


class BPETokenizer(Tokenizer):
    """A byte-level BPE (HF `tokenizers`) whose last 256 ids are K2's reserved specials."""

    kind = "hf-bpe"

    def __init__(self, tokenizer: object, source: str = "<memory>"):
        from tokenizers import Tokenizer as HFTokenizer

        if not isinstance(tokenizer, HFTokenizer):
            raise TypeError(f"expected a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
        self._tok = tokenizer
        self.source = source
        total = tokenizer.get_vocab_size(with_added_tokens=True)
        base = total - NUM_RESERVED_SPECIAL_TOKENS
        added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        expected = special_token_table(base, added)
        for name, i in expected.items():
            if tokenizer.token_to_id(name) != i:
                raise ValueError(
                    f"{source}: special token {name!r} must have id {i} (the 256 reserved ids follow the "
                    f"{base} BPE ids), found {tokenizer.token_to_id(name)}"
                )
        self._num_base = base
        self.special_tokens = expected
        self._special_ids = frozenset(expected.values())
        # Special-token strings inside ordinary text are encoded as text (see module docstring).
        self._plain = tokenizer
        self._plain.encode_special_tokens = True
        self._with_special = HFTokenizer.from_str(tokenizer.to_str())
        self._with_special.encode_special_tokens = False
        self._fast = _tiktoken_engine(tokenizer.to_str())

    @classmethod
    def from_file(cls, path: str | Path) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise ValueError(f"{path}: not a HF tokenizers tokenizer.json ({e})") from e
        return cls(tok, source=str(path))

    @property
    def vocab_size(self) -> int:
        return self._num_base + NUM_RESERVED_SPECIAL_TOKENS

    @property
    def num_base_tokens(self) -> int:
        return self._num_base

    @property
    def hf_tokenizer(self):
        return self._plain

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        tok = self._with_special if allow_special else self._plain
        return tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], allow_special: bool = False) -> list[list[int]]:
        tok = self._with_special if allow_special else self._plain
        return [e.ids for e in tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    @property
    def has_fast_engine(self) -> bool:
        return self._fast is not None

    def encode_batch_fast(self, texts: Sequence[str]) -> list[list[int]]:
        """Like `encode_batch` (plain text), on the tiktoken engine (about 5x faster on this BPE);
        falls back to HF when the model has no equivalent tiktoken form."""
        if self._fast is None:
            return self.encode_batch(texts)
        return self._fast.encode_ordinary_batch(list(texts), num_threads=1)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self._plain.decode(list(ids), skip_special_tokens=skip_special)

    def _model_bytes(self) -> bytes:
        return self._plain.to_str().encode()

    def save(self, directory: str | Path) -> Path:
        out = Path(directory)
        _atomic_write_bytes(out / HF_TOKENIZER, self._with_special.to_str().encode())
        config = self._hf_config("PreTrainedTokenizerFast")
        _atomic_write_bytes(out / TOKENIZER_CONFIG, json.dumps(config, indent=2).encode())
        return out


def default_tokenizer_path() -> Path:
    return Path(str(resources.files("k2_data").joinpath(DEFAULT_TOKENIZER_DIR)))


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer at `path` (a directory or a file), or the shipped 8192-id BPE when None.

    A directory with `tiktoken.model` loads as the Kimi tokenizer; one with `tokenizer.json` (or
    that file itself) as a byte-level BPE.
    """
    p = default_tokenizer_path() if path is None else Path(path)
    if p.is_dir():
        if (p / TIKTOKEN_MODEL).is_file():
            return KimiTokenizer(p)
        if (p / HF_TOKENIZER).is_file():
            return BPETokenizer.from_file(p / HF_TOKENIZER)
        raise FileNotFoundError(f"tokenizer directory {p} has neither {TIKTOKEN_MODEL} nor {HF_TOKENIZER}")
    if p.is_file():
        if p.name == TIKTOKEN_MODEL:
            return KimiTokenizer(p.parent)
        return BPETokenizer.from_file(p)
    raise FileNotFoundError(f"tokenizer path {p} does not exist")

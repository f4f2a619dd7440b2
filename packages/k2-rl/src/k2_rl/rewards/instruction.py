"""Deterministic instruction-following checkers, their reward, and a reward-hacking check.

A constraint is a dict ``{"type": <checker name>, **params}``; its checker is a pure function
``checker(response, **params) -> bool`` looked up in :data:`CHECKERS`. :func:`instruction_reward`
scores a response against a task's constraints (the fraction satisfied, or all-or-nothing),
and returns 0.0 when :func:`hack_check` finds the response gaming a checker.

Normalisation choices (one place, shared by every checker):

* **Words** are runs of Unicode word characters, with inner apostrophes or hyphens kept
  (``don't`` and ``state-of-the-art`` are one word each); punctuation is not a word.
* **Sentences** end at ``.``, ``!`` or ``?`` (one or more) followed by whitespace or the end
  of the text; a final unterminated fragment counts too, and a fragment without a word
  character (e.g. ``"..."``) does not. Abbreviations such as "e.g." over-count; accepted.
* **Characters** are counted on the response stripped of leading/trailing whitespace.
* **Keyword matching** is case-insensitive on whole words: ``"cat"`` does not match
  ``"category"``; a multi-word keyword matches with any whitespace between its words.
* **Bullets** are lines starting (after indentation) with ``*``, ``-``, ``+`` or ``•``
  followed by a space; horizontal rules (``---``, ``***``) do not count.
* **Paragraphs** are non-empty chunks separated by blank lines (or by a custom
  ``separator`` such as IFEval's ``***``).
* **JSON** may be wrapped in one markdown code fence (models commonly do this).
* **Case**: "all lowercase" means no uppercase letter and at least one cased letter (Python's
  ``str.islower``); likewise uppercase. **No commas** rejects ``,`` and the full-width ``，``.
* **Starts/ends with** ignore leading/trailing whitespace and are case-sensitive.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from k2_rl.rewards.base import BaseReward, register_reward

__all__ = [
    "CHECKERS",
    "HackCheckConfig",
    "InstructionReward",
    "check_constraint",
    "count_paragraphs",
    "count_sentences",
    "hack_check",
    "instruction_reward",
    "words",
]

_WORD = re.compile(r"\w+(?:['’-]\w+)*")
_SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)")
_BULLET = re.compile(r"^[ \t]*[*\-+•][ \t]+\S", re.MULTILINE)
_TITLE = re.compile(r"<<[^<>\n]*\S[^<>\n]*>>")
_FENCE = re.compile(r"^```[a-zA-Z]*\s*\n(.*)\n\s*```$", re.DOTALL)


# --- normalisation helpers -----------------------------------------------------------------


def words(text: str) -> list[str]:
    """The words of ``text`` (see the module docstring), in order, case preserved."""
    return _WORD.findall(text)


def count_sentences(text: str) -> int:
    """Number of sentences in ``text``."""
    return sum(1 for part in _SENTENCE_END.split(text) if re.search(r"\w", part))


def count_paragraphs(text: str, separator: str | None = None) -> int:
    """Number of non-empty paragraphs (blank-line separated, or split on ``separator``)."""
    parts = text.split(separator) if separator else re.split(r"\n[ \t]*\n", text)
    return sum(1 for p in parts if p.strip())


def _keyword_re(keyword: str) -> re.Pattern[str]:
    body = r"\s+".join(re.escape(w) for w in keyword.split())
    return re.compile(rf"(?<!\w){body}(?!\w)", re.IGNORECASE)


def _count_keyword(text: str, keyword: str) -> int:
    return len(_keyword_re(keyword).findall(text))


def _in_range(value: int, min: int | None, max: int | None) -> bool:
    return (min is None or value >= min) and (max is None or value <= max)


def _parse_json(text: str) -> tuple[bool, Any]:
    text = text.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1)
    try:
        return True, json.loads(text)
    except ValueError:
        return False, None


# --- checkers ------------------------------------------------------------------------------


def word_count(response: str, min: int | None = None, max: int | None = None) -> bool:
    return _in_range(len(words(response)), min, max)


def sentence_count(response: str, min: int | None = None, max: int | None = None) -> bool:
    return _in_range(count_sentences(response), min, max)


def char_count(response: str, min: int | None = None, max: int | None = None) -> bool:
    return _in_range(len(response.strip()), min, max)


def keywords(response: str, keywords: Sequence[str]) -> bool:
    """Every keyword occurs at least once."""
    return all(_count_keyword(response, k) > 0 for k in keywords)


def forbidden_words(response: str, words: Sequence[str]) -> bool:
    """None of ``words`` occurs."""
    return not any(_count_keyword(response, w) > 0 for w in words)


def starts_with(response: str, prefix: str) -> bool:
    return response.lstrip().startswith(prefix)


def ends_with(response: str, suffix: str) -> bool:
    return response.rstrip().endswith(suffix)


def bullet_count(response: str, n: int | None = None, min: int | None = None, max: int | None = None) -> bool:
    """Exactly ``n`` bullet points, or a count within [min, max]."""
    count = len(_BULLET.findall(response))
    return count == n if n is not None else _in_range(count, min, max)


def paragraph_count(
    response: str,
    n: int | None = None,
    min: int | None = None,
    max: int | None = None,
    separator: str | None = None,
) -> bool:
    """Exactly ``n`` paragraphs, or a count within [min, max]."""
    count = count_paragraphs(response, separator)
    return count == n if n is not None else _in_range(count, min, max)


def valid_json(response: str, required_keys: Sequence[str] = ()) -> bool:
    """The response is JSON; with ``required_keys``, a JSON object holding all of them."""
    ok, value = _parse_json(response)
    if not ok:
        return False
    if required_keys:
        return isinstance(value, dict) and all(k in value for k in required_keys)
    return True


def lowercase(response: str) -> bool:
    return response.islower()


def uppercase(response: str) -> bool:
    return response.isupper()


def no_commas(response: str) -> bool:
    return "," not in response and "，" not in response


def title(response: str) -> bool:
    """Contains a title wrapped in double angular brackets, e.g. ``<<My Title>>``."""
    return _TITLE.search(response) is not None


def ascii_only(response: str) -> bool:
    """Only ASCII characters (a cheap proxy for "respond in English")."""
    return response.isascii()


CHECKERS: dict[str, Callable[..., bool]] = {
    "word_count": word_count,
    "sentence_count": sentence_count,
    "char_count": char_count,
    "keywords": keywords,
    "forbidden_words": forbidden_words,
    "starts_with": starts_with,
    "ends_with": ends_with,
    "bullet_count": bullet_count,
    "paragraph_count": paragraph_count,
    "json": valid_json,
    "lowercase": lowercase,
    "uppercase": uppercase,
    "no_commas": no_commas,
    "title": title,
    "ascii_only": ascii_only,
}
"""Checker name (a constraint's ``type``) -> ``checker(response, **params) -> bool``."""


def check_constraint(response: str, constraint: dict) -> bool:
    """Run one constraint ``{"type": name, **params}`` against ``response``."""
    if not isinstance(constraint, dict) or "type" not in constraint:
        raise ValueError(f"constraint {constraint!r}: expected a dict with a 'type' field")
    params = {k: v for k, v in constraint.items() if k != "type"}
    kind = constraint["type"]
    checker = CHECKERS.get(kind)
    if checker is None:
        raise ValueError(f"constraint type {kind!r} is unknown; known types: {sorted(CHECKERS)}")
    try:
        return bool(checker(response, **params))
    except TypeError as exc:
        raise ValueError(f"constraint {constraint!r}: bad parameters for {kind!r} ({exc})") from None


# --- hack check ----------------------------------------------------------------------------


@dataclass(frozen=True)
class HackCheckConfig:
    """Thresholds of :func:`hack_check` (conservative: honest answers must not trip them)."""

    keyword_share: float = 0.5
    """Stuffing when required-keyword words are more than this fraction of all words."""
    keyword_repeats: int = 5
    """Stuffing when one keyword occurs at least this often ..."""
    keyword_repeat_share: float = 0.15
    """... and its words are at least this fraction of all words."""
    copy_ngram: int = 5
    """Prompt copying is measured with word n-grams of this size ..."""
    copy_share: float = 0.6
    """... flagged when prompt n-grams cover more than this fraction of the response's words."""
    filler_min_words: int = 20
    """Repetition checks apply from this many words on ..."""
    filler_distinct_trigrams: float = 0.3
    """... padding when distinct word 3-grams / all 3-grams falls below this."""
    filler_char_run: int = 20
    """Padding when one non-space character repeats this many times in a row."""


def _norm_words(text: str) -> list[str]:
    return [w.casefold() for w in words(text)]


def _keyword_stuffing(response: str, constraints: Sequence[dict], cfg: HackCheckConfig) -> str | None:
    required = [k for c in constraints if c.get("type") == "keywords" for k in c.get("keywords", ())]
    n_words = len(words(response))
    if not required or n_words == 0:
        return None
    counts = {k: _count_keyword(response, k) for k in required}
    share = sum(counts[k] * len(k.split()) for k in counts) / n_words
    if share > cfg.keyword_share:
        return f"keyword stuffing: required keywords are {share:.0%} of the response's {n_words} words"
    for k, c in counts.items():
        if c >= cfg.keyword_repeats and c * len(k.split()) / n_words >= cfg.keyword_repeat_share:
            return f"keyword stuffing: {k!r} repeated {c} times in {n_words} words"
    return None


def _prompt_copy(prompt: str, response: str, cfg: HackCheckConfig) -> str | None:
    p, r = _norm_words(prompt), _norm_words(response)
    n = cfg.copy_ngram
    if len(p) < n or len(r) < n:
        if p and r == p:
            return "copies the prompt verbatim"
        return None
    grams = {tuple(p[i : i + n]) for i in range(len(p) - n + 1)}
    covered = [False] * len(r)
    for i in range(len(r) - n + 1):
        if tuple(r[i : i + n]) in grams:
            covered[i : i + n] = [True] * n
    share = sum(covered) / len(r)
    if share > cfg.copy_share:
        return f"copies the prompt: {share:.0%} of the response's words repeat it"
    return None


def _empty_json(response: str, constraints: Sequence[dict]) -> str | None:
    if not any(c.get("type") == "json" for c in constraints):
        return None
    ok, value = _parse_json(response)
    if not ok:
        return None
    if value in ({}, [], "", None):
        return f"empty JSON value {json.dumps(value)}"
    if isinstance(value, dict) and all(v in ({}, [], "", None) for v in value.values()):
        return "JSON object whose values are all empty"
    return None


def _padding(response: str, cfg: HackCheckConfig) -> str | None:
    run = re.search(rf"(\S)\1{{{cfg.filler_char_run - 1},}}", response)
    if run:
        return f"padding: {run.group(1)!r} repeated {len(run.group(0))} times"
    w = _norm_words(response)
    if len(w) >= cfg.filler_min_words:
        trigrams = [tuple(w[i : i + 3]) for i in range(len(w) - 2)]
        distinct = len(set(trigrams)) / len(trigrams)
        if distinct < cfg.filler_distinct_trigrams:
            top = " ".join(Counter(trigrams).most_common(1)[0][0])
            return f"padding: repeated filler ({distinct:.0%} distinct 3-grams; most common {top!r})"
    return None


def hack_check(
    prompt: str, response: str, constraints: Sequence[dict], config: HackCheckConfig | None = None
) -> str | None:
    """Return why ``response`` looks like it games the checkers, or ``None`` if it looks honest.

    Catches: an empty response; keyword stuffing (the required keywords are most of the words,
    or one is repeated many times); a response that mostly copies the prompt; an empty JSON
    value (``{}``, ``[]``, an object of empty values) under a JSON constraint; padding with
    repeated filler (a long run of one character, or few distinct word 3-grams).
    """
    cfg = config or HackCheckConfig()
    if not response.strip():
        return "empty response"
    return (
        _keyword_stuffing(response, constraints, cfg)
        or _prompt_copy(prompt, response, cfg)
        or _empty_json(response, constraints)
        or _padding(response, cfg)
    )


# --- reward --------------------------------------------------------------------------------


def instruction_reward(
    response: str,
    constraints: Sequence[dict],
    *,
    prompt: str = "",
    all_or_nothing: bool = False,
    check_hacks: bool = True,
    hack_reward: float = 0.0,
    hack_config: HackCheckConfig | None = None,
) -> float:
    """Fraction of ``constraints`` satisfied (or 1.0/0.0 with ``all_or_nothing``).

    With ``check_hacks`` (default), a response that :func:`hack_check` flags scores
    ``hack_reward`` (0.0) whatever the checkers say. ``prompt`` feeds the prompt-copy check.
    """
    if not constraints:
        raise ValueError("instruction_reward: constraints is empty (expected at least one constraint dict)")
    results = [check_constraint(response, c) for c in constraints]
    if check_hacks and hack_check(prompt, response, constraints, hack_config) is not None:
        return float(hack_reward)
    if all_or_nothing:
        return 1.0 if all(results) else 0.0
    return sum(results) / len(results)


@register_reward("instruction")
class InstructionReward(BaseReward):
    """Registry adapter: ``task["constraints"]`` is the constraint list."""

    task_fields = ("constraints",)

    name = "instruction"

    def __init__(
        self, all_or_nothing: bool = False, check_hacks: bool = True, hack_reward: float = 0.0
    ) -> None:
        self.all_or_nothing = all_or_nothing
        self.check_hacks = check_hacks
        self.hack_reward = hack_reward

    def __call__(self, prompt: str, response: str, task: dict) -> float:
        if "constraints" not in task:
            raise ValueError(
                f"reward 'instruction': task needs a 'constraints' list, got keys {sorted(task)}"
            )
        return instruction_reward(
            response,
            task["constraints"],
            prompt=prompt,
            all_or_nothing=task.get("all_or_nothing", self.all_or_nothing),
            check_hacks=self.check_hacks,
            hack_reward=self.hack_reward,
        )

"""Instruction-following checkers, instruction_reward and hack_check on hand-written examples."""

from __future__ import annotations

import pytest
from k2_rl.rewards.base import get_reward
from k2_rl.rewards.instruction import (
    CHECKERS,
    HackCheckConfig,
    check_constraint,
    count_paragraphs,
    count_sentences,
    hack_check,
    instruction_reward,
    words,
)

ESSAY = (
    "Rivers shape the land they cross. Over centuries, water carves valleys and deposits fertile soil.\n\n"
    "Cities grew beside rivers because they offered water, food and trade routes. Today we still rely on them."
)


def test_normalisation_helpers() -> None:
    assert words("Don't stop: state-of-the-art, 3.5 ok!") == [
        "Don't",
        "stop",
        "state-of-the-art",
        "3",
        "5",
        "ok",
    ]
    assert count_sentences("One. Two! Three?! Pi is 3.14 here") == 4
    assert count_sentences("...") == 0
    assert count_paragraphs("a\n\nb\n   \nc") == 3
    assert count_paragraphs("a *** b ***", separator="***") == 2


CASES = [
    # (constraint, positive example, negative example)
    ({"type": "word_count", "min": 3, "max": 5}, "one two three four", "one two"),
    ({"type": "word_count", "max": 3}, "it's state-of-the-art, truly", "this has four words"),
    ({"type": "sentence_count", "min": 2}, "First. Second!", "Only one sentence here."),
    ({"type": "sentence_count", "max": 1}, "Pi is 3.14 roughly.", "One. Two."),
    ({"type": "char_count", "max": 5}, "  hello  ", "hello!"),
    ({"type": "char_count", "min": 10}, "ten chars!", "nine char"),
    (
        {"type": "keywords", "keywords": ["river", "Delta plain"]},
        "The RIVER feeds the delta\nplain.",
        "Rivers feed the delta plain.",
    ),
    ({"type": "forbidden_words", "words": ["cat"]}, "A category of dogs.", "The Cat sat."),
    ({"type": "starts_with", "prefix": "Dear Sir"}, "  Dear Sir, hello", "dear sir, hello"),
    (
        {"type": "ends_with", "suffix": "Any questions?"},
        "That's all. Any questions?\n",
        "Any questions? Thanks.",
    ),
    ({"type": "bullet_count", "n": 3}, "Intro\n* a\n- b\n  + c\n", "* a\n* b\n---\n***\n**bold**"),
    ({"type": "bullet_count", "min": 1, "max": 2}, "• one\n• two", "no bullets"),
    ({"type": "paragraph_count", "n": 2}, "Para one.\n\nPara two.", "Para one.\nStill one."),
    ({"type": "paragraph_count", "n": 3, "separator": "***"}, "a\n***\nb\n***\nc", "a\n\nb\n\nc"),
    ({"type": "json"}, '{"a": 1}', "{'a': 1}"),
    (
        {"type": "json", "required_keys": ["name", "age"]},
        '```json\n{"name": "Ann", "age": 3}\n```',
        '{"name": "Ann"}',
    ),
    ({"type": "json", "required_keys": ["a"]}, '{"a": null}', '[{"a": 1}]'),
    ({"type": "lowercase"}, "all lower, 123 ok", "Not lower"),
    ({"type": "lowercase"}, "x", "123"),
    ({"type": "uppercase"}, "LOUD NOISES 42", "LOUD noises"),
    ({"type": "no_commas"}, "No commas here.", "One, two"),
    ({"type": "no_commas"}, "Fine.", "Full-width，comma"),
    ({"type": "title"}, "<<Poem of Joy>>\nLine one", "<< >> no title or <<>>"),
    ({"type": "ascii_only"}, "Plain English text.", "Café au lait"),
]


@pytest.mark.parametrize(("constraint", "positive", "negative"), CASES, ids=[c[0]["type"] for c in CASES])
def test_checker_positive_and_negative(constraint: dict, positive: str, negative: str) -> None:
    assert check_constraint(positive, constraint) is True
    assert check_constraint(negative, constraint) is False


def test_every_checker_is_covered() -> None:
    assert {c[0]["type"] for c in CASES} == set(CHECKERS)


def test_bad_constraints_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="'shout' is unknown"):
        check_constraint("x", {"type": "shout"})
    with pytest.raises(ValueError, match="bad parameters for 'word_count'"):
        check_constraint("x", {"type": "word_count", "maximum": 3})
    with pytest.raises(ValueError, match="'type' field"):
        check_constraint("x", {"max": 3})
    with pytest.raises(ValueError, match="constraints is empty"):
        instruction_reward("x", [])


CONSTRAINTS = [
    {"type": "keywords", "keywords": ["river"]},
    {"type": "word_count", "max": 50},
    {"type": "no_commas"},
    {"type": "paragraph_count", "n": 2},
]


def test_instruction_reward_fraction_and_all_or_nothing() -> None:
    # ESSAY: has "rivers" but not "river" (whole words), 33 words, commas, 2 paragraphs.
    assert len(words(ESSAY)) == 33
    assert instruction_reward(ESSAY, CONSTRAINTS) == 0.5
    assert instruction_reward(ESSAY, CONSTRAINTS, all_or_nothing=True) == 0.0
    honest = ESSAY.replace("Rivers shape", "A river shapes").replace(",", "")
    assert instruction_reward(honest, CONSTRAINTS) == 1.0
    assert instruction_reward(honest, CONSTRAINTS, all_or_nothing=True) == 1.0
    assert instruction_reward(honest, CONSTRAINTS[:3] + [{"type": "lowercase"}]) == 0.75


def test_registry_adapter() -> None:
    reward = get_reward("instruction")
    assert reward.name == "instruction"
    task = {"constraints": [{"type": "word_count", "max": 3}, {"type": "no_commas"}]}
    assert reward("Say hi.", "Hi, friend", task) == 0.5
    assert reward("Say hi.", "Hi, friend", {**task, "all_or_nothing": True}) == 0.0
    with pytest.raises(ValueError, match="'constraints'"):
        reward("p", "r", {})


HACKS = [
    # (prompt, response, constraints, expected reason prefix)
    ("Write about rivers.", "   ", [{"type": "no_commas"}], "empty response"),
    (
        "Write a story that mentions a dragon and a castle.",
        "dragon castle dragon castle story",
        [{"type": "keywords", "keywords": ["dragon", "castle"]}],
        "keyword stuffing: required keywords are 80%",
    ),
    (
        "Write a story that mentions a dragon.",
        "Once there was a dragon. Dragon dragon dragon dragon. The dragon slept. The end of it all.",
        [{"type": "keywords", "keywords": ["dragon"]}],
        "keyword stuffing: 'dragon' repeated 6 times",
    ),
    (
        "Describe the water cycle in three short paragraphs without using any commas.",
        "Describe the water cycle in three short paragraphs without using any commas.",
        [{"type": "no_commas"}],
        "copies the prompt",
    ),
    (
        "Explain photosynthesis in at least twenty words for a young student please.",
        "Sure. Explain photosynthesis in at least twenty words for a young student please.",
        [{"type": "word_count", "min": 10}],
        "copies the prompt: 92%",
    ),
    ("Return a JSON object describing a cat.", "{}", [{"type": "json"}], "empty JSON value {}"),
    ("Return a JSON list of fruits.", "```json\n[]\n```", [{"type": "json"}], "empty JSON value []"),
    (
        "Return JSON with name and age.",
        '{"name": "", "age": null}',
        [{"type": "json", "required_keys": ["name", "age"]}],
        "JSON object whose values are all empty",
    ),
    (
        "Write at least 100 words about the sea.",
        "The sea is big. " + "The sea is big. " * 30,
        [{"type": "word_count", "min": 100}],
        "padding: repeated filler",
    ),
    (
        "Write at least 300 characters about the sea.",
        "The sea is blue and deep." + "." * 300,
        [{"type": "char_count", "min": 300}],
        "padding: '.' repeated 301 times",
    ),
]


@pytest.mark.parametrize(("prompt", "response", "constraints", "reason"), HACKS)
def test_hack_patterns_caught(prompt: str, response: str, constraints: list[dict], reason: str) -> None:
    found = hack_check(prompt, response, constraints)
    assert found is not None and found.startswith(reason), found
    assert instruction_reward(response, constraints, prompt=prompt) == 0.0
    assert instruction_reward(response, constraints, prompt=prompt, hack_reward=-1.0) == -1.0


def test_hack_check_can_be_disabled() -> None:
    prompt, response, constraints, _ = HACKS[1]
    assert instruction_reward(response, constraints, prompt=prompt, check_hacks=False) == 1.0
    # a looser threshold accepts it too
    assert hack_check(prompt, response, constraints, HackCheckConfig(keyword_share=0.9)) is None


HONEST = [
    ("Write about rivers without commas.", ESSAY.replace(",", ""), [{"type": "no_commas"}]),
    (
        "Write a story that mentions a dragon and a castle.",
        (
            "Long ago a young dragon lived beneath an old castle on the hill. Each night she counted the stars "
            "and each morning she guarded the gate. When the king fell ill the dragon flew across the mountains "
            "to find a healer and the castle celebrated her return."
        ),
        [{"type": "keywords", "keywords": ["dragon", "castle"]}, {"type": "word_count", "min": 30}],
    ),
    (
        "Return a JSON object with keys name and age for a person called Ann aged 30.",
        '{"name": "Ann", "age": 30}',
        [{"type": "json", "required_keys": ["name", "age"]}],
    ),
    (
        "Summarise the water cycle in two paragraphs.",
        (
            "Water evaporates from oceans and lakes when the sun heats it. The vapour rises and cools into clouds.\n\n"
            "When droplets grow heavy they fall as rain or snow. The water cycle then starts again."
        ),
        [{"type": "paragraph_count", "n": 2}, {"type": "keywords", "keywords": ["water cycle"]}],
    ),
    (
        "List three fruits as bullets.",
        "* apple\n* banana\n* cherry\n\n---",
        [{"type": "bullet_count", "n": 3}],
    ),
]


@pytest.mark.parametrize(("prompt", "response", "constraints"), HONEST)
def test_honest_responses_not_flagged(prompt: str, response: str, constraints: list[dict]) -> None:
    assert hack_check(prompt, response, constraints) is None
    assert instruction_reward(response, constraints, prompt=prompt) == 1.0

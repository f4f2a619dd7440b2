"""A generated tool-use SFT set small enough for a tiny model to learn on a CPU.

Four tools in OpenAI format (JSON-Schema parameters): `calculator(expression)`,
`convert_units(value, from_unit, to_unit)`, `get_weather(city)` and `get_time(city)`. Every argument is
copied from the user's message: the expression and numbers literally, the cities literally, and unit words
through a fixed table where each word names one unit ("miles" -> "mi", "kilograms" -> "kg"). About 20% of
the prompts need no tool (greetings, questions about the assistant, chit-chat) and get a plain answer.

A training record is `{"messages": [system, user, assistant(tool call), tool(result), assistant(answer)],
"tools": TOOLS}` (no-tool: `[system, user, assistant]`). Results are computed: the arithmetic evaluated,
units converted with the exact factors, and weather and time faked deterministically from a hash of the
city. Call arguments are a canonical JSON string: compact separators, keys in the schema's order.

A held-out record is the prompt only (`[system, user]`) plus `"reference": {"name", "arguments"}` (null for
no-tool prompts). Held-out prompts use the same templates with argument values that no training call has:
each (expression), (value, from, to), weather city, time city and no-tool (greeting, question) pair is
assigned to train or held-out by a fixed hash; a held-out weather city is never a weather argument in train
(it is a time argument there, so its tokens are not new), and likewise for time. No user message occurs in
both files. Same seed, byte-identical files.
"""

from __future__ import annotations

import ast
import hashlib
import json
import operator
import os
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

SYSTEM_PROMPT = "You are a helpful assistant. Use a tool when one is needed."

TOOLS: list[dict] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic (+ - * /).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "convert_units",
            "description": "Convert a value between units.",
            "parameters": {
                "type": "object",
                "properties": {
                    "value": {"type": "number"},
                    "from_unit": {
                        "type": "string",
                        "enum": ["km", "mi", "m", "ft", "kg", "lb", "c", "f", "l", "gal"],
                    },
                    "to_unit": {
                        "type": "string",
                        "enum": ["km", "mi", "m", "ft", "kg", "lb", "c", "f", "l", "gal"],
                    },
                },
                "required": ["value", "from_unit", "to_unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current local time in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
]

CALC_TEMPLATES = [
    "What is {x}?",
    "Calculate {x}.",
    "Compute {x} for me.",
    "How much is {x}?",
    "Can you work out {x}?",
    "Please evaluate {x}.",
    "what's {x}",
    "I need the result of {x}.",
    "Solve {x}.",
    "Quick math: {x} = ?",
    "Tell me what {x} equals.",
    "Use the calculator on {x}.",
]
CONVERT_TEMPLATES = [
    "Convert {v} {a} to {b}.",
    "How many {b} is {v} {a}?",
    "What is {v} {a} in {b}?",
    "{v} {a} to {b}, please.",
    "Please convert {v} {a} into {b}.",
    "I have {v} {a}. How much is that in {b}?",
    "Can you change {v} {a} to {b}?",
    "How much is {v} {a} in {b}?",
    "Express {v} {a} in {b}.",
    "convert {v} {a} -> {b}",
    "What's {v} {a} in {b}?",
    "Turn {v} {a} into {b} for me.",
]
WEATHER_TEMPLATES = [
    "What's the weather in {city}?",
    "How is the weather in {city} today?",
    "Is it raining in {city}?",
    "Weather for {city}, please.",
    "Tell me the current weather in {city}.",
    "What is it like outside in {city}?",
    "Do I need an umbrella in {city}?",
    "Check the weather in {city}.",
    "How warm is it in {city}?",
    "Give me the weather report for {city}.",
    "{city} weather?",
    "What's the temperature in {city} right now?",
]
TIME_TEMPLATES = [
    "What time is it in {city}?",
    "Tell me the current time in {city}.",
    "What's the local time in {city}?",
    "Do you know the time in {city}?",
    "Time in {city}?",
    "Check the clock in {city} for me.",
    "What is the time right now in {city}?",
    "Could you get the time in {city}?",
    "I need the local time for {city}.",
    "Is it late in {city}? What time is it there?",
    "How late is it in {city}?",
    "Current time in {city}, please.",
]
GREETINGS = ["", "Hi! ", "Hello! ", "Hey, ", "Good morning! ", "Good evening. "]
CHAT = [
    (
        "Who are you?",
        "I am a small assistant that can use tools: a calculator, unit conversion, weather and time.",
    ),
    (
        "What can you do?",
        "I can do arithmetic, convert units, and look up the weather and the time in a city.",
    ),
    ("How are you?", "I'm doing well, thank you! How can I help you today?"),
    ("Thank you!", "You're welcome! Let me know if you need anything else."),
    ("Tell me a joke.", "Why did the scarecrow win an award? Because he was outstanding in his field."),
    ("What is your name?", "I'm a tool-using assistant. You can call me Kimi."),
    ("Goodbye!", "Goodbye! Have a great day."),
    (
        "Can you help me?",
        "Of course! Ask me to calculate something, convert units, or check the weather or time.",
    ),
    ("Nice to meet you.", "Nice to meet you too! What can I do for you?"),
    ("Are you a robot?", "I'm an AI assistant: a language model that can call a few tools."),
    ("Do you like music?", "I don't listen to music myself, but I'm happy to talk about it."),
    ("Say something nice.", "You are doing great today, keep it up!"),
    ("Who made you?", "I was trained as a small example model for tool use."),
    ("Tell me a fun fact.", "Octopuses have three hearts."),
]
CITIES = [
    "Paris",
    "London",
    "Tokyo",
    "Berlin",
    "Madrid",
    "Rome",
    "Oslo",
    "Lisbon",
    "Vienna",
    "Prague",
    "Dublin",
    "Athens",
    "Cairo",
    "Nairobi",
    "Lagos",
    "Delhi",
    "Mumbai",
    "Beijing",
    "Shanghai",
    "Seoul",
    "Bangkok",
    "Jakarta",
    "Manila",
    "Sydney",
    "Melbourne",
    "Auckland",
    "Toronto",
    "Chicago",
    "Boston",
    "Denver",
    "Seattle",
    "Miami",
    "Houston",
    "Lima",
    "Bogota",
    "Santiago",
    "Quito",
    "Havana",
    "Helsinki",
    "Warsaw",
    "Budapest",
    "Zurich",
    "Geneva",
    "Munich",
    "Hamburg",
    "Milan",
    "Naples",
    "Venice",
    "Porto",
    "Seville",
    "New York",
    "Los Angeles",
    "San Francisco",
    "Mexico City",
    "Buenos Aires",
    "Cape Town",
    "Hong Kong",
    "Kuala Lumpur",
    "Tel Aviv",
    "Rio de Janeiro",
]
# unit code -> the words a prompt may use for it (each word names exactly one unit)
UNIT_WORDS = {
    "km": ["km", "kilometers"],
    "mi": ["miles", "mi"],
    "m": ["meters"],
    "ft": ["feet", "ft"],
    "kg": ["kg", "kilograms"],
    "lb": ["pounds", "lb"],
    "c": ["Celsius", "degrees Celsius"],
    "f": ["Fahrenheit", "degrees Fahrenheit"],
    "l": ["liters"],
    "gal": ["gallons"],
}
CONVERSIONS: dict[tuple[str, str], Callable[[float], float]] = {
    ("km", "mi"): lambda v: v / 1.609344,
    ("mi", "km"): lambda v: v * 1.609344,
    ("m", "ft"): lambda v: v / 0.3048,
    ("ft", "m"): lambda v: v * 0.3048,
    ("kg", "lb"): lambda v: v / 0.45359237,
    ("lb", "kg"): lambda v: v * 0.45359237,
    ("c", "f"): lambda v: v * 9 / 5 + 32,
    ("f", "c"): lambda v: (v - 32) * 5 / 9,
    ("l", "gal"): lambda v: v / 3.785411784,
    ("gal", "l"): lambda v: v * 3.785411784,
}
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "foggy", "partly cloudy"]
HELDOUT_EVERY = 8  # about 1 in 8 argument values (and chit-chat pairs) is reserved for held-out prompts


def _hash(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(json.dumps(parts).encode()).digest()[:8], "big")


def _is_heldout(*parts: Any) -> bool:
    return _hash("split", *parts) % HELDOUT_EVERY == 0


def canonical_arguments(arguments: dict) -> str:
    """The arguments string of a call: compact JSON, keys in the order given (the schema's)."""
    return json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)


def fmt_number(x: float) -> str:
    """At most two decimals, no trailing zeros: 3.0 -> '3', 0.125 -> '0.12', -0.001 -> '0'."""
    s = f"{round(x, 2):.2f}".rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expression: str) -> float:
    """Evaluate + - * / on numbers (Python precedence); anything else is a ValueError."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        raise ValueError(f"not an arithmetic expression: {expression!r}")

    return ev(ast.parse(expression, mode="eval").body)


def weather(city: str) -> dict:
    h = _hash("weather", city)
    return {"city": city, "condition": CONDITIONS[h % len(CONDITIONS)], "temperature_c": (h >> 16) % 36 - 5}


def local_time(city: str) -> dict:
    h = _hash("time", city)
    return {"city": city, "time": f"{h % 24:02d}:{(h >> 16) % 60:02d}"}


# ----------------------------------------------------------------------------- one example per kind
# each returns (user message, call {"name", "arguments"} or None, tool result text, final answer)


def _calc(rng: random.Random, heldout: bool) -> tuple:
    while True:
        if rng.random() < 0.2:
            a, b, c = (rng.randint(1, 99) for _ in range(3))
            op1, op2 = rng.choice("+-*"), rng.choice("+-*")
            expr = f"{a} {op1} {b} {op2} {c}"
        else:
            op = rng.choice("+-*/")
            if op == "/":
                b = rng.randint(2, 20)
                a = b * rng.randint(1, 99)
            else:
                a, b = rng.randint(1, rng.choice([9, 99, 999])), rng.randint(1, rng.choice([9, 99, 999]))
            expr = f"{a} {op} {b}"
        if _is_heldout("calculator", expr) == heldout:
            break
    result = fmt_number(evaluate(expr))
    answer = rng.choice([f"{expr} = {result}.", f"The result is {result}.", f"{expr} equals {result}."])
    return (
        rng.choice(CALC_TEMPLATES).format(x=expr),
        {"name": "calculator", "arguments": {"expression": expr}},
        json.dumps({"result": json.loads(result)}),
        answer,
    )


def _convert(rng: random.Random, heldout: bool) -> tuple:
    while True:
        src, dst = rng.choice(sorted(CONVERSIONS))
        if src == "c":  # temperatures people ask about
            value: int | float = rng.randint(-30, 45)
        elif src == "f":
            value = rng.randint(-20, 115)
        else:
            value = rng.randint(1, 500) if rng.random() < 0.75 else rng.randint(1, 999) / 10
        if _is_heldout("convert_units", value, src, dst) == heldout:
            break
    a, b = rng.choice(UNIT_WORDS[src]), rng.choice(UNIT_WORDS[dst])
    v = json.dumps(value)
    result = fmt_number(CONVERSIONS[src, dst](value))
    call = {"name": "convert_units", "arguments": {"value": value, "from_unit": src, "to_unit": dst}}
    answer = f"{v} {a} is about {result} {b}."
    return (
        rng.choice(CONVERT_TEMPLATES).format(v=v, a=a, b=b),
        call,
        json.dumps({"value": json.loads(result), "unit": dst}),
        answer,
    )


def _city(rng: random.Random, tool: str, heldout: bool) -> str:
    # city i is held out for weather when i % 5 == 0 and for time when i % 5 == 1
    group = 0 if tool == "get_weather" else 1
    pool = [c for i, c in enumerate(CITIES) if (i % 5 == group) == heldout]
    return rng.choice(pool)


def _weather(rng: random.Random, heldout: bool) -> tuple:
    city = _city(rng, "get_weather", heldout)
    w = weather(city)
    answer = f"It is {w['condition']} and {w['temperature_c']} degrees Celsius in {city}."
    return (
        rng.choice(WEATHER_TEMPLATES).format(city=city),
        {"name": "get_weather", "arguments": {"city": city}},
        json.dumps(w),
        answer,
    )


def _time(rng: random.Random, heldout: bool) -> tuple:
    city = _city(rng, "get_time", heldout)
    t = local_time(city)
    return (
        rng.choice(TIME_TEMPLATES).format(city=city),
        {"name": "get_time", "arguments": {"city": city}},
        json.dumps(t),
        f"It is {t['time']} in {city} right now.",
    )


def _chat(rng: random.Random, heldout: bool) -> tuple:
    while True:
        greeting, (question, reply) = rng.choice(GREETINGS), rng.choice(CHAT)
        if _is_heldout("chat", greeting, question) == heldout:
            return greeting + question, None, None, reply


KINDS = [("calculator", _calc), ("convert_units", _convert), ("get_weather", _weather), ("get_time", _time)]
NO_TOOL_FRACTION = 0.2


def _example(rng: random.Random, heldout: bool) -> tuple:
    if rng.random() < NO_TOOL_FRACTION:
        return _chat(rng, heldout)
    return rng.choice(KINDS)[1](rng, heldout)


def _train_record(user: str, call: dict | None, result: str | None, answer: str) -> dict:
    messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
    if call is not None:
        call_id = f"functions.{call['name']}:0"
        messages += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": call["name"],
                            "arguments": canonical_arguments(call["arguments"]),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "name": call["name"], "content": result},
        ]
    messages.append({"role": "assistant", "content": answer})
    return {"messages": messages, "tools": TOOLS}


def _heldout_record(user: str, call: dict | None) -> dict:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
    return {"messages": messages, "tools": TOOLS, "reference": call}


def generate_tooluse(n_train: int, n_heldout: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train records, held-out records); see the module docstring."""
    if n_train < 0 or n_heldout < 0:
        raise ValueError(f"n_train and n_heldout must be >= 0, got {n_train} and {n_heldout}")
    rng = random.Random(f"k2-tooluse-heldout-{seed}")
    heldout = []
    for _ in range(n_heldout):
        user, call, _, _ = _example(rng, heldout=True)
        heldout.append(_heldout_record(user, call))
    heldout_users = {r["messages"][1]["content"] for r in heldout}
    rng = random.Random(f"k2-tooluse-train-{seed}")
    train = []
    while len(train) < n_train:
        user, call, result, answer = _example(rng, heldout=False)
        if user not in heldout_users:  # disjoint by construction; this only guards the guarantee
            train.append(_train_record(user, call, result, answer))
    return train, heldout


def _write_jsonl(path: Path, records: list[dict]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_tooluse_dataset(
    out_dir: str | Path, n_train: int = 2000, n_heldout: int = 200, seed: int = 0
) -> dict:
    """Write `train.jsonl` and `heldout.jsonl` (each atomically) into `out_dir`; returns the counts:
    `{"train", "heldout", "train_no_tool", "heldout_no_tool", "train_by_tool": {name: n}, "heldout_by_tool"}`."""
    train, heldout = generate_tooluse(n_train, n_heldout, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "train.jsonl", train)
    _write_jsonl(out / "heldout.jsonl", heldout)

    def by_tool(names: list[str | None]) -> dict:
        return {name: names.count(name) for name, _ in KINDS}

    train_names = [
        r["messages"][2]["tool_calls"][0]["function"]["name"] if len(r["messages"]) == 5 else None
        for r in train
    ]
    heldout_names = [r["reference"]["name"] if r["reference"] else None for r in heldout]
    return {
        "train": len(train),
        "heldout": len(heldout),
        "train_no_tool": train_names.count(None),
        "heldout_no_tool": heldout_names.count(None),
        "train_by_tool": by_tool(train_names),
        "heldout_by_tool": by_tool(heldout_names),
    }


__all__ = [
    "TOOLS",
    "canonical_arguments",
    "evaluate",
    "generate_tooluse",
    "local_time",
    "score_tool_call",
    "weather",
    "write_tooluse_dataset",
]


def score_tool_call(reference: dict | None, message: dict) -> bool:
    """Whether an assistant `message` (OpenAI shape) answers a held-out prompt correctly: for a
    tool prompt exactly one call, with the reference's name and arguments that parse to the
    reference's (JSON equality, so key order and 12 vs 12.0 do not matter); for a no-tool prompt
    no call at all."""
    calls = message.get("tool_calls") or []
    if reference is None:
        return not calls
    if len(calls) != 1:
        return False
    fn = calls[0].get("function") or {}
    try:
        arguments = json.loads(fn.get("arguments") or "")
    except (TypeError, ValueError):
        return False
    return fn.get("name") == reference["name"] and arguments == reference["arguments"]

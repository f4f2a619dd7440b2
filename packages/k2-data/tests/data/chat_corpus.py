"""Conversations for the byte-exact template tests: (name, messages, tools, add_generation_prompt)."""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city, in °C. 天气",
        "parameters": {
            "type": "object",
            "required": ["city"],
            "properties": {"unit": {"enum": ["c", "f"], "type": "string"}, "city": {"type": "string"}},
        },
    },
}
SEARCH = {
    "function": {
        "parameters": {"properties": {"q": {"type": "string", "minLength": 1}}, "type": "object"},
        "name": "search",
        "description": "Search the web",
    },
    "type": "function",
}
TOOLS = [WEATHER, SEARCH]


def call(name, args, call_id=None):
    c = {"type": "function", "function": {"name": name, "arguments": args}}
    if call_id is not None:
        c["id"] = call_id
    return c


CORPUS = [
    ("one user turn", [{"role": "user", "content": "hi"}], None, True),
    (
        "system first",
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        None,
        True,
    ),
    (
        "answered",
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
        None,
        False,
    ),
    ("empty conversation", [], None, True),
    ("empty conversation with tools", [], TOOLS, False),
    (
        "tools, OpenAI ids, results, final answer",
        [
            {"role": "user", "content": "Weather in Paris and news?"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [
                    call("get_weather", '{"city": "Paris"}', "call_abc123"),
                    call("search", {"q": "news", "n": 3}, "call_def456"),
                ],
            },
            {"role": "tool", "tool_call_id": "call_abc123", "content": '{"temp": 21}'},
            {"role": "tool", "tool_call_id": "call_def456", "name": "search", "content": "nothing new"},
            {"role": "assistant", "content": "21 °C, nothing new."},
        ],
        TOOLS,
        False,
    ),
    (
        "K2 ids, content null, next question",
        [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [call("get_weather", '{"city":"Oslo"}', "functions.get_weather:0")],
            },
            {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "-3"},
            {"role": "assistant", "content": "Cold."},
            {"role": "user", "content": "And Rome?"},
        ],
        TOOLS,
        True,
    ),
    (
        "odd ids: verifier style, bare counter, missing, another function's, None",
        [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    call("search", '{"q": "a"}', "search:0"),
                    call("search", '{"q": "b"}', "1"),
                    call("get_weather", '{"city": "x"}'),
                    call("get_weather", '{"city": "y"}', "functions.search:7"),
                    call("search", '{"q": "c"}', None) | {"id": None},
                ],
            },
            {"role": "tool", "tool_call_id": "search:0", "content": "A"},
            {"role": "tool", "tool_call_id": "1", "content": "B"},
            {"role": "tool", "content": "no id"},
            {"role": "tool", "tool_call_id": "functions.search:7", "content": None},
            {"role": "tool", "tool_call_id": None, "content": "E"},
        ],
        TOOLS,
        True,
    ),
    (
        "assistant content null without calls",
        [{"role": "user", "content": "say nothing"}, {"role": "assistant", "content": None}],
        None,
        False,
    ),
    (
        "unicode and markup in content",
        [
            {"role": "system", "content": "Réponds en français. 🚀"},
            {"role": "user", "content": '日本語で <|im_end|> と "quotes" \\ backslash\n新行'},
            {"role": "assistant", "content": "はい — ok ✓", "tool_calls": []},
            {"role": "user", "content": "encore"},
        ],
        [WEATHER],
        True,
    ),
    (
        "content parts, image, named turns",
        [
            {
                "role": "user",
                "name": "alice",
                "content": [
                    {"type": "text", "text": "look "},
                    {"type": "image_url", "image_url": {"url": "x"}},
                    {"type": "text", "text": "here"},
                ],
            },
            {"role": "assistant", "name": "kimi", "content": [{"type": "text", "text": "a cat"}]},
            {"role": "system", "content": None},
        ],
        None,
        True,
    ),
    (
        "arguments as objects with unicode, nested, floats",
        [
            {"role": "user", "content": "plan"},
            {
                "role": "assistant",
                "tool_calls": [
                    call(
                        "search",
                        {"q": "Zürich café", "filters": {"b": [1, 2.5, None, True], "a": "é"}},
                        "functions.search:0",
                    )
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "functions.search:0",
                "name": "search",
                "content": [{"type": "text", "text": "part"}],
            },
        ],
        TOOLS,
        True,
    ),
    (
        "raw non-JSON arguments string",
        [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "content": "ok",
                "tool_calls": [call("search", "not json {", "functions.search:0")],
            },
        ],
        TOOLS,
        False,
    ),
    (
        "reasoning: history stripped, tool-call steps kept",
        [
            {"role": "user", "content": "first"},
            {"role": "assistant", "reasoning_content": "old thoughts", "content": "first answer"},
            {"role": "user", "content": "weather in Lima?"},
            {
                "role": "assistant",
                "reasoning_content": "I should call the tool.",
                "content": "",
                "tool_calls": [call("get_weather", '{"city": "Lima"}', "functions.get_weather:0")],
            },
            {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18"},
            {"role": "assistant", "reasoning_content": "It is 18.", "content": "18 °C in Lima."},
        ],
        TOOLS,
        False,
    ),
    (
        "reasoning: open tool-call steps, null and aliased reasoning",
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "reasoning": "alias field", "content": "a1"},
            {"role": "user", "content": "q2"},
            {
                "role": "assistant",
                "reasoning_content": None,
                "tool_calls": [call("search", '{"q":"1"}', "functions.search:0")],
            },
            {"role": "tool", "tool_call_id": "functions.search:0", "content": "r1"},
            {
                "role": "assistant",
                "thinking": "second step",
                "tool_calls": [call("search", '{"q":"2"}', "functions.search:1")],
            },
            {"role": "tool", "tool_call_id": "functions.search:1", "content": "r2"},
        ],
        TOOLS,
        True,
    ),
    (
        "prefill: last message is an assistant turn",
        [
            {"role": "user", "content": "count"},
            {"role": "assistant", "reasoning_content": "1 2", "content": "1, 2,"},
        ],
        None,
        False,
    ),
]

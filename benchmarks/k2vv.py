"""Conformance of `k2 serve` in the manner of Moonshot's K2-Vendor-Verifier (K2VV) tool-call check.

    .venv/bin/python benchmarks/k2vv.py [--samples samples.jsonl] [--synthetic 60] [--limit N]
        [--time-budget 300] [--preset tiny | --model DIR | --url URL] [--max-tokens 48]

Requests: K2VV's `samples.jsonl` when given (one OpenAI chat request per line, its `_input` role read
as `system`, as the verifier does; the file is the download linked from the verifier's README), else
`--synthetic N` requests built here from a fixed seed: tools with enums, bounds, nesting, no parameters,
`strict: true`, a `required` name the schema does not declare (valid JSON Schema); `tool_choice`
auto / required / named / none; histories with OpenAI-style ids and tool results, `_input` turns,
`content: null`, unicode; `chat_template_kwargs: {"thinking": false}`; and malformed requests that must
get a 400 naming the field (a tool result answering no call, an unknown named function). Each request
is sent twice, `stream: false` and `stream: true`, with the same seed (temperature 1), against `k2 serve` on a
loopback port in this process (or a running server, `--url`: start it with `--chat-template` or
`--max-model-len` as you need), until `--time-budget` seconds are spent.

Reported: requests answered with a well-formed 200 (choices, message, finish_reason, call shapes) or a
400 whose `error.param` names the field; calls emitted and how many validate against their tool's
schema (`jsonschema`, as the verifier checks); replies with tool-call or turn markup in `content`
(either mode); streams whose merged deltas differ from the non-streamed reply; replies cut by
`max_tokens` (`finish_reason: "length"`, a cut call returned as no call). A random-weights preset
says nothing about call quality, and guided decoding makes forced calls schema-valid by construction:
these numbers are conformance of the server, not comparable with the vendors' published scores.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema
from bench_common import machine

MARKUP = (
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|im_end|>",
    "<|im_assistant|>",
)


def _fn(name: str, params: dict | None, strict: bool = False, desc: str = "") -> dict:
    f: dict[str, Any] = {"name": name, "description": desc or f"The {name} tool"}
    if params is not None:
        f["parameters"] = params
    if strict:
        f["strict"] = True
    return {"type": "function", "function": f}


TOOL_POOL = [
    _fn(
        "get_weather",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Lima", "東京"]},
                "metric": {"type": "boolean"},
            },
            "required": ["city"],
        },
        desc="Weather for a city, °C",
    ),
    _fn(
        "search",
        {"type": "object", "properties": {"q": {"type": "string", "maxLength": 12}}, "required": ["q"]},
    ),
    _fn(
        "add",
        {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
        strict=True,
    ),
    _fn(
        "book",
        {
            "type": "object",
            "properties": {
                "guests": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                "when": {"type": "object", "properties": {"day": {"type": "integer"}}, "required": ["day"]},
            },
            "required": ["when"],
        },
    ),
    _fn("now", None),  # no parameters
    # valid JSON Schema whose `required` names a property it does not declare: fine unless strict
    _fn("lookup", {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id", "scope"]}),
]

QUESTIONS = [
    "What's the weather in Paris?",
    "2 + 40?",
    "Find news on Zürich",
    "Book for Ana and Bo",
    "Time?",
    "你好",
]


def synthetic_requests(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tools = rng.sample(TOOL_POOL, rng.randint(1, 4))
        names = [t["function"]["name"] for t in tools]
        msgs: list[dict[str, Any]] = []
        if rng.random() < 0.3:
            msgs.append({"role": "_input", "content": "You are a careful assistant."})
        msgs.append({"role": "user", "content": rng.choice(QUESTIONS)})
        kind = rng.random()
        if kind < 0.35:  # a history with an OpenAI-style call and its result
            cid = f"call_{rng.getrandbits(40):x}"
            msgs += [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": cid, "type": "function", "function": {"name": names[0], "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": cid, "content": json.dumps({"ok": True, "note": "été"})},
            ]
        req: dict[str, Any] = {"messages": msgs, "tools": tools}
        r = rng.random()
        if r < 0.3:
            req["tool_choice"] = "required"
        elif r < 0.5:
            req["tool_choice"] = {"type": "function", "function": {"name": rng.choice(names)}}
        elif r < 0.6:
            req["tool_choice"] = "none"
        if rng.random() < 0.15:
            req["chat_template_kwargs"] = {"thinking": False}
        if i % 10 == 7:  # must be a 400 naming messages[k].tool_call_id
            req["messages"] = msgs[:1] + [{"role": "tool", "tool_call_id": "call_nobody", "content": "?"}]
        if i % 10 == 9:  # must be a 400 naming tool_choice
            req["tool_choice"] = {"type": "function", "function": {"name": "not_a_tool"}}
        out.append(req)
    return out


def load_samples(path: Path) -> list[dict]:
    reqs = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                reqs.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SystemExit(f"--samples {path}:{line_no}: not JSON ({e})") from None
    return reqs


def prepare(req: dict, model: str, max_tokens: int, stream: bool) -> dict:
    body = copy.deepcopy(req)
    for m in body.get("messages", []):
        if m.get("role") == "_input":  # the verifier's own role name, sent as system
            m["role"] = "system"
    body.update(model=model, max_tokens=max_tokens, temperature=1.0, seed=0, stream=stream)
    body.pop("stream_options", None)
    return body


def well_formed(body: dict) -> bool:
    try:
        (choice,) = body["choices"]
        msg = choice["message"]
        ok = msg["role"] == "assistant" and choice["finish_reason"] in ("stop", "length", "tool_calls")
        for c in msg.get("tool_calls") or []:
            ok &= c["type"] == "function" and bool(c["id"]) and isinstance(c["function"]["arguments"], str)
            ok &= bool(c["function"]["name"])
        return bool(ok) and (msg["content"] is None or isinstance(msg["content"], str))
    except (KeyError, TypeError, ValueError):
        return False


def schema_valid(call: dict, tools: list[dict]) -> bool:
    fn = next((t["function"] for t in tools if t["function"]["name"] == call["function"]["name"]), None)
    if fn is None:
        return False
    try:
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), fn.get("parameters") or {"type": "object"}
        )
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def streamed(http: httpx.Client, body: dict) -> tuple[int, dict]:
    """(status, {"content", "tool_calls", "finish_reason"}) merged from the SSE deltas."""
    content, calls, finish = [], {}, None
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.json()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices", []):
                d = ch.get("delta") or {}
                content.append(d.get("content") or "")
                for tc in d.get("tool_calls") or []:
                    c = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
                    c["id"] = tc.get("id") or c["id"]
                    c["name"] += (tc.get("function") or {}).get("name") or ""
                    c["arguments"] += (tc.get("function") or {}).get("arguments") or ""
                finish = ch.get("finish_reason") or finish
    return 200, {
        "content": "".join(content),
        "tool_calls": [calls[i] for i in sorted(calls)],
        "finish_reason": finish,
    }


def flat(body: dict) -> dict:
    (choice,) = body["choices"]
    msg = choice["message"]
    calls = [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in msg.get("tool_calls") or []
    ]
    return {"content": msg["content"] or "", "tool_calls": calls, "finish_reason": choice["finish_reason"]}


def run(args: argparse.Namespace) -> dict:
    from k2_stack.commands.chat import LocalServer

    reqs = load_samples(args.samples) if args.samples else synthetic_requests(args.synthetic, args.seed)
    reqs = reqs[: args.limit] if args.limit else reqs
    server = None if args.url else LocalServer(args.model, args.preset, seed=0, device=None)
    url = args.url or server.url
    stats = dict(requests=0, ok200=0, named400=0, other=0, length=0, calls=0, valid=0, markup=0, mismatch=0)
    t0 = time.perf_counter()
    try:
        with httpx.Client(base_url=url, timeout=600) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            for req in reqs:
                if time.perf_counter() - t0 > args.time_budget:
                    break
                stats["requests"] += 1
                r = http.post("/v1/chat/completions", json=prepare(req, model, args.max_tokens, False))
                body = r.json()
                if r.status_code == 400:
                    named = bool((body.get("error") or {}).get("param"))
                    stats["named400" if named else "other"] += 1
                    continue
                if r.status_code != 200 or not well_formed(body):
                    stats["other"] += 1
                    continue
                stats["ok200"] += 1
                one = flat(body)
                stats["length"] += one["finish_reason"] == "length"
                stats["calls"] += len(one["tool_calls"])
                for c in body["choices"][0]["message"].get("tool_calls") or []:
                    stats["valid"] += schema_valid(c, req.get("tools") or [])
                status, many = streamed(http, prepare(req, model, args.max_tokens, True))
                if any(m in one["content"] or (status == 200 and m in many["content"]) for m in MARKUP):
                    stats["markup"] += 1
                stats["mismatch"] += status != 200 or many != one
    finally:
        if server is not None:
            server.close()
    stats["seconds"] = round(time.perf_counter() - t0, 1)
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=Path, help="K2VV's samples.jsonl (default: the synthetic set)")
    p.add_argument("--synthetic", type=int, default=60, help="synthetic requests when --samples is not given")
    p.add_argument("--limit", type=int, default=0, help="use only the first N requests (0: all)")
    p.add_argument("--time-budget", type=float, default=300.0, help="seconds; no new request after it")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0, help="of the synthetic set")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--preset", default=None, help="serve a K2Config preset with random weights (default tiny)"
    )
    src.add_argument("--model", default=None, help="serve an HF-format export")
    src.add_argument("--url", default=None, help="a running k2 serve (or any OpenAI-compatible server)")
    args = p.parse_args(argv)
    if args.samples and not args.samples.is_file():
        p.error(f"--samples {args.samples}: no such file")
    if not (args.model or args.url):
        args.preset = args.preset or "tiny"
    s = run(args)
    what = (
        f"K2VV samples {args.samples}"
        if args.samples
        else f"synthetic set ({args.synthetic}, seed {args.seed})"
    )
    print(f"machine: {machine(load=True)}")
    print(
        f"requests: {what}; server: {args.url or args.model or 'preset ' + args.preset}; max_tokens {args.max_tokens}"
    )
    print()
    print(
        "| requests | well-formed 200 | named 400 | other | cut by max_tokens | calls | schema-valid "
        "| markup in content | stream != non-stream | seconds |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {s['requests']} | {s['ok200']} | {s['named400']} | {s['other']} | {s['length']} | {s['calls']} | {s['valid']} "
        f"| {s['markup']} | {s['mismatch']} | {s['seconds']} |"
    )
    return 0 if s["other"] == 0 and s["markup"] == 0 and s["mismatch"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

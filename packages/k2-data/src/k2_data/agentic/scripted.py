"""A scripted OpenAI-protocol teacher for tests and offline dry runs of the agentic pipeline.

`ScriptedTeacher()` is a `LoopbackServer` responder (`k2_data.loopback`) that answers every stage
deterministically, by the stage tag of the system prompt (`k2_data.agentic.llm.TAGS`) or, for agent
requests, by the `tools` they carry:
- agent profile, tasks (expected tool = the set's first tool), tool simulator (`{"ok": true, ...}`),
  user simulator (one follow-up, then `[DONE]`), judge (every criterion met);
- markers in a task's user request script the failure paths: `MALFORMED` (the agent's first call has
  arguments that are not JSON), `INVALID` (arguments that violate the schema, then a valid retry),
  `UNKNOWN` (a call to an undeclared tool), `REJECT` (the judge rejects), `GARBLED` (the judge answers
  without JSON). `ScriptedTeacher(markers=[...])` cycles the tasks it writes through these markers;
- `ScriptedTeacher(plan=[(tool, arguments), ...])`: the agent makes exactly these calls, one per step
  (those of its tool set), then reports every result (for tests of real tool execution);
- `ScriptedTeacher(follow_requests=True)`: a competent teacher for the before/after student benchmark. Its
  tasks name concrete calls with seeded values over the agent's tool set, in the held-out request style
  ("Please call NAME with {json}. Then call NAME2 with {json}.", `concrete_tasks`, drawn from the task
  request's seed, never the held-out one), and its agent makes the calls its first user turn names, one
  per step (a failed call is retried), then reports the results.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import time
from typing import Any

from k2_data.agentic.evaluate import _args, calls_task, make_heldout_tasks
from k2_data.agentic.llm import TAGS, extract_json
from k2_data.loopback import Reply

MARKERS = ("MALFORMED", "INVALID", "UNKNOWN", "REJECT", "GARBLED")


def _p(**props: Any) -> dict[str, Any]:
    """An object schema: `name=type` (required) or `name=(type, enum)`."""
    out: dict[str, Any] = {}
    for k, v in props.items():
        out[k] = {"type": v[0], "enum": list(v[1])} if isinstance(v, tuple) else {"type": v}
    return {"type": "object", "properties": out, "required": list(props)}


# the scripted domain tree: category -> domain -> tools (name, description, parameters)
BANK: dict[str, dict[str, list[tuple[str, str, dict[str, Any]]]]] = {
    "Travel": {
        "Flight booking": [
            (
                "search_flights",
                "Search flights between two airports on a date.",
                _p(origin="string", destination="string", date="string"),
            ),
            (
                "book_flight",
                "Book a seat on a flight for a passenger.",
                _p(flight_id="string", passenger_name="string"),
            ),
        ],
        "Hotels": [
            (
                "find_hotels",
                "Find hotels in a city with free rooms for some nights.",
                _p(city="string", nights="integer"),
            ),
            (
                "reserve_room",
                "Reserve a hotel room and return its confirmation number.",
                _p(hotel_id="string", guest_name="string"),
            ),
        ],
    },
    "Finance": {
        "Banking": [
            ("get_account_balance", "Return the current balance of a bank account.", _p(account_id="string")),
            (
                "transfer_money",
                "Transfer an amount of money between two bank accounts.",
                _p(from_account="string", to_account="string", amount="number"),
            ),
        ],
        "Investing": [
            ("get_stock_quote", "Latest market price of a stock ticker symbol.", _p(symbol="string")),
            (
                "place_order",
                "Place a buy or sell order for shares of a stock.",
                _p(symbol="string", side=("string", ["buy", "sell"]), quantity="integer"),
            ),
        ],
    },
    "Health": {
        "Clinic appointments": [
            (
                "schedule_appointment",
                "Schedule a doctor's appointment for a patient.",
                _p(patient_id="string", doctor="string", time="string"),
            ),
            (
                "cancel_appointment",
                "Cancel an existing medical appointment by its id.",
                _p(appointment_id="string"),
            ),
        ],
        "Fitness tracking": [
            (
                "log_workout",
                "Record a workout with its sport and duration in minutes.",
                _p(sport="string", minutes="integer"),
            ),
            ("get_step_count", "The user's daily step count for a date.", _p(date="string")),
        ],
    },
    "Productivity": {
        "Calendar": [
            (
                "create_event",
                "Create a calendar event with a title, start and end time.",
                _p(title="string", start="string", end="string"),
            ),
            ("list_events", "List the calendar events on a given day.", _p(day="string")),
        ],
        "Email": [
            (
                "send_email",
                "Send an email to a recipient with a subject and body.",
                _p(to="string", subject="string", body="string"),
            ),
            ("search_inbox", "Search the inbox for messages matching a query.", _p(query="string")),
        ],
    },
}
# written into the first domain's tool list when `ScriptedTeacher(evolve_faults=True)`: a schema the
# meta-schema rejects ("strng" is no JSON type), a near-duplicate of search_flights, and a name clash
FAULTY_TOOLS = [
    (
        "get_flight_status",
        "Current status of a flight by its number.",
        {"type": "object", "properties": {"flight": {"type": "strng"}}},
    ),
    (
        "lookup_flights",
        "Look up flights between two airports on a given date.",
        _p(origin="string", destination="string", date="string"),
    ),
    ("book_flight", "Book a flight seat.", _p(flight_id="string")),
]


def _value(schema: dict[str, Any]) -> Any:
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "string":
        return "demo"
    if kind in ("number", "integer"):
        return 2
    if kind == "boolean":
        return True
    if kind == "array":
        return [_value(schema.get("items") or {"type": "number"})] * 2
    if kind == "object":
        return {}
    return "demo"


def valid_arguments(parameters: dict[str, Any]) -> dict[str, Any]:
    props = parameters.get("properties") or {}
    return {k: _value(props[k]) for k in parameters.get("required", list(props)) if k in props}


def invalid_arguments(parameters: dict[str, Any]) -> dict[str, Any]:
    props = parameters.get("properties") or {}
    bad = {k: ({"wrong": "type"} if props[k].get("type") != "object" else 7) for k in props}
    return bad or {"unexpected": True}


def tool_call_response(
    calls: list[tuple[str, str]], content: str | None = None, start: int = 0
) -> dict[str, Any]:
    return {
        "id": "chatcmpl-scripted",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "scripted",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": content,
                    "tool_calls": [
                        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                        for i, (n, a) in enumerate(calls, start)
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 50, "completion_tokens": 10, "total_tokens": 60},
    }


_CALL = re.compile(r"call (\w+) with ")


def requested_calls(text: str) -> list[tuple[str, dict[str, Any]]]:
    """Each `call NAME with {JSON}` of `text` in order (the request style of `call_request`)."""
    decoder, out = json.JSONDecoder(), []
    for m in _CALL.finditer(text):
        try:
            args, _ = decoder.raw_decode(text, m.end())
        except json.JSONDecodeError:
            continue
        if isinstance(args, dict):
            out.append((m.group(1), args))
    return out


def _brief(result: str) -> str:
    """A tool result in a few words: `created key-1` for a state store reply, else `ok` or the text."""
    try:
        obj = json.loads(result)
    except json.JSONDecodeError:
        return result[:60]
    if isinstance(obj, dict) and "status" in obj:
        return f"{obj['status']} {obj.get('id', '')}".strip()
    return "ok"


def concrete_tasks(specs: list[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
    """`n` tasks naming concrete calls over `specs` (OpenAI tool specs): with a CRUD create in the set,
    `make_heldout_tasks`' own tasks (a create, then maybe an update or delete of that record) drawn from
    `seed`; otherwise one or two calls of the set's tools with `evaluate._args`' seeded values."""
    crud = make_heldout_tasks(specs, n, seed=seed, prefix="train")
    if crud:  # the ground truth (expected_calls, expected_state) stays in the rubric
        return [{k: t[k] for k in ("user_request", "goal", "rubric")} for t in crud]
    rng = random.Random(seed)
    fns = [s["function"] for s in specs]
    out = []
    for _ in range(n):
        picked = rng.sample(fns, min(len(fns), rng.choice((1, 2))))
        out.append(calls_task([{"name": f["name"], "arguments": _args(f, rng)} for f in picked]))
    return out


class ScriptedTeacher:
    def __init__(
        self,
        markers: list[str] | None = None,
        plan: list[tuple[str, dict[str, Any]]] | None = None,
        evolve_faults: bool = True,
        follow_requests: bool = False,
    ):
        self.markers = list(markers or [""])
        self.evolve_faults = evolve_faults
        self.plan = list(plan or [])
        self.follow_requests = follow_requests
        self.calls: dict[str, int] = {}

    def __call__(self, request: dict[str, Any]) -> Reply:
        messages = request.get("messages") or []
        system = messages[0].get("content", "") if messages and messages[0].get("role") == "system" else ""
        stage = next((s for s, tag in TAGS.items() if system.startswith(tag)), "agent_loop")
        self.calls[stage] = self.calls.get(stage, 0) + 1
        if stage == "agent_loop":
            return self.agent(request)
        user = messages[-1].get("content", "")
        if stage == "tasks" and self.follow_requests:
            return Reply(content=self.concrete_task_list(user, int(request.get("seed") or 0)))
        return Reply(content=getattr(self, f"stage_{stage}")(user))

    def stage_agent(self, user: str) -> str:
        return json.dumps(
            {"name": "helper", "system_prompt": "You help users with these tools. Be accurate."}
        )

    def stage_tasks(self, user: str) -> str:
        n = int(user.rsplit("Write ", 1)[1].split()[0])
        first = json.loads(user.split("Tools:\n", 1)[1].splitlines()[0])["name"]
        cycle = itertools.cycle(self.markers)
        tasks = [
            {
                "user_request": f"{next(cycle)} please use {first} for task {j}".strip(),
                "goal": f"a result from {first}",
                "rubric": {
                    "success_criteria": [f"{first} is called", "the result is reported"],
                    "expected_tools": [first, "not_a_tool"],
                    "checkpoints": ["call", "report"],
                },
            }
            for j in range(n)
        ]
        return "Here you go:\n```json\n" + json.dumps({"tasks": tasks}) + "\n```"

    def concrete_task_list(self, user: str, seed: int) -> str:
        """`concrete_tasks` over the tools the task request lists, seeded by the request's seed (the
        pipeline's per-agent task seed), so agents with the same tools get different values."""
        n = int(user.rsplit("Write ", 1)[1].split()[0])
        lines = user.split("Tools:\n", 1)[1].split("\n\n", 1)[0].splitlines()
        specs = [{"type": "function", "function": json.loads(line)} for line in lines if line.startswith("{")]
        return "```json\n" + json.dumps({"tasks": concrete_tasks(specs, n, seed)}) + "\n```"

    def stage_domains(self, user: str) -> str:
        n = int(user.rsplit("Write ", 1)[1].split()[0])
        if not user.startswith("Category: "):
            return json.dumps(
                {"categories": [{"name": c, "description": f"{c} apps"} for c in list(BANK)[:n]]}
            )
        cat = user.split("\n", 1)[0].removeprefix("Category: ")
        doms = list(BANK.get(cat, {}))[:n]
        return json.dumps({"domains": [{"name": d, "description": f"{d} services"} for d in doms]})

    def stage_tools(self, user: str) -> str:
        n = int(user.rsplit("Write ", 1)[1].split()[0])
        head = dict(line.split(": ", 1) for line in user.splitlines() if ": " in line)
        tools = BANK.get(head.get("Category", ""), {}).get(head.get("Domain", ""), [])[:n]
        first = next(iter(BANK))
        if self.evolve_faults and head.get("Domain") == next(iter(BANK[first])):
            tools = tools + FAULTY_TOOLS
        body = [{"name": a, "description": b, "parameters": c} for a, b, c in tools]
        return "```json\n" + json.dumps({"tools": body}) + "\n```"

    def stage_tool(self, user: str) -> str:
        call = json.loads(user)
        if "fail" in call["tool"]["name"]:
            return json.dumps({"ok": False, "result": "quota exceeded"})
        return json.dumps({"ok": True, "result": {"tool": call["tool"]["name"], "echo": call["arguments"]}})

    def stage_user(self, user: str) -> str:
        return "Thanks. Can you confirm it worked?" if user.count("USER:") == 1 else "[DONE]"

    def stage_judge(self, user: str) -> str:
        task = extract_json(user) or {}
        if "GARBLED" in task.get("task", ""):
            return "I think it is fine overall."
        met = "REJECT" not in task.get("task", "")
        crit = [{"criterion": c, "met": met} for c in task.get("rubric", {}).get("success_criteria", [])]
        return json.dumps({"criteria": crit, "verdict": "accept" if met else "reject", "reason": "scripted"})

    def agent(self, request: dict[str, Any]) -> Reply:
        messages = request["messages"]
        tools = [t["function"] for t in request.get("tools") or []]
        first_user = next(m["content"] for m in messages if m["role"] == "user")
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        since = messages[users[-1] + 1 :]
        target = tools[0]
        good = json.dumps(valid_arguments(target.get("parameters") or {}))
        if len(users) > 1:  # a follow-up: answer without tools
            return Reply(content="Confirmed: it worked.")
        if self.follow_requests:  # the calls the request names (of the set), when it names any
            names = {t["name"] for t in tools}
            requested = [(n, a) for n, a in requested_calls(first_user) if n in names]
            if requested:
                return self.follow(requested, since)
        if self.plan:
            names = {t["name"] for t in tools}
            plan = [(n, a) for n, a in self.plan if n in names]
            done = sum(len(m.get("tool_calls") or []) for m in since if m["role"] == "assistant")
            if done < len(plan):
                name, arguments = plan[done]
                return Reply(body=tool_call_response([(name, json.dumps(arguments))], start=done))
            results = [str(m.get("content")) for m in since if m["role"] == "tool"]
            return Reply(content="Done. Results: " + " | ".join(results))
        if not since:
            if "MALFORMED" in first_user:
                return Reply(body=tool_call_response([(target["name"], '{"key": ')]))
            if "INVALID" in first_user:
                bad = json.dumps(invalid_arguments(target.get("parameters") or {}))
                return Reply(body=tool_call_response([(target["name"], bad)]))
            if "UNKNOWN" in first_user:
                return Reply(body=tool_call_response([("no_such_tool", "{}")]))
            return Reply(body=tool_call_response([(target["name"], good)]))
        last = since[-1]
        if last["role"] == "tool" and str(last["content"]).startswith("Error:"):
            errors = sum(1 for m in since if m["role"] == "tool" and str(m["content"]).startswith("Error:"))
            if errors < 3:
                return Reply(body=tool_call_response([(target["name"], good)]))
            return Reply(content="Sorry, the tool keeps failing.")
        return Reply(content=f"Done. The tool returned: {str(last.get('content'))[:200]}")

    def follow(self, requested: list[tuple[str, dict[str, Any]]], since: list[dict[str, Any]]) -> Reply:
        """The next requested call (one per step, as a model makes them; a failed call is retried up to
        twice), then a short report of every result."""
        results = [str(m.get("content")) for m in since if m["role"] == "tool"]
        errors = [r for r in results if r.startswith("Error:")]
        ok = [r for r in results if not r.startswith("Error:")]
        if len(errors) >= 3:
            return Reply(content=f"Sorry, {requested[len(ok)][0]} keeps failing: {errors[-1][:120]}")
        if len(ok) < len(requested):
            name, arguments = requested[len(ok)]
            return Reply(body=tool_call_response([(name, json.dumps(arguments))], start=len(results)))
        report = " ".join(f"{n}: {_brief(r)}." for (n, _), r in zip(requested, ok))
        return Reply(content=f"Done. {report}")

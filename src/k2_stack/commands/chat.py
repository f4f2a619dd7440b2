"""`k2 chat`: talk to a model from the terminal (Kimi chat format, streamed, tool calls shown).

`--url URL` talks to a running `k2 serve` (or any OpenAI-compatible server); `--model DIR` or
`--preset NAME` starts `k2 serve`'s app in this process on a free loopback port first, so every
mode goes through the same OpenAI API and chat template. Lines come from stdin, so it also works
piped (`echo hi | k2 chat --preset tiny`). When the model calls a tool, the call is printed and
the next line is taken as the tool's result (`--tools FILE` declares the tools, OpenAI's JSON list).
Commands: `/reset` forgets the conversation, `/exit` (or end of input) quits.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from k2_stack.cli import DefaultsHelpFormatter


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "chat",
        help="interactive terminal chat with a model (local or a k2 serve URL)",
        formatter_class=DefaultsHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF-format model directory (e.g. from `k2 export`)")
    src.add_argument("--preset", help="a K2Config preset with random weights (e.g. tiny)")
    src.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model-name", default=None, help="model id at --url (default: the server's first model)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--tools", default=None, help="JSON file with a list of OpenAI tool definitions")
    p.add_argument("--tool-choice", default=None, help="auto | required | none | a function name")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens per reply")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (0: greedy)")
    p.add_argument(
        "--seed", type=int, default=None, help="sampling seed (also the preset's weights seed locally)"
    )
    p.add_argument(
        "--device", default=None, help="local model device: cpu or cuda[:N] (default: as k2 serve chooses)"
    )
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"k2 chat: error: {message}", file=sys.stderr)
    return 2


class LocalServer:
    """`k2 serve`'s app on a free loopback port in a background thread."""

    def __init__(self, model: str | None, preset: str | None, seed: int, device: str | None) -> None:
        import socket
        import threading
        import time

        import uvicorn

        from k2_stack.serve import build_bridge, create_app

        self.bridge = build_bridge(model, preset, seed=seed, device=device, log_stats_interval=0)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        app = create_app(self.bridge, ckpt_rank=None)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the local server did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.bridge.close()


class Chat:
    """One conversation against an OpenAI-compatible endpoint, printed as it streams."""

    def __init__(self, url: str, model: str | None, args: argparse.Namespace, out: TextIO) -> None:
        import httpx

        self.http = httpx.Client(base_url=url.rstrip("/"), timeout=600)
        self.model = model or self.http.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        self.args, self.out = args, out
        self.tools = json.loads(open(args.tools).read()) if args.tools else None
        self.messages: list[dict[str, Any]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.args.system}] if self.args.system else []

    def _tool_choice(self) -> Any:
        c = self.args.tool_choice
        if c is None or c in {"auto", "required", "none"}:
            return c
        return {"type": "function", "function": {"name": c}}

    def turn(self) -> list[dict[str, Any]]:
        """Send the conversation, print the streamed reply; returns its tool calls (maybe empty)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages,
            "max_tokens": self.args.max_tokens,
            "temperature": self.args.temperature,
            "stream": True,
        }
        if self.args.seed is not None:
            body["seed"] = self.args.seed
        if self.tools:
            body["tools"] = self.tools
            if self._tool_choice() is not None:
                body["tool_choice"] = self._tool_choice()
        content, calls, finish = "", {}, None
        self.out.write("assistant> ")
        self.out.flush()
        with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                err = r.json().get("error", {})
                raise RuntimeError(f"{r.status_code}: {err.get('message')} (param {err.get('param')})")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for ch in chunk.get("choices", []):
                    d = ch.get("delta", {})
                    if d.get("content"):
                        content += d["content"]
                        self.out.write(d["content"])
                        self.out.flush()
                    for tc in d.get("tool_calls") or []:
                        c = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
                        c["id"] = tc.get("id") or c["id"]
                        fn = tc.get("function") or {}
                        c["name"] += fn.get("name") or ""
                        c["arguments"] += fn.get("arguments") or ""
                    finish = ch.get("finish_reason") or finish
        self.out.write("\n")
        tool_calls = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for _, c in sorted(calls.items())
        ]
        for c in tool_calls:
            self.out.write(
                f"[tool call] {c['function']['name']}({c['function']['arguments']})  id={c['id']}\n"
            )
        if finish == "length":
            self.out.write("[cut at --max-tokens]\n")
        self.messages.append(
            {"role": "assistant", "content": content or None, "tool_calls": tool_calls or None}
        )
        if not tool_calls:
            self.messages[-1].pop("tool_calls")
        return tool_calls

    def loop(self, inp: TextIO) -> None:
        interactive = inp.isatty()

        def ask(prompt: str) -> str | None:
            if interactive:
                self.out.write(prompt)
                self.out.flush()
            line = inp.readline()
            return None if not line else line.rstrip("\n")

        while True:
            text = ask("you> ")
            if text is None or text.strip() in {"/exit", "/quit"}:
                return
            if text.strip() == "/reset":
                self.reset()
                self.out.write("[conversation reset]\n")
                continue
            if not text.strip():
                continue
            self.messages.append({"role": "user", "content": text})
            calls = self.turn()
            while calls:  # each call's result is the next input line, then the model continues
                for c in calls:
                    result = ask(f"tool {c['function']['name']} result> ")
                    if result is None:
                        return
                    self.messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
                calls = self.turn()


def run(args: argparse.Namespace, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    if args.model is not None or args.preset is not None:
        from k2_stack.commands.serve import check_args

        probe = argparse.Namespace(
            model=args.model, preset=args.preset, max_batch_size=1, max_model_len=None,
            kv_cache_tokens=None, block_size=1, port=0, device=args.device,
        )  # fmt: skip
        problem = check_args(probe)
        if problem:
            return _fail(problem)
    if args.tools:
        try:
            tools = json.loads(open(args.tools).read())
            assert isinstance(tools, list)
        except (OSError, ValueError, AssertionError) as e:
            return _fail(f"argument --tools: expected a JSON file with a list of tools ({e})")
    local = None
    try:
        if args.url is None:
            local = LocalServer(args.model, args.preset, args.seed or 0, args.device)
        url = args.url or local.url
        try:
            chat = Chat(url, args.model_name, args, stdout)
        except Exception as e:  # connection refused, not an OpenAI server, ...
            return _fail(f"argument --url: cannot reach {url} ({e})")
        try:
            chat.loop(stdin)
        except RuntimeError as e:
            return _fail(str(e))
        except KeyboardInterrupt:
            stdout.write("\n")
    finally:
        if local is not None:
            local.close()
    return 0

"""`k2 chat` driven non-interactively (stdin piped): local preset, a --url server, tool-call display.

Reference: greedy recomputation on the same tiny model (the preset's weights from the same seed).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
import torch
from k2_data.chat import render_ids

from k2_stack.cli import build_parser
from k2_stack.commands.chat import LocalServer

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,  # exactly these keys: a random model's call then ends well within --max-tokens
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}},
            "required": ["city"],
        },
    },
}


def _greedy(model, prompt: list[int], n: int, stops: set[int]) -> list[int]:
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if t in stops:
                break
            out.append(t)
            ids.append(t)
    return out


def _chat(argv: list[str], stdin: str) -> tuple[int, str]:
    args = build_parser().parse_args(["chat", *argv])
    out = io.StringIO()
    rc = args.func(args, stdin=io.StringIO(stdin), stdout=out)
    return rc, out.getvalue()


def test_chat_against_a_url_two_turns_and_tool_calls(tmp_path):
    torch.set_num_threads(1)
    server = LocalServer(None, "tiny", seed=0, device=None)
    try:
        bridge = server.bridge
        rc, out = _chat(
            ["--url", server.url, "--temperature", "0", "--max-tokens", "6"], "Hello\n/reset\nHi again\n"
        )
        assert rc == 0
        replies = [
            line.removeprefix("assistant> ") for line in out.splitlines() if line.startswith("assistant> ")
        ]
        assert len(replies) == 2 and "[conversation reset]" in out
        stops = set(bridge.engine.eos_token_ids)
        for text, user in zip(replies, ["Hello", "Hi again"]):  # /reset: the second turn starts afresh
            prompt = render_ids(
                bridge.tokenizer, [{"role": "user", "content": user}], add_generation_prompt=True
            )
            want = bridge.tokenizer.decode(_greedy(bridge.model, prompt, 6, stops))
            assert text == want.split("\n")[0]
        tools = tmp_path / "tools.json"
        tools.write_text(json.dumps([TOOL]))
        argv = [
            "--url",
            server.url,
            "--tools",
            str(tools),
            "--tool-choice",
            "required",
            "--max-tokens",
            "40",
            "--seed",
            "1",
        ]
        rc, out = _chat(argv, "Weather?\nsunny\n")
        assert rc == 0
        call_lines = [line for line in out.splitlines() if line.startswith("[tool call] get_weather(")]
        assert call_lines, out
        args = json.loads(call_lines[0].split("(", 1)[1].rsplit(")", 1)[0])
        assert args["city"] in {"Paris", "Lima"}
        assert out.count("assistant> ") >= 2  # after the tool result the model answered again
    finally:
        server.close()


@pytest.mark.slow  # starts `python -m k2_stack` processes
def test_chat_cli_local_preset_piped_and_bad_arguments(tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "k2_stack",
            "chat",
            "--preset",
            "tiny",
            "--max-tokens",
            "3",
            "--temperature",
            "0",
        ],
        input="hi\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("assistant> ")
    for argv, needle in ((["--preset", "nope"], "--preset"), (["--model", str(tmp_path)], "k2 export")):
        p = subprocess.run(
            [sys.executable, "-m", "k2_stack", "chat", *argv], capture_output=True, text=True, timeout=120
        )
        assert p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr

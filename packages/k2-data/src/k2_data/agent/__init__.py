"""The K2 tool-call loop against any OpenAI-compatible chat-completions endpoint.

    from k2_data.agent import Agent, tool

    @tool
    def add(a: int, b: int) -> int:
        '''Add two integers.'''
        return a + b

    with Agent("http://127.0.0.1:8000/v1", tools=[add], model="k2-tiny") as agent:
        result = agent.run("What is 2 + 3?")

- `tool` / `Tool`: a callable with the JSON schema the model sees (derived from type hints)
- `Agent(client, tools, model=..., max_steps=...)`: `run(messages) -> AgentResult`; `AsyncAgent` for asyncio
- `HTTPChatClient(base_url, api_key)`: the httpx client (imported lazily); any callable works instead
"""

from k2_data.agent.client import AsyncHTTPChatClient, EndpointError, HTTPChatClient
from k2_data.agent.loop import Agent, AgentResult, AsyncAgent, ToolError, format_result, run_agent
from k2_data.agent.tools import Tool, signature_schema, tool, type_schema

__all__ = [
    "Agent",
    "AgentResult",
    "AsyncAgent",
    "AsyncHTTPChatClient",
    "EndpointError",
    "HTTPChatClient",
    "Tool",
    "ToolError",
    "format_result",
    "run_agent",
    "signature_schema",
    "tool",
    "type_schema",
]

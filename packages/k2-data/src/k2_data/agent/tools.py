"""Tools for the agent loop: a Python callable plus the JSON schema the model sees.

    @tool
    def get_weather(city: str, unit: Literal["c", "f"] = "c") -> dict:
        '''Current weather for a city.

        city: the city name
        '''

    get_weather.spec()  # {"type": "function", "function": {"name": "get_weather", "description": ...,
                        #  "parameters": {"type": "object", "properties": {...}, "required": ["city"]}}}

The schema is derived from the signature: `str/int/float/bool/None`, `list[X]`, `tuple[X, ...]`,
`dict[str, X]`, `Literal[...]` (an `enum`), `X | None` / `Optional[X]` (X, not required when it has a
default), a parameter with a default is optional. Lines `name: text` in the docstring (after the first
paragraph) describe parameters. Anything the derivation cannot express: pass `parameters=` explicitly.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin

JSONSchema = dict[str, Any]

_SCALARS: dict[Any, JSONSchema] = {
    str: {"type": "string"},
    int: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
    Any: {},
}
# a docstring line `name: description` (or `name (type): description`) documents a parameter
_PARAM_DOC = re.compile(r"^\s*(?P<name>[A-Za-z_]\w*)\s*(?:\([^)]*\))?\s*:\s*(?P<text>\S.*)$")


def type_schema(tp: Any, where: str = "type") -> JSONSchema:
    """JSON schema of a Python type hint; `where` names the parameter in the error."""
    if tp in _SCALARS:
        return dict(_SCALARS[tp])
    if tp is list or tp is tuple:
        return {"type": "array"}
    if tp is dict:
        return {"type": "object"}
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        kinds = {type(a) for a in args}
        out: JSONSchema = {"enum": list(args)}
        if len(kinds) == 1 and next(iter(kinds)) in _SCALARS:
            out = {**_SCALARS[next(iter(kinds))], **out}
        return out
    if origin is Union or (hasattr(types, "UnionType") and isinstance(tp, types.UnionType)):
        members = [a for a in args if a is not type(None)]
        if len(members) == 1:  # Optional[X]: the model may also send null
            return type_schema(members[0], where)
        return {"anyOf": [type_schema(a, where) for a in args]}
    if origin in (list, tuple, set, frozenset, abc.Sequence):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return {
                "type": "array",
                "prefixItems": [type_schema(a, where) for a in args],
                "minItems": len(args),
                "maxItems": len(args),
            }
        return {"type": "array", "items": type_schema(args[0], where)} if args else {"type": "array"}
    if origin is dict:
        if args and args[0] is not str:
            raise TypeError(f"{where}: JSON object keys are strings, got dict[{args[0]!r}, ...]")
        return (
            {"type": "object", "additionalProperties": type_schema(args[1], where)}
            if args
            else {"type": "object"}
        )
    raise TypeError(
        f"{where}: cannot derive a JSON schema from {tp!r}; pass parameters= to tool() explicitly"
    )


def _doc_parts(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    doc = inspect.getdoc(fn) or ""
    paragraphs = doc.split("\n\n")
    summary = " ".join(paragraphs[0].split()) if doc else ""
    params: dict[str, str] = {}
    for line in "\n\n".join(paragraphs[1:]).splitlines():
        m = _PARAM_DOC.match(line)
        if m:
            params[m.group("name")] = m.group("text").strip()
    return summary, params


def signature_schema(fn: Callable[..., Any]) -> JSONSchema:
    """The `parameters` object schema of `fn`'s keyword-callable parameters."""
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # an unresolvable forward reference: name the function
        raise TypeError(f"tool {fn.__name__}: cannot resolve type hints ({e})") from e
    _, docs = _doc_parts(fn)
    props: dict[str, JSONSchema] = {}
    required: list[str] = []
    for name, p in sig.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise TypeError(
                f"tool {fn.__name__}: parameter {name!r} must be passable by keyword "
                "(the model sends a JSON object)"
            )
        schema = type_schema(hints.get(name, Any), f"tool {fn.__name__}, parameter {name!r}")
        if name in docs:
            schema["description"] = docs[name]
        props[name] = schema
        if p.default is p.empty:
            required.append(name)
    out: JSONSchema = {"type": "object", "properties": props}
    if required:
        out["required"] = required
    return out


@dataclass
class Tool:
    """A callable the model may call, with the name, description and parameter schema it sees."""

    fn: Callable[..., Any]
    name: str
    description: str = ""
    parameters: JSONSchema = field(default_factory=lambda: {"type": "object", "properties": {}})

    def spec(self) -> dict[str, Any]:
        """The OpenAI `tools` entry."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    parameters: JSONSchema | None = None,
) -> Any:
    """Make a `Tool` from a function: `@tool`, or `@tool(name=..., description=..., parameters=...)`."""

    def make(f: Callable[..., Any]) -> Tool:
        summary, _ = _doc_parts(f)
        return Tool(
            fn=f,
            name=name or f.__name__,
            description=summary if description is None else description,
            parameters=signature_schema(f) if parameters is None else parameters,
        )

    return make(fn) if fn is not None else make


def as_tool(obj: Tool | Callable[..., Any]) -> Tool:
    return obj if isinstance(obj, Tool) else tool(obj)


def tool_specs(tools: list[Tool]) -> list[dict[str, Any]]:
    return [t.spec() for t in tools]


# --- tools known only by their spec (imported from MCP servers or OpenAI-format JSON files) -----------


class UnboundToolError(RuntimeError):
    """A tool imported as a spec only was called without an implementation (bind one, or simulate it)."""


def _unbound(name: str) -> Callable[..., Any]:
    def call(**kwargs: Any) -> Any:
        raise UnboundToolError(f"tool {name!r} has a spec but no implementation")

    call.__name__ = name
    return call


def tool_from_spec(spec: dict[str, Any], fn: Callable[..., Any] | None = None) -> Tool:
    """A `Tool` from an OpenAI `tools` entry (`{"type": "function", "function": {...}}`) or from the bare
    function object (`{"name", "description", "parameters"}`). Without `fn` the tool is spec-only: calling
    it raises `UnboundToolError` (a tool simulator or an MCP session supplies `fn`). ValueError naming the
    field when the spec is malformed."""
    if not isinstance(spec, dict):
        raise ValueError(f"a tool spec must be a JSON object, got {type(spec).__name__}")
    if "function" in spec:
        if spec.get("type", "function") != "function":
            raise ValueError(f"field 'type' must be 'function', got {spec.get('type')!r}")
        spec = spec["function"]
        if not isinstance(spec, dict):
            raise ValueError("field 'function' must be a JSON object")
    name = spec.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
        raise ValueError(f"field 'name' must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
    description = spec.get("description") or ""
    if not isinstance(description, str):
        raise ValueError(f"tool {name}: field 'description' must be a string")
    parameters = spec.get("parameters", spec.get("input_schema", spec.get("inputSchema")))
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ValueError(f"tool {name}: field 'parameters' must be a JSON schema of type 'object'")
    return Tool(fn=fn or _unbound(name), name=name, description=description, parameters=dict(parameters))


def load_openai_tools(path: Any) -> list[Tool]:
    """Spec-only tools from a JSON file in OpenAI's tool format: a list of `tools` entries, an object with
    a `tools` list, or a single entry; a `.jsonl` file holds one entry per line. ValueError names the file
    and the entry."""
    import json
    from pathlib import Path

    p = Path(path)
    text = p.read_text(encoding="utf-8")
    if p.suffix == ".jsonl":
        entries = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        data = json.loads(text)
        entries = data.get("tools", [data]) if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise ValueError(f"{p}: expected a list of OpenAI tool entries")
    out: list[Tool] = []
    for i, entry in enumerate(entries):
        try:
            out.append(tool_from_spec(entry))
        except ValueError as e:
            raise ValueError(f"{p}: tools[{i}]: {e}") from None
    return out

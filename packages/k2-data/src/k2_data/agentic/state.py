"""The tool simulator's deterministic world state: collections of records keyed by id.

A tool whose name carries a CRUD verb (`create_note`, `kv_set`, `read_file`, `delete_event`,
`list_files`, ...) is executed here, without an LLM, so the world stays consistent: what was created is
what a later read returns, a read or delete of something absent (or deleted) is an error. Reads of a
collection nothing was ever created in go to the LLM simulator instead (`StateStore.knows`). The record key
is the call's `id`/`key`/`path`/`name`/`*_id` argument (or a generated `COLLECTION-N`).
"""

from __future__ import annotations

import json
import re
from typing import Any

VERBS: dict[str, tuple[str, ...]] = {
    "create": (
        "create",
        "add",
        "new",
        "insert",
        "put",
        "set",
        "write",
        "register",
        "book",
        "save",
        "upload",
        "store",
        "post",
        "make",
        "schedule",
    ),
    "read": ("get", "read", "fetch", "show", "lookup", "retrieve", "view", "describe"),
    "update": ("update", "edit", "modify", "patch", "rename", "change", "append"),
    "delete": ("delete", "remove", "cancel", "drop", "destroy", "unlink", "erase", "clear"),
    "list": ("list", "search", "find", "query", "browse"),
}
_OP_OF = {verb: op for op, verbs in VERBS.items() for verb in verbs}
KEY_FIELDS = ("id", "key", "path", "name", "title", "filename", "email", "username")


class StateError(RuntimeError):
    """A call the state cannot serve (absent record); the message is what the agent sees."""


def _tokens(name: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return [t for t in re.split(r"[_.\-\s]+", spaced.lower()) if t]


def _singular(word: str) -> str:
    return word[:-1] if word.endswith("s") and not word.endswith("ss") and len(word) > 3 else word


def classify(tool_name: str) -> tuple[str, str] | None:
    """`(op, collection)` for a CRUD-named tool, else None: `create_note` -> ("create", "note"),
    `kv_get` -> ("read", "kv"), `list_files` -> ("list", "file")."""
    toks = _tokens(tool_name)
    for i, t in enumerate(toks):
        if t in _OP_OF:
            rest = [_singular(x) for j, x in enumerate(toks) if j != i]
            return _OP_OF[t], "_".join(rest) or "item"
    return None


class StateStore:
    def __init__(self) -> None:
        self.collections: dict[str, dict[str, dict[str, Any]]] = {}
        self._counters: dict[str, int] = {}

    @staticmethod
    def key_of(collection: str, args: dict[str, Any]) -> str | None:
        for f in (*KEY_FIELDS, f"{collection}_id", f"{collection}_name"):
            if isinstance(args.get(f), (str, int)) and args[f] != "":
                return str(args[f])
        for f, v in args.items():
            if f.endswith(("_id", "_name")) and isinstance(v, (str, int)):
                return str(v)
        return None

    def apply(self, op: str, collection: str, args: dict[str, Any]) -> Any:
        """Run one classified call; the JSON-able result, or StateError."""
        coll = (
            self.collections.setdefault(collection, {})
            if op == "create"
            else self.collections.get(collection, {})
        )
        key = self.key_of(collection, args)
        if op == "create":
            if key is None:
                self._counters[collection] = self._counters.get(collection, 0) + 1
                key = f"{collection}-{self._counters[collection]}"
                args = {"id": key, **args}
            existed = key in coll
            coll[key] = dict(args)
            return {"status": "updated" if existed else "created", "id": key, "record": coll[key]}
        if op == "list":
            records = [coll[k] for k in sorted(coll)]
            filters = {k: v for k, v in args.items() if isinstance(v, (str, int, float, bool))}
            prefix = filters.pop("prefix", None)
            path = filters.pop("path", None)
            if prefix is None and path not in (None, "", ".", "/"):
                prefix = str(path).rstrip("/") + "/"
            out = []
            for k, r in zip(sorted(coll), records):
                if prefix is not None and not k.startswith(str(prefix)):
                    continue
                if all(r.get(f) == v for f, v in filters.items() if f in r):
                    out.append(r)
            return {"count": len(out), "items": out}
        if key is None:
            raise StateError(f"which {collection}? give its id")
        if key not in coll:
            raise StateError(f"{collection} {key!r} not found")
        if op == "read":
            return coll[key]
        if op == "update":
            coll[key] = {**coll[key], **args}
            return {"status": "updated", "id": key, "record": coll[key]}
        if op == "delete":
            del coll[key]
            return {"status": "deleted", "id": key}
        raise ValueError(f"unknown op {op!r}")

    def merge(self, updates: Any) -> None:
        """Apply an LLM simulator's `{"collection": {"key": record or null}}` updates (null deletes)."""
        if not isinstance(updates, dict):
            return
        for collection, recs in updates.items():
            if not isinstance(recs, dict):
                continue
            coll = self.collections.setdefault(str(collection), {})
            for key, rec in recs.items():
                if rec is None:
                    coll.pop(str(key), None)
                elif isinstance(rec, dict):
                    coll[str(key)] = rec

    def knows(self, collection: str) -> bool:
        """Whether anything was ever created in `collection` (then reads of absent ids are errors; before,
        the simulator asks the LLM: `get_weather` reads a world the store does not model)."""
        return collection in self.collections

    def snapshot(self) -> dict[str, dict[str, dict[str, Any]]]:
        return json.loads(json.dumps({c: r for c, r in self.collections.items() if r}, sort_keys=True))

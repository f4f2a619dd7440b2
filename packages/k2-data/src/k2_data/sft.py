"""Tokenize chat conversations for supervised fine-tuning (SFT) into shards plus a `manifest.json`.

Inputs: JSONL (one record per line), Parquet and Arrow IPC files whose records are
`{"messages": [OpenAI chat messages, tool_calls included], "tools": [OpenAI tools, optional]}` (field
names configurable; either field may also hold its list as a JSON string, as some datasets store it).
Tool-call ids are first renamed to `functions.NAME:IDX` (`normalize_tool_call_ids`; `normalize_ids=False`
keeps them), then each record is validated (`k2_data.chat.validate_conversation`) and rendered in the Kimi
K2 chat format by `render_ids_with_mask` (`template`: k2's own rendering or a released template); a shard row holds `input_ids` list<int32>, `loss_mask` list<uint8> (1 on the
tokens of assistant turns and their `<|im_end|>`), `doc_id` and `source` (`path:line` or `path#row`).

Planning, shard writing (temporary name + rename), resume, the worker pool and the manifest are
`k2_data.ingest`'s; the manifest adds `"kind": "chat"` and `num_trained_tokens`. A bad record (invalid
JSON, no messages, a conversation that fails validation) is reported with file and line (or row) and
skipped (`on_error="skip"`, the default: it is never trained on) or fails the run (`on_error="fail"`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k2_data.chat import K2_TEMPLATE, normalize_tool_call_ids, render_ids_with_mask, validate_conversation
from k2_data.chat.render import check_template
from k2_data.corpus import expand_inputs, file_kind
from k2_data.ingest import (
    CHAT_SHARD_SCHEMA,
    BadRecordError,
    ShardTask,
    _build_table,
    _get_tokenizer,
    _manifest,
    _prepare_run,
    _run_shards,
    _shard_name,
    _write_shard,
    read_records,
)


@dataclass
class ChatTokenizeConfig:
    messages_field: str = "messages"
    tools_field: str = "tools"
    format: str = "arrow"  # "arrow" (IPC file, memory-mappable) or "parquet"
    shard_bytes: int = 16 << 20  # input bytes per shard, about
    workers: int = 1
    on_error: str = "skip"  # "skip" (listed in the manifest, never trained on) or "fail"
    template: str = (
        K2_TEMPLATE  # the chat template rendered: "k2", "kimi-k2-instruct-0905", "kimi-k2-thinking"
    )
    normalize_ids: bool = True  # rename tool-call ids to functions.NAME:IDX first (normalize_tool_call_ids)

    def validate(self) -> None:
        if self.format not in ("arrow", "parquet"):
            raise ValueError(f"format must be 'arrow' or 'parquet', got {self.format!r}")
        if self.on_error not in ("fail", "skip"):
            raise ValueError(f"on_error must be 'fail' or 'skip', got {self.on_error!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.shard_bytes < 1:
            raise ValueError(f"shard_bytes must be >= 1, got {self.shard_bytes}")
        check_template(self.template)
        if not self.messages_field or not self.tools_field:
            raise ValueError("messages_field and tools_field must be non-empty")


def _drop_nulls(value: Any) -> Any:
    # an Arrow struct column has every field of every row's objects, null where a row lacks it; the
    # conversation as written had no such keys (a tool's JSON schema would otherwise gain "enum": null)
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _field(rec: dict, name: str, required: bool) -> Any:
    value = rec.get(name)
    if isinstance(value, str):  # a list stored as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"field {name!r} is a string but not valid JSON ({e})") from None
    if value is None:
        if required:
            raise ValueError(f"no field {name!r} in the record")
        return None
    if not isinstance(value, list):
        raise ValueError(f"field {name!r} must be a list, got {type(value).__name__}")
    return value


def conversation_of(
    record: Any, config: ChatTokenizeConfig | None = None, from_table: bool = False
) -> tuple[list, list | None]:
    """`(messages, tools)` of one record, validated for training; ValueError (naming the field) if unfit."""
    config = config or ChatTokenizeConfig()
    if not isinstance(record, dict):
        raise ValueError(
            f"the record is a JSON {type(record).__name__}, expected an object with {config.messages_field!r}"
        )
    if from_table:
        record = _drop_nulls(record)
    messages = _field(record, config.messages_field, required=True)
    tools = _field(record, config.tools_field, required=False) or None
    validate_conversation(messages, tools)  # on the ids as written, so errors quote what the record says
    if config.normalize_ids:
        messages = normalize_tool_call_ids(messages)
    return messages, tools


def tokenize_chat_shard(
    task: ShardTask, tokenizer_path: str, out_dir: str, config: ChatTokenizeConfig
) -> dict:
    """Tokenize one planned shard of chat records and write it; returns its manifest entry."""
    tok = _get_tokenizer(tokenizer_path)
    ids: list[list[int]] = []
    masks: list[list[int]] = []
    doc_ids: list[int] = []
    sources: list[str] = []
    skipped: list[dict] = []
    doc_id = task.first_doc_id
    fields = [config.messages_field, config.tools_field]
    for unit in task.units:
        required = {config.messages_field: "--messages-field"}
        for source, where, rec in read_records(unit, fields, required):
            try:
                if isinstance(rec, BadRecordError):
                    raise rec
                try:
                    messages, tools = conversation_of(rec, config, from_table=unit.kind != "jsonl")
                except ValueError as e:
                    raise BadRecordError(unit.path, where, str(e)) from None
            except BadRecordError as bad:
                if config.on_error == "fail":
                    raise
                skipped.append(bad.record)
            else:
                try:
                    row_ids, row_mask = render_ids_with_mask(tok, messages, tools, template=config.template)
                except ValueError as e:  # a template's own requirement (thinking: an assistant target)
                    if config.on_error == "fail":
                        raise BadRecordError(unit.path, where, str(e)) from None
                    skipped.append(BadRecordError(unit.path, where, str(e)).record)
                    doc_id += 1
                    continue
                ids.append(row_ids)
                masks.append(row_mask)
                doc_ids.append(doc_id)
                sources.append(source)
            doc_id += 1
    table = _build_table(ids, doc_ids, sources, loss_mask=masks)
    name = _shard_name(task.index, config.format)
    meta = {
        "index": task.index,
        "file": name,
        "rows": table.num_rows,
        "tokens": sum(len(x) for x in ids),
        "trained_tokens": sum(sum(m) for m in masks),
        "first_doc_id": task.first_doc_id,
        "skipped": skipped,
    }
    _write_shard(table, Path(out_dir) / name, config.format, meta)
    return meta


def tokenize_chat(
    inputs: list[str | Path],
    out_dir: str | Path,
    tokenizer: str | Path | None = None,
    config: ChatTokenizeConfig | None = None,
    progress: Callable[[int, int, dict], None] | None = None,
) -> dict:
    """Tokenize chat records from `inputs` (JSONL/Parquet/Arrow files or directories of them) into
    `out_dir` for SFT; returns the manifest (`kind` "chat", `num_trained_tokens`, `skipped`).

    Resumable like `tokenize_corpus`: completed shards of an earlier run with the same plan are kept.
    `progress(done, total, shard_meta)` is called after each shard.
    """
    config = config or ChatTokenizeConfig()
    config.validate()
    if not inputs:
        raise ValueError("no inputs: give JSONL, Parquet or Arrow files (or directories of them)")
    files = expand_inputs(inputs)
    for path in files:
        if file_kind(path) == "text":
            raise ValueError(
                f"{path}: chat records must be JSONL (.jsonl), Parquet (.parquet) or Arrow (.arrow) files"
            )
    settings = ["chat", config.messages_field, config.tools_field, config.format, config.shard_bytes]
    if config.template != K2_TEMPLATE or not config.normalize_ids:  # earlier runs' plans stay valid
        settings += [config.template, config.normalize_ids]
    run = _prepare_run(files, out_dir, tokenizer, config.shard_bytes, settings)
    work = functools.partial(
        tokenize_chat_shard, tokenizer_path=run.tok_path, out_dir=str(run.out), config=config
    )
    shards, elapsed = _run_shards(run, config.format, config.workers, work, progress)
    return _manifest(
        run,
        config.format,
        CHAT_SHARD_SCHEMA,
        [str(p) for p in inputs],
        shards,
        elapsed,
        kind="chat",
        messages_field=config.messages_field,
        tools_field=config.tools_field,
        encoder=f"{run.tok.kind} via k2_data.chat.render_ids_with_mask",
        chat_template=config.template,
        normalize_ids=config.normalize_ids,
        num_trained_tokens=sum(s["trained_tokens"] for s in shards),
    )


__all__ = ["ChatTokenizeConfig", "conversation_of", "tokenize_chat", "tokenize_chat_shard"]

"""The resumable rephrasing pipeline: documents -> chunks -> rewrites checked for fidelity -> shards.

Layout of `out_dir`:
    shard-00000.parquet ...      one row per (document, round): `text` (the rewrite) + provenance columns
    .k2-rephrase/run.json        the settings and input plan the directory belongs to
    .k2-rephrase/journal/*.jsonl completed chunks of shards not yet written (append-only)
    .k2-rephrase/cache.sqlite    the request cache (unless `cache` points elsewhere)
    .k2-rephrase/manifest.json   counts, fidelity pass rates, throughput of the last run
The dot-directory keeps `k2 data tokenize out_dir` from reading bookkeeping files as documents.

Resumability, the datatrove way (completion markers) at two grains: a finished shard is its atomically
renamed file; inside an unfinished shard every finished chunk is one journal line, written before the
next chunk of its document is requested. A restart skips written shards, replays the journals and
continues each document at its first unfinished chunk, so no completed chunk is requested again and no
record is lost or duplicated (a torn last journal line, from a kill mid-write, is dropped).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import pyarrow as pa

from k2_data.rephrase import prompts as P
from k2_data.rephrase.chunking import Chunk, approx_tokens, chunk_text, stitch
from k2_data.rephrase.fidelity import AsyncSimilarity, FidelityConfig, FidelityReport, check
from k2_data.rephrase.judge import judge as run_judge
from k2_data.shards import atomic_json, write_table_atomic

STATE_DIR = ".k2-rephrase"
MAX_ROUNDS = 2  # K2: at most two rephrasings per corpus
SCHEMA = pa.schema(
    [
        pa.field("text", pa.string()),  # the document after rephrasing
        pa.field("doc_id", pa.int64()),
        pa.field("source", pa.string()),  # path:line or path#row of the input record
        pa.field("source_sha256", pa.string()),
        pa.field("round", pa.int32()),
        pa.field("kind", pa.string()),  # knowledge | math | translate
        pa.field("prompt_id", pa.string()),
        pa.field("model", pa.string()),
        pa.field("chunk_spans", pa.list_(pa.struct([("start", pa.int64()), ("end", pa.int64())]))),
        pa.field("chunk_accepted", pa.list_(pa.bool_())),
        pa.field("chunk_attempts", pa.list_(pa.int32())),
        pa.field("chunk_similarity", pa.list_(pa.float32())),
        pa.field("accepted_chunks", pa.int32()),
        pa.field("all_accepted", pa.bool_()),
        pa.field("fidelity", pa.string()),  # JSON: every attempt's report, per chunk
    ]
)


@dataclass
class RephraseConfig:
    """Settings of a run. Everything that changes the output is in `fingerprint()`: resuming a directory
    with different settings is an error, not a silent mix."""

    model: str
    rounds: int = 1
    mode: str = "knowledge"  # "knowledge" or "math" (learning notes; non-English math is translated)
    chunk_tokens: int = 256
    seed: int = 0
    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int | None = None  # per chunk request; default 2 * chunk_tokens + 64
    reject_retries: int = 1  # new samples after a failed check, before the chunk keeps its source text
    fidelity: FidelityConfig = field(default_factory=FidelityConfig)
    judge_model: str | None = None  # the optional LLM judge (same endpoint)
    prompts_dir: str | None = None  # None: the shipped library
    text_field: str = "text"
    format: str = "parquet"
    shard_docs: int = 256
    concurrency: int = 32  # requests in flight
    limit: int | None = None  # first N documents only
    tokenizer: str | None = None  # token counts for chunking; None: words x 4/3

    def validate(self) -> None:
        if not self.model:
            raise ValueError("model: a model name is required (--model)")
        if not 1 <= self.rounds <= MAX_ROUNDS:
            raise ValueError(
                f"rounds must be 1..{MAX_ROUNDS} (K2 rephrases a corpus at most twice), got {self.rounds}"
            )
        if self.mode not in ("knowledge", "math"):
            raise ValueError(f"mode must be 'knowledge' or 'math', got {self.mode!r}")
        if self.format not in ("parquet", "arrow"):
            raise ValueError(f"format must be 'parquet' or 'arrow', got {self.format!r}")
        for name in ("chunk_tokens", "shard_docs", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.reject_retries < 0:
            raise ValueError(f"reject_retries must be >= 0, got {self.reject_retries}")
        self.fidelity.validate()

    def fingerprint(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for transient in ("concurrency", "limit"):  # they change speed or how far, not what a row holds
            d.pop(transient)
        return d


@dataclass
class Document:
    doc_id: int
    source: str
    text: str
    kind: str = "knowledge"


# ----------------------------------------------------------------------------- inputs


def default_corpus() -> Path:
    """The small shipped corpus: knowledge paragraphs and math documents (English, French, German, Chinese)."""
    return Path(str(resources.files("k2_data.rephrase") / "corpus" / "default.jsonl"))


def plan_documents(
    inputs: list[str] | None, config: RephraseConfig
) -> tuple[list[list[Document]], list[dict]]:
    """Shards of documents (`shard_docs` each, doc ids in input order) and the skipped records.

    Inputs as `k2 data tokenize` takes them: text files (one document each), JSONL / Parquet / Arrow with
    `text_field`. No inputs: the shipped corpus, its documents of the run's mode."""
    from k2_data.corpus import expand_inputs
    from k2_data.ingest import BadRecordError, _read_unit, plan_shards

    files = expand_inputs(inputs) if inputs else [default_corpus()]
    tasks = plan_shards(files, shard_bytes=1 << 62)
    docs: list[Document] = []
    skipped: list[dict] = []
    only_kind = None if inputs else config.mode
    full = False
    for task in tasks:
        if full:
            break
        for unit in task.units:
            if full:
                break
            kinds = _kinds_of(unit) if only_kind else None
            for i, (source, text) in enumerate(_read_unit(unit, config.text_field)):
                if isinstance(text, BadRecordError):
                    skipped.append(text.record)
                    continue
                if kinds is not None and kinds[i] != only_kind:
                    continue
                if not text.strip():
                    skipped.append({"file": unit.path, "where": source, "reason": "empty text"})
                    continue
                docs.append(Document(len(docs), source, text))
                if config.limit is not None and len(docs) >= config.limit:
                    full = True
                    break
    shards = [docs[i : i + config.shard_docs] for i in range(0, len(docs), config.shard_docs)]
    return shards, skipped


def _kinds_of(unit: Any) -> list[str]:
    """The shipped corpus's `kind` field, line by line."""
    with open(unit.path, encoding="utf-8") as f:
        return [json.loads(line).get("kind", "knowledge") for line in f if line.strip()]


# ----------------------------------------------------------------------------- journal


class Journal:
    """Append-only JSONL of finished chunks for one shard; each line is one `write()` so a kill leaves at
    most a torn last line, which `load` drops (and truncates away before appending)."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[tuple[int, int], dict[int, dict]] = {}
        if path.exists():
            self._load()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "ab")

    def _load(self) -> None:
        data = self.path.read_bytes()
        good = 0
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                break
            self.entries.setdefault((e["doc_id"], e["round"]), {})[e["chunk"]] = e
            good += len(line)
        if good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)

    def add(self, entry: dict) -> None:
        self.entries.setdefault((entry["doc_id"], entry["round"]), {})[entry["chunk"]] = entry
        self._f.write((json.dumps(entry, ensure_ascii=False) + "\n").encode())
        self._f.flush()  # in the OS after this: a killed process loses nothing written

    def done(self, doc_id: int, round_: int) -> dict[int, dict]:
        return self.entries.get((doc_id, round_), {})

    def close(self, delete: bool = False) -> None:
        self._f.close()
        if delete:
            self.path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- shards


def shard_name(index: int, fmt: str) -> str:
    return f"shard-{index:05d}.{'parquet' if fmt == 'parquet' else 'arrow'}"


def write_shard(rows: list[dict], path: Path, fmt: str, meta: dict) -> None:
    """Rows to `path` via a temporary file and a rename: a crash never leaves a half-written shard."""
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    write_table_atomic(table, path, fmt, b"k2_data.rephrase", meta)


def read_rows(out_dir: str | Path) -> list[dict]:
    """Every row of every shard in `out_dir`, in shard order (for tests and inspection)."""
    rows: list[dict] = []
    for path in sorted(Path(out_dir).glob("shard-*")):
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            rows.extend(pq.read_table(path).to_pylist())
        else:
            with pa.memory_map(str(path)) as src:
                rows.extend(pa.ipc.open_file(src).read_all().to_pylist())
    return rows


# ----------------------------------------------------------------------------- the run


@dataclass
class Counters:
    docs_total: int = 0  # (document, round) pairs
    docs_done: int = 0
    docs_resumed: int = 0  # finished before this run (written shards or fully journaled)
    chunks: int = 0
    chunks_resumed: int = 0  # read from journals instead of requested
    chunks_accepted: int = 0
    chunks_first_try: int = 0  # accepted at attempt 1
    chunks_kept_source: int = 0
    chunks_request_failed: int = 0
    first_request_error: str | None = None  # the server's answer to the first failed request
    attempts: int = 0
    rejections: dict[str, int] = field(default_factory=dict)  # reason kind -> count
    similarity_sum: float = 0.0
    similarity_n: int = 0
    judge_calls: int = 0


def _seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256("\0".join(map(str, parts)).encode()).digest()[:4], "little") >> 1


def _clean(content: str) -> str:
    """The rewrite without tags a model may echo from the prompt."""
    text = content.strip()
    for tag in ("passage", "rewrite"):
        if text.startswith(f"<{tag}>") and text.endswith(f"</{tag}>"):
            text = text[len(tag) + 2 : -(len(tag) + 3)].strip()
    return text


class Rephraser:
    """One run: `await run()` over the planned shards with one async client."""

    def __init__(
        self,
        config: RephraseConfig,
        client: Any,
        out_dir: Path,
        shards: list[list[Document]],
        similarity: Callable | None,
        progress: Callable[[Counters], None] | None = None,
    ):
        self.cfg, self.client, self.out, self.shards = config, client, out_dir, shards
        self.similarity = similarity
        self.progress = progress or (lambda c: None)
        self.prompts = P.load_prompts(config.prompts_dir)
        kinds = ["math", "translate"] if config.mode == "math" else ["knowledge"]
        self.library = {k: P.of_kind(self.prompts, k) for k in kinds}
        if config.tokenizer:
            from k2_data.tokenizer import load_tokenizer

            tok = load_tokenizer(config.tokenizer)
            self.count: Callable[[str], int] = lambda s: len(tok.encode(s))
        else:
            self.count = approx_tokens
        self.counters = Counters()
        self.max_tokens = config.max_tokens or 2 * config.chunk_tokens + 64

    def kind_of(self, doc: Document) -> str:
        if self.cfg.mode == "knowledge":
            return "knowledge"
        return "math" if P.looks_english(doc.text) else "translate"

    async def run(self) -> Counters:
        c = self.counters
        c.docs_total = sum(len(s) for s in self.shards) * self.cfg.rounds
        slots = asyncio.Semaphore(self.cfg.concurrency * 2)  # documents in flight: enough to fill the client
        writers: list[asyncio.Task] = []
        error: list[BaseException] = []

        def on_done(task: asyncio.Task) -> None:
            slots.release()
            if not task.cancelled() and task.exception() is not None and not error:
                error.append(task.exception())

        for index, docs in enumerate(self.shards):
            if error:
                break
            path = self.out / shard_name(index, self.cfg.format)
            if path.exists():
                c.docs_done += len(docs) * self.cfg.rounds
                c.docs_resumed += len(docs) * self.cfg.rounds
                self.progress(c)
                continue
            journal = Journal(self.out / STATE_DIR / "journal" / f"shard-{index:05d}.jsonl")
            tasks = []
            for doc in docs:
                for r in range(self.cfg.rounds):
                    await slots.acquire()
                    if error:  # stop feeding documents once one failed
                        slots.release()
                        break
                    t = asyncio.ensure_future(self._doc(doc, r, journal))
                    t.add_done_callback(on_done)
                    tasks.append(t)
            writers.append(asyncio.ensure_future(self._finish_shard(index, docs, tasks, journal, path)))
        try:
            await asyncio.gather(*writers)
        except BaseException:
            for w in writers:
                w.cancel()
            await asyncio.gather(*writers, return_exceptions=True)
            raise
        return c

    async def _finish_shard(
        self, index: int, docs: list[Document], tasks: list, journal: Journal, path: Path
    ) -> None:
        try:
            rows = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            journal.close()
            raise
        meta = {"shard": index, "rows": len(rows), "first_doc_id": docs[0].doc_id if docs else None}
        await asyncio.to_thread(write_shard, list(rows), path, self.cfg.format, meta)
        journal.close(delete=True)

    async def _doc(self, doc: Document, round_: int, journal: Journal) -> dict:
        cfg, c = self.cfg, self.counters
        kind = self.kind_of(doc)
        prompt = P.choose(self.library[kind], cfg.seed, doc.source, round_)
        chunks = chunk_text(doc.text, cfg.chunk_tokens, self.count)
        done = journal.done(doc.doc_id, round_)
        if len(done) == len(chunks):
            c.docs_resumed += 1
        entries: list[dict] = []
        for i, chunk in enumerate(chunks):
            if i in done:
                entries.append(done[i])
                c.chunks_resumed += 1
                c.chunks += 1
                continue
            prev_src = chunks[i - 1].text if i else ""
            prev_rw = entries[i - 1]["rewrite"] if i else ""
            entry = await self._chunk(doc, round_, kind, prompt, i, chunk, prev_src, prev_rw)
            journal.add(entry)
            entries.append(entry)
        c.docs_done += 1
        self.progress(c)
        return self._row(doc, round_, kind, prompt, chunks, entries)

    async def _chunk(
        self,
        doc: Document,
        round_: int,
        kind: str,
        prompt: P.Prompt,
        i: int,
        chunk: Chunk,
        prev_src: str,
        prev_rw: str,
    ) -> dict:
        from k2_data.agent.client import EndpointError

        cfg, c = self.cfg, self.counters
        msgs = P.messages(prompt, chunk.text, prev_src, prev_rw)
        fid = cfg.fidelity
        if kind == "math":  # notes may work out intermediate values; formulas and source numbers must stay
            fid = dataclasses.replace(fid, allow_added_numbers=True)
        attempts: list[dict] = []
        accepted_text = None
        for attempt in range(cfg.reject_retries + 1):
            req = {
                "model": cfg.model,
                "messages": msgs,
                "temperature": cfg.temperature,
                "top_p": cfg.top_p,
                "max_tokens": self.max_tokens,
                "seed": _seed(cfg.seed, doc.source, round_, i, attempt),
            }
            c.attempts += 1
            try:
                resp = await self.client(req)
            except EndpointError as e:
                if e.status is None or e.status >= 500 or e.status == 429:
                    raise  # the endpoint is down: stop (the run resumes where it stopped)
                c.chunks_request_failed += 1
                c.first_request_error = c.first_request_error or str(e)
                c.rejections["request failed"] = c.rejections.get("request failed", 0) + 1
                attempts.append({"attempt": attempt, "passed": False, "reasons": [f"request failed: {e}"]})
                break  # a 4xx for this request will not change on a resample
            choice = resp["choices"][0]
            rewrite = _clean((choice.get("message") or {}).get("content") or "")
            sim = None
            if self.similarity is not None and kind != "translate" and rewrite:
                sim = await self.similarity(chunk.text, rewrite)
                c.similarity_sum += sim
                c.similarity_n += 1
            report = check(chunk.text, rewrite, context=prev_src, config=fid, kind=kind, similarity=sim)
            if choice.get("finish_reason") == "length":
                report.fail(f"truncated at max_tokens={self.max_tokens}")
            if report.passed and cfg.judge_model:
                c.judge_calls += 1
                ok, verdict = await run_judge(
                    self.client,
                    cfg.judge_model,
                    chunk.text,
                    rewrite,
                    kind,
                    _seed("judge", doc.source, round_, i, attempt),
                )
                report.judge = verdict
                if not ok:
                    report.fail(f"judge: {verdict}")
            for reason in report.reasons:
                c.rejections[_reason_kind(reason)] = c.rejections.get(_reason_kind(reason), 0) + 1
            attempts.append({"attempt": attempt, "rewrite": rewrite, **_report(report)})
            if report.passed:
                accepted_text = rewrite
                break
        c.chunks += 1
        if accepted_text is not None:
            c.chunks_accepted += 1
            c.chunks_first_try += len(attempts) == 1
        else:
            c.chunks_kept_source += 1
        return {
            "doc_id": doc.doc_id,
            "round": round_,
            "chunk": i,
            "start": chunk.start,
            "end": chunk.end,
            "accepted": accepted_text is not None,
            "rewrite": accepted_text if accepted_text is not None else chunk.text,
            "similarity": next(
                (a.get("similarity") for a in reversed(attempts) if a.get("similarity") is not None), None
            ),
            "attempts": attempts,
        }

    def _row(
        self,
        doc: Document,
        round_: int,
        kind: str,
        prompt: P.Prompt,
        chunks: list[Chunk],
        entries: list[dict],
    ) -> dict:
        accepted = [bool(e["accepted"]) for e in entries]
        return {
            "text": stitch(doc.text, chunks, [e["rewrite"] for e in entries]),
            "doc_id": doc.doc_id,
            "source": doc.source,
            "source_sha256": hashlib.sha256(doc.text.encode()).hexdigest(),
            "round": round_,
            "kind": kind,
            "prompt_id": prompt.id,
            "model": self.cfg.model,
            "chunk_spans": [{"start": e["start"], "end": e["end"]} for e in entries],
            "chunk_accepted": accepted,
            "chunk_attempts": [len(e["attempts"]) for e in entries],
            "chunk_similarity": [e["similarity"] for e in entries],
            "accepted_chunks": sum(accepted),
            "all_accepted": all(accepted),
            "fidelity": json.dumps([e["attempts"] for e in entries], ensure_ascii=False),
        }


def _reason_kind(reason: str) -> str:
    """ "numbers missing: 12" -> "numbers missing"; "similarity 0.41 < 0.7" -> "similarity"."""
    head = reason.split(":")[0].split("(")[0].strip()
    words = head.split()
    return " ".join(words[:2]) if words[0] in ("numbers", "formulas", "entities") else words[0]


def _report(r: FidelityReport) -> dict:
    d = r.as_dict()
    return {k: v for k, v in d.items() if v not in ([], None)} | {"passed": r.passed}


# ----------------------------------------------------------------------------- entry point


def _check_run_dir(
    out_dir: Path, config: RephraseConfig, shards: list[list[Document]], overwrite: bool
) -> None:
    """Refuse to resume a directory written with other settings or inputs (or clear it with `overwrite`)."""
    plan = hashlib.sha256(
        json.dumps(
            [[(d.source, hashlib.sha256(d.text.encode()).hexdigest()) for d in s] for s in shards]
        ).encode()
    ).hexdigest()
    run = {"config": config.fingerprint(), "plan_sha256": plan}
    path = out_dir / STATE_DIR / "run.json"
    if path.exists() and not overwrite:
        old = json.loads(path.read_text())
        if old != run:
            diff = sorted(
                k
                for k in set(old.get("config", {})) | set(run["config"])
                if old.get("config", {}).get(k) != run["config"].get(k)
            )
            what = f"settings differ ({', '.join(diff)})" if diff else "the inputs differ"
            raise ValueError(
                f"{out_dir} holds a rephrase run with other settings: {what}; use a new --out or --overwrite"
            )
    elif overwrite:
        for p in out_dir.glob("shard-*"):
            p.unlink()
        for p in (out_dir / STATE_DIR / "journal").glob("*.jsonl"):
            p.unlink()
    atomic_json(path, run)


def rephrase(
    inputs: list[str] | None,
    out_dir: str | Path,
    *,
    base_url: str,
    config: RephraseConfig,
    api_key: str | None = None,
    cache: str | Path | None = None,
    timeout_s: float = 120.0,
    max_retries: int = 4,
    backoff_s: float = 0.5,
    overwrite: bool = False,
    progress: bool | Callable[[Counters], None] = False,
    client: Any = None,
) -> dict:
    """Rephrase `inputs` (None: the shipped corpus) into shards in `out_dir`; returns the manifest.

    Resumable: rerun the same call after a crash or kill and it continues. `cache` defaults to
    `out_dir/.k2-rephrase/cache.sqlite`; `client` replaces the HTTP client (any async callable)."""
    config.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards, skipped = plan_documents(inputs, config)
    _check_run_dir(out, config, shards, overwrite)
    embedder = None
    if config.fidelity.min_similarity > 0:
        from k2_data.embed import load_embedder

        embedder = load_embedder()
    endpoint = _Endpoint(base_url, api_key, Path(cache) if cache else None, timeout_s, max_retries, backoff_s)
    return asyncio.run(_arun(_Run(out, config, shards, skipped, endpoint, progress, client, embedder)))


@dataclass(frozen=True)
class _Endpoint:
    """Where the requests go and how they are retried and cached (the run's own HTTP client)."""

    base_url: str
    api_key: str | None
    cache: Path | None  # None: OUT/.k2-rephrase/cache.sqlite
    timeout_s: float
    max_retries: int
    backoff_s: float


@dataclass
class _Run:
    """Everything one `rephrase` call hands to its event loop."""

    out: Path
    config: RephraseConfig
    shards: list[list[Document]]
    skipped: list
    endpoint: _Endpoint
    progress: bool | Callable[[Counters], None]
    client: Any  # None: an AsyncHTTPChatClient for `endpoint`, closed at the end
    embedder: Any  # None: no similarity check


async def _arun(run: _Run) -> dict:
    from k2_data.agent.client import AsyncHTTPChatClient, ClientStats

    out, config, progress, ep = run.out, run.config, run.progress, run.endpoint
    client, own = run.client, run.client is None
    if own:
        client = AsyncHTTPChatClient(
            ep.base_url,
            ep.api_key,
            max_concurrency=config.concurrency,
            cache=ep.cache or out / STATE_DIR / "cache.sqlite",
            timeout_s=ep.timeout_s,
            max_retries=ep.max_retries,
            backoff_s=ep.backoff_s,
        )
    stats: ClientStats = getattr(client, "stats", ClientStats())
    sim = AsyncSimilarity(run.embedder) if run.embedder is not None else None
    bar = _ProgressBar(stats) if progress is True else None
    hook = bar.update if bar else (progress if callable(progress) else None)
    t0 = time.perf_counter()
    try:
        runner = Rephraser(config, client, out, run.shards, sim, hook)
        counters = await runner.run()
    finally:
        if bar:
            bar.close()
        if own:
            await client.aclose()
    dt = time.perf_counter() - t0
    manifest = _manifest(out, config, counters, stats, run.skipped, dt, ep.base_url)
    atomic_json(out / STATE_DIR / "manifest.json", manifest)
    return manifest


def _manifest(
    out: Path, config: RephraseConfig, c: Counters, stats: Any, skipped: list, dt: float, base_url: str
) -> dict:
    new_docs = c.docs_done - c.docs_resumed
    new_chunks = max(c.chunks - c.chunks_resumed, 0)
    return {
        "out": str(out),
        "model": config.model,
        "base_url": base_url,
        "mode": config.mode,
        "rounds": config.rounds,
        "shards": sorted(p.name for p in out.glob("shard-*")),
        "documents": c.docs_total,
        "documents_resumed": c.docs_resumed,
        "chunks": c.chunks,
        "chunks_resumed": c.chunks_resumed,
        "chunks_accepted": c.chunks_accepted,
        "chunks_kept_source": c.chunks_kept_source,
        "chunks_request_failed": c.chunks_request_failed,
        "first_request_error": c.first_request_error,
        "pass_rate_first_attempt": c.chunks_first_try / new_chunks if new_chunks else None,
        "pass_rate_final": c.chunks_accepted / new_chunks if new_chunks else None,
        "attempts": c.attempts,
        "rejections": dict(sorted(c.rejections.items())),
        "similarity_mean": c.similarity_sum / c.similarity_n if c.similarity_n else None,
        "judge_calls": c.judge_calls,
        "client": stats.as_dict(),
        "seconds": dt,
        "documents_per_s": new_docs / dt if dt > 0 else None,
        "completion_tokens_per_s": stats.completion_tokens / dt if dt > 0 else None,
        "skipped": skipped,
        "config": config.fingerprint(),
    }


class _ProgressBar:
    def __init__(self, stats: Any):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.stats = stats
        self.p = Progress(
            TextColumn("rephrase"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            transient=True,
        )
        self.task = self.p.add_task("docs", total=None, info="")
        self.p.start()

    def update(self, c: Counters) -> None:
        s = self.stats
        acc = c.chunks_accepted / max(c.chunks - c.chunks_resumed, 1)
        info = (
            f"chunks {c.chunks} ({acc:.0%} accepted) | cache hits {s.hit_rate:.0%} | in flight {s.in_flight}"
        )
        self.p.update(self.task, completed=c.docs_done, total=c.docs_total, info=info)

    def close(self) -> None:
        self.p.stop()


def iter_journal(path: str | Path) -> Iterator[dict]:
    """The entries of a journal file (complete lines only)."""
    with open(path, "rb") as f:
        for line in f:
            if line.endswith(b"\n"):
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    return

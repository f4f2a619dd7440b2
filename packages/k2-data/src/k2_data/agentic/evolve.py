"""Synthetic tools by hierarchical domain evolution (K2 section 3.6.1): categories -> application domains ->
tools with JSON-Schema parameters, through the one synthesis client.

    entries, report = await evolve_tools(client, "teacher", EvolveConfig(n_tools=32), existing=repo.entries)

1. categories: the LLM proposes `categories` broad categories of software tools (`{"categories": [{"name",
   "description"}]}`);
2. domains: for each category, `domains_per_category` specific application domains, told the sibling
   domains already proposed so the tree spreads out instead of repeating itself;
3. tools: for each domain, `tools_per_domain` tools (`{"tools": [{"name", "description", "parameters"}]}`),
   told the domain's place in the tree and the tools already in the repository with names alike.
Every answer goes through `ask_json` (the request cache; a reply without JSON is re-asked once, then the
node is skipped and counted). Then:
- schema check: each tool's `parameters` must pass jsonschema's meta-schema check (`check_schema` of the
  validator its `$schema` names, Draft 2020-12 by default) and be an object schema with a valid tool name
  (`tool_from_spec`); the rest are dropped and counted (`invalid_schema`, `invalid_spec`);
- near-duplicates: `NAME words: description` of every tool is embedded with the offline MiniLM embedder
  (`k2_data.embed`), and a new tool whose cosine similarity to a tool already kept (the existing
  repository's first, then earlier synthetic ones, in generation order) is >= `dedup_threshold` is dropped
  and counted with the pair (`near_duplicates`); exact name clashes count as `name_duplicates`;
- refill: while fewer than `n_tools` survive and `refill_rounds` remain, every domain is asked again for
  its share of the shortfall (plus a quarter), told the tools kept so far, with a new seed; the answers
  go through the same checks against everything kept. A round that keeps nothing new ends the refill
  (the teacher has run out of distinct tools for this tree);
- the first `n_tools` survivors are returned as repository entries with source `synthetic`, category the
  category and domain `CATEGORY/DOMAIN`.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from k2_data.agent.tools import tool_from_spec
from k2_data.agentic.llm import ask_json

CATEGORY_SYSTEM = (
    "You design the catalogue of software tools that AI agents can call. Propose broad, distinct categories "
    'of real-world applications. Answer with one JSON object {"categories": [{"name": <2-4 words>, '
    '"description": <one sentence>}]}.'
)
DOMAIN_SYSTEM = (
    "You design the catalogue of software tools that AI agents can call. Given a category, propose specific "
    "application domains inside it (a product or service someone would build an API for), different from "
    'the domains already listed. Answer with one JSON object {"domains": [{"name": <2-5 words>, '
    '"description": <one sentence>}]}.'
)
TOOL_SYSTEM = (
    "You write the function-calling tools of one application domain, as an API designer would: each tool "
    "does one thing, has a snake_case name, a one-sentence description and parameters as a JSON Schema "
    "object (type, properties with types and descriptions, required). Do not repeat the existing tools. "
    'Answer with one JSON object {"tools": [{"name": ..., "description": ..., "parameters": {...}}]}.'
)


@dataclass
class EvolveConfig:
    n_tools: int  # how many synthetic tools to keep (at most)
    categories: int = 4
    domains_per_category: int = 2
    tools_per_domain: int | None = None  # default: enough for n_tools, plus a quarter for the filters
    dedup_threshold: float = 0.85  # cosine similarity at or above which a tool is a near-duplicate
    refill_rounds: int = 2  # extra rounds of tool requests while fewer than n_tools survive the filters
    seed: int = 0
    max_tokens: int = 2048
    concurrency: int = 8  # domains (and their tool requests) in flight

    def per_domain(self) -> int:
        if self.tools_per_domain is not None:
            return self.tools_per_domain
        return max(1, math.ceil(1.25 * self.n_tools / (self.categories * self.domains_per_category)))

    def validate(self) -> None:
        if self.n_tools < 1 or self.categories < 1 or self.domains_per_category < 1 or self.per_domain() < 1:
            raise ValueError("n_tools, categories, domains_per_category and tools_per_domain must be >= 1")
        if self.refill_rounds < 0:
            raise ValueError(f"refill_rounds must be >= 0, got {self.refill_rounds}")
        if not 0 < self.dedup_threshold <= 1:
            raise ValueError(f"dedup_threshold must be in (0, 1], got {self.dedup_threshold}")


@dataclass
class EvolveReport:
    categories: list[str] = field(default_factory=list)
    domains: list[str] = field(default_factory=list)  # CATEGORY/DOMAIN
    proposed: int = 0  # tool objects the LLM wrote
    invalid_schema: int = 0  # parameters failing the meta-schema check
    invalid_spec: int = 0  # not a usable tool (no name, bad name, parameters not an object schema, ...)
    name_duplicates: int = 0  # a name already in the repository or proposed before
    near_duplicates: int = 0  # dropped by embedding similarity
    near_duplicate_pairs: list[tuple[str, str, float]] = field(default_factory=list)  # (dropped, kept, cos)
    over_budget: int = 0  # valid, distinct, but beyond n_tools
    kept: int = 0
    rounds: int = 0  # rounds of tool requests (1 + the refill rounds that ran)
    kept_per_round: list[int] = field(default_factory=list)  # survivors each round added
    unparsable: int = 0  # category/domain/tool answers without usable JSON (after the re-ask)
    dedup_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _names(answer: dict[str, Any] | None, key: str, k: int) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for item in (answer or {}).get(key) or []:
        if isinstance(item, str):
            item = {"name": item}
        if isinstance(item, dict) and isinstance(item.get("name"), str) and item["name"].strip():
            name = item["name"].strip().replace("/", "-")
            if name.lower() not in {n.lower() for n, _ in out}:
                out.append((name, str(item.get("description") or "").strip()))
    return out[:k]


def check_tool(raw: Any) -> tuple[dict[str, Any] | None, str]:
    """`(OpenAI spec, "")` for a valid tool object, else `(None, "invalid_schema" | "invalid_spec")`."""
    import jsonschema

    if not isinstance(raw, dict):
        return None, "invalid_spec"
    fn = raw.get("function") if isinstance(raw.get("function"), dict) else raw
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        return None, "invalid_schema"
    try:
        cls = jsonschema.validators.validator_for(params, default=jsonschema.Draft202012Validator)
        cls.check_schema(params)
    except jsonschema.exceptions.SchemaError:
        return None, "invalid_schema"
    except Exception:  # an unknown $schema URI and the like
        return None, "invalid_schema"
    if not isinstance(fn.get("description"), str) or not fn["description"].strip():
        return None, "invalid_spec"
    try:
        spec = tool_from_spec(
            {"name": fn.get("name"), "description": fn["description"].strip(), "parameters": params}
        ).spec()
    except (ValueError, TypeError, KeyError):
        return None, "invalid_spec"
    return spec, ""


def spec_name(spec: dict[str, Any]) -> str:
    """A tool's name, from an OpenAI spec or a bare function object."""
    return (spec["function"] if "function" in spec else spec)["name"]


def tool_text(spec: dict[str, Any]) -> str:
    """What is embedded for a tool: its name as words and its description."""
    fn = spec["function"] if "function" in spec else spec
    return f"{fn['name'].replace('_', ' ')}: {fn.get('description') or ''}"


def near_duplicates(
    texts_existing: list[str], texts_new: list[str], threshold: float, embedder: Any
) -> tuple[list[bool], list[tuple[int, int, float]]]:
    """Greedy filter in order: `keep[i]` for each new text (False when its cosine similarity to an existing
    text or to an earlier kept new one is >= threshold) and the `(new index, matched index, cos)` drops; a
    matched index < 0 is `-(1 + existing index)`."""
    if not texts_new:
        return [], []
    emb = embedder.embed(list(texts_existing) + list(texts_new))
    n_old = len(texts_existing)
    kept_rows = list(range(n_old))
    keep, drops = [], []
    for i in range(len(texts_new)):
        row = n_old + i
        if kept_rows:
            sims = emb[kept_rows] @ emb[row]
            j = int(sims.argmax())
            best = float(sims[j])
            if best >= threshold:
                keep.append(False)
                matched = kept_rows[j]
                drops.append((i, matched - n_old if matched >= n_old else -(1 + matched), best))
                continue
        keep.append(True)
        kept_rows.append(row)
    return keep, drops


class CachedEmbedder:
    """Embeds each distinct text once. Refill rounds compare new candidates against everything kept
    so far; without the cache every round would embed the kept tools again."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.vectors = inner, {}

    def embed(self, texts: list[str]) -> Any:
        import torch

        missing = list(dict.fromkeys(t for t in texts if t not in self.vectors))
        if missing:
            self.vectors.update(zip(missing, self.inner.embed(missing)))
        return torch.stack([torch.as_tensor(self.vectors[t]) for t in texts])


async def evolve_tools(
    client: Any,
    model: str,
    cfg: EvolveConfig,
    *,
    existing: list[Any] = (),
    embedder: Any = None,
    counters: Counter | None = None,
) -> tuple[list[dict[str, Any]], EvolveReport]:
    """Grow synthetic tools; returns `([{"spec", "source": "synthetic", "category", "domain"}], report)`.
    `existing`: repository entries (or OpenAI specs) the new tools must not duplicate. `embedder`: anything
    with `embed(texts) -> [N, D]` unit rows (default: the shared MiniLM; None is loaded only if needed)."""
    import time

    cfg.validate()
    counters = counters if counters is not None else Counter()
    report = EvolveReport()
    gate = asyncio.Semaphore(cfg.concurrency)

    async def ask(stage: str, system: str, user: str, seed: int) -> dict[str, Any] | None:
        async with gate:
            answer = await ask_json(
                client,
                model,
                stage,
                system,
                user,
                seed=seed,
                counters=counters,
                max_tokens=cfg.max_tokens,
            )
        if answer is None:
            report.unparsable += 1
        return answer

    cats = _names(
        await ask("domains", CATEGORY_SYSTEM, f"Write {cfg.categories} categories.", cfg.seed),
        "categories",
        cfg.categories,
    )
    report.categories = [c for c, _ in cats]

    async def domains_of(ci: int, cat: str, desc: str) -> list[tuple[str, str]]:
        others = ", ".join(c for c in report.categories if c != cat)
        user = (
            f"Category: {cat}\nAbout: {desc}\nOther categories (not yours): {others}\n"
            f"Write {cfg.domains_per_category} application domains."
        )
        answer = await ask("domains", DOMAIN_SYSTEM, user, cfg.seed * 7919 + 100 + ci)
        return _names(answer, "domains", cfg.domains_per_category)

    domain_lists = await asyncio.gather(*(domains_of(i, c, d) for i, (c, d) in enumerate(cats)))
    tree = [(cat, dom, desc) for (cat, _), doms in zip(cats, domain_lists) for dom, desc in doms]
    report.domains = [f"{c}/{d}" for c, d, _ in tree]

    existing_specs = [e.spec if hasattr(e, "spec") else e for e in existing]
    existing_names = [spec_name(s) for s in existing_specs]
    kept: list[dict[str, Any]] = []  # survivors of every round so far, in generation order
    seen = set(existing_names)

    async def tools_of(di: int, cat: str, dom: str, desc: str, k: int, round_: int) -> list[Any]:
        names = existing_names + [c["spec"]["function"]["name"] for c in kept]
        user = (
            f"Category: {cat}\nDomain: {dom}\nAbout: {desc}\n"
            f"Existing tools: {', '.join(names) or 'none'}\nWrite {k} tools."
        )
        seed = cfg.seed * 7919 + 10_000 + di + 100_000 * round_  # round 0 keeps the seeds it always had
        answer = await ask("tools", TOOL_SYSTEM, user, seed)
        raws = (answer or {}).get("tools")
        return raws if isinstance(raws, list) else []

    def candidates_of(raw_lists: list[list[Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for (cat, dom, _), raws in zip(tree, raw_lists):
            for raw in raws:
                report.proposed += 1
                spec, why = check_tool(raw)
                if spec is None:
                    setattr(report, why, getattr(report, why) + 1)
                    continue
                name = spec["function"]["name"]
                if name in seen:
                    report.name_duplicates += 1
                    continue
                seen.add(name)
                out.append({"spec": spec, "source": "synthetic", "category": cat, "domain": f"{cat}/{dom}"})
        return out

    def drop_near_duplicates(candidates: list[dict[str, Any]]) -> list[dict[str, Any]]:
        nonlocal embedder
        if not candidates:
            return []
        if embedder is None:
            from k2_data.embed import load_embedder

            embedder = load_embedder()
        if not isinstance(embedder, CachedEmbedder):
            embedder = CachedEmbedder(embedder)
        t0 = time.perf_counter()
        before = existing_specs + [c["spec"] for c in kept]  # compared against everything kept so far
        keep, drops = near_duplicates(
            [tool_text(s) for s in before],
            [tool_text(c["spec"]) for c in candidates],
            cfg.dedup_threshold,
            embedder,
        )
        report.dedup_seconds = round(report.dedup_seconds + time.perf_counter() - t0, 3)
        names_before = [spec_name(s) for s in before]
        for i, j, cos in drops:
            other = names_before[-(1 + j)] if j < 0 else candidates[j]["spec"]["function"]["name"]
            report.near_duplicate_pairs.append(
                (candidates[i]["spec"]["function"]["name"], other, round(cos, 4))
            )
        report.near_duplicates += len(drops)
        return [c for c, k in zip(candidates, keep) if k]

    for round_ in range(1 + cfg.refill_rounds):
        missing = cfg.n_tools - len(kept)
        if not tree or missing <= 0:
            break
        k = cfg.per_domain() if round_ == 0 else max(1, math.ceil(1.25 * missing / len(tree)))
        raw_lists = await asyncio.gather(
            *(tools_of(i, c, d, x, k, round_) for i, (c, d, x) in enumerate(tree))
        )
        new = drop_near_duplicates(candidates_of(raw_lists))
        report.rounds += 1
        report.kept_per_round.append(len(new))
        kept.extend(new)
        if round_ > 0 and not new:  # the teacher has nothing new for this tree
            break
    candidates = kept
    report.over_budget = max(0, len(candidates) - cfg.n_tools)
    out = candidates[: cfg.n_tools]
    report.kept = len(out)
    counters["tools_evolved"] += len(out)
    return out, report

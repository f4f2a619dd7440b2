"""The self-critique rubric reward (K2 section 3.7): a critic ranks a prompt's K responses pairwise
against rubrics, and the ranking becomes the rewards.

**Rubrics are data.** :func:`load_rubrics` reads the shipped files (``rubrics/core.json``: K2's
clarity and relevance, conversational fluency, objective interaction; ``rubrics/prescriptive.json``:
no initial praise, no explicit justification of its own quality) and then any user directories or
files (``.json`` or ``.toml``, ``{"kind": ..., "rubrics": [{"id", "title", "text", "patterns"?}]}``;
a user rubric with a shipped id replaces it). A task adds its own with ``task["rubrics"]``: strings
or ``{"text", "title"?, "id"?, "kind"?, "patterns"?}`` objects (kind "task" unless it says
"prescriptive").

**Pairwise, both orders.** For each of the K(K-1)/2 pairs (i, j) the critic is asked twice, once
with i as response A and once with i as B. Each answer is a JSON verdict ``{"reason",
"preferred": "A"|"B"|"tie", "violations": {"A": [...], "B": [...]}}`` (parsed leniently;
unparseable counts as a tie). Response i scores 1 for a win, 0.5 for a tie, 0 for a loss in each
order, and the pair's score ``s_ij`` is the mean of the two: a critic that names the same *position*
both times (A then A) gives 0.5, a tie. The **position-bias rate** is the share of pairs whose two
verdicts were both decisive and named the same position (a critic that always prefers the first
response: 100%); ``first_position_rate`` is the share of decisive verdicts that chose A (0.5 is
unbiased).

**Aggregation** (``aggregation=``): ``"winrate"`` (default), ``r_i = mean_j s_ij``; or ``"bt"``,
Bradley-Terry strengths fitted by Hunter's MM iterations on the 2 K(K-1)/2 verdicts, with one
virtual comparison (a half win) against a fixed player of strength 1 per response (so a response
that wins every comparison keeps a finite strength), reported as ``p_i / (p_i + 1)``, the
probability of beating that average player. Win rate is the default because all pairs are
compared: in a complete round robin BT's maximum-likelihood *order* is the order of total wins,
so BT changes only the spacing, and it diverges without a prior; the win rate is bounded in
[0, 1] like the verifiable rewards, needs no iterations, and a tie moves it by exactly 0.5/(K-1).

**Prescriptive rubrics floor the reward.** A response that violates one gets ``floor`` (default
0.0, the lowest win rate) whatever it won. Violations are detected two ways (``violations=``,
default "both"): deterministic checks, the rubric's ``patterns`` (case-insensitive regular
expressions, e.g. an opening-praise regex anchored at the response's start), which need no critic
and cannot be argued with; and the critic's own verdicts, where a response counts as violating a
rubric when at least ``vote`` (default half) of the parsed verdicts it appeared in listed it.

**Closed-loop refinement** (:meth:`RubricReward.refine`): on prompts with a verifier, the critic
judges pairs whose verifiable rewards differ; a pair agrees when the critic's both-order score
favours the verified winner (a tie or position-inconsistent answer is "undecided", which counts
against agreement). Disagreeing and undecided pairs become critic SFT records, in both orders,
with the verified verdict as the assistant turn, in the chat JSONL format ``k2 sft --data`` reads.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import tempfile
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k2_rl.rewards.base import GroupReward, register_reward

__all__ = [
    "AGGREGATIONS",
    "BUILTIN_RUBRICS",
    "GroupScores",
    "PairOutcome",
    "Refinement",
    "Rubric",
    "RubricReward",
    "Verdict",
    "bradley_terry",
    "build_request",
    "load_rubrics",
    "parse_verdict",
    "pattern_violations",
    "task_rubrics",
    "write_sft",
]

BUILTIN_RUBRICS = Path(__file__).with_name("rubrics")
KINDS = ("core", "human", "task", "prescriptive")
AGGREGATIONS = ("winrate", "bt")
VIOLATION_MODES = ("both", "patterns", "critic")


# ----------------------------------------------------------------------------- rubrics as data


@dataclass(frozen=True)
class Rubric:
    id: str
    kind: str  # "core" | "human" | "task" | "prescriptive"
    title: str
    text: str
    patterns: tuple[str, ...] = ()  # prescriptive only: deterministic checks (regex)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"rubric {self.id!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if not self.text.strip():
            raise ValueError(f"rubric {self.id!r}: empty text")
        for p in self.patterns:
            try:
                re.compile(p, re.IGNORECASE)
            except re.error as e:
                raise ValueError(f"rubric {self.id!r}: bad pattern {p!r}: {e}") from None


def _rubric_from(d: Any, default_kind: str, default_id: str, source: str) -> Rubric:
    if isinstance(d, str):
        return Rubric(default_id, default_kind, "", d)
    if not isinstance(d, dict) or "text" not in d:
        raise ValueError(f"{source}: a rubric must be a string or an object with 'text', got {d!r}")
    patterns = d.get("patterns") or ()
    if isinstance(patterns, str):
        patterns = (patterns,)
    return Rubric(
        str(d.get("id") or default_id),
        str(d.get("kind") or default_kind),
        str(d.get("title") or ""),
        str(d["text"]),
        tuple(str(p) for p in patterns),
    )


def _read_rubric_file(path: Path) -> list[Rubric]:
    try:
        data = tomllib.loads(path.read_text()) if path.suffix == ".toml" else json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"rubric file {path}: not valid {path.suffix[1:].upper()}: {e}") from None
    if isinstance(data, list):
        data = {"rubrics": data}
    kind = str(data.get("kind", "core"))
    items = data.get("rubrics")
    if not isinstance(items, list):
        raise ValueError(f"rubric file {path}: expected a 'rubrics' list")
    return [_rubric_from(d, kind, f"{path.stem}-{n}", str(path)) for n, d in enumerate(items, 1)]


def load_rubrics(*sources: str | Path, builtin: bool = True) -> list[Rubric]:
    """The shipped rubrics (unless ``builtin=False``), then those of each source: a ``.json`` or
    ``.toml`` file or a directory of them (sorted by name). A later rubric with an id already seen
    replaces the earlier one in place."""
    files: list[Path] = sorted(BUILTIN_RUBRICS.glob("*.json")) if builtin else []
    for src in sources:
        p = Path(src)
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.suffix in (".json", ".toml") and q.is_file())
            if not found:
                raise FileNotFoundError(f"rubric directory {p} has no .json or .toml files")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"rubrics {p}: no such file or directory")
    by_id: dict[str, Rubric] = {}
    for f in files:
        for r in _read_rubric_file(f):
            by_id[r.id] = r
    return list(by_id.values())


def task_rubrics(task: dict) -> list[Rubric]:
    """The rubrics a task's metadata brings (``task["rubrics"]``), kind "task" by default."""
    items = task.get("rubrics") or []
    if isinstance(items, str):
        items = [items]
    return [_rubric_from(d, "task", f"task-{n}", "task['rubrics']") for n, d in enumerate(items, 1)]


_LEADING = re.compile(r"^[\s>*_#`\"'\u201c\u2018-]+")


def pattern_violations(response: str, rubrics: Iterable[Rubric]) -> list[str]:
    """Ids of the prescriptive rubrics whose patterns match ``response`` (leading whitespace,
    quotes and markdown emphasis removed first, so ``**Great question!**`` counts)."""
    text = _LEADING.sub("", response)
    return [
        r.id
        for r in rubrics
        if r.kind == "prescriptive" and any(re.search(p, text, re.IGNORECASE) for p in r.patterns)
    ]


# ----------------------------------------------------------------------------- the critic's prompt

SYSTEM = """You are a critic. You compare two responses, A and B, to the same conversation and decide which one better serves the user.
Correctness and faithfulness to the user's request come first; then judge the responses against these rubrics.

{rubrics}

Prescriptive rubrics are hard rules: list every one a response violates, whatever else it does well. Judge content, not position or length: the order of A and B is arbitrary.
Answer with one JSON object and nothing else:
{{"reason": "<one or two sentences>", "preferred": "A" or "B" or "tie", "violations": {{"A": [<ids of the prescriptive rubrics A violates>], "B": [<ids B violates>]}}}}"""

_HEADINGS = {
    "core": "Core rubrics",
    "human": "Human-annotated rubrics",
    "task": "Task rubrics",
    "prescriptive": "Prescriptive rubrics (hard rules)",
}


def _rubric_block(rubrics: Sequence[Rubric]) -> str:
    parts = []
    for kind in ("core", "human", "task", "prescriptive"):
        rs = [r for r in rubrics if r.kind == kind]
        if rs:
            lines = [f"- [{r.id}] {r.title + ': ' if r.title else ''}{r.text}" for r in rs]
            parts.append(_HEADINGS[kind] + ":\n" + "\n".join(lines))
    return "\n\n".join(parts)


def _conversation(messages: Sequence[dict]) -> str:
    lines = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        lines.append(f"{m.get('role', 'user')}: {content or ''}")
    return "\n".join(lines)


def build_request(
    messages: Sequence[dict],
    a: str,
    b: str,
    rubrics: Sequence[Rubric],
    *,
    max_tokens: int = 256,
    temperature: float = 0.0,
    seed: int = 0,
) -> dict:
    """The chat-completions request asking the critic to compare ``a`` (as A) with ``b`` (as B)."""
    user = (
        f"[Conversation]\n{_conversation(messages)}\n[End of Conversation]\n\n"
        f"[Response A]\n{a}\n[End of Response A]\n\n"
        f"[Response B]\n{b}\n[End of Response B]"
    )
    return {
        "messages": [
            {"role": "system", "content": SYSTEM.format(rubrics=_rubric_block(rubrics))},
            {"role": "user", "content": user},
        ],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
    }


# ----------------------------------------------------------------------------- verdicts


@dataclass
class Verdict:
    preferred: str | None  # "A" | "B" | "tie"; None when the answer could not be parsed
    violations: dict[str, set[str]] = field(default_factory=lambda: {"A": set(), "B": set()})


_DECODER = json.JSONDecoder()
_FALLBACK = re.compile(
    r"(?:\"?(?:preferred|winner|verdict|better)\"?\s*[:=]?\s*\"?(?:response\s+)?|\[\[)(A|B|tie)\b", re.I
)


def _norm_choice(v: Any) -> str | None:
    s = str(v).strip().strip("[]\"'.").lower()
    s = s.removeprefix("response ").strip()
    if s in ("a", "b"):
        return s.upper()
    if s in ("tie", "equal", "both", "none", "neither", "draw"):
        return "tie"
    return None


def parse_verdict(text: str | None) -> Verdict:
    """The critic's verdict in ``text``: the last JSON object with a ``preferred`` (or ``winner``)
    field, else a ``preferred: A`` / ``[[A]]`` mention; ``preferred=None`` if neither is there."""
    if not text:
        return Verdict(None)
    found: dict | None = None
    for m in re.finditer(r"\{", text):
        try:
            obj, _ = _DECODER.raw_decode(text, m.start())
        except ValueError:
            continue
        if isinstance(obj, dict) and ("preferred" in obj or "winner" in obj):
            found = obj
    if found is not None:
        choice = _norm_choice(found.get("preferred", found.get("winner")))
        viol: dict[str, set[str]] = {"A": set(), "B": set()}
        raw = found.get("violations")
        if isinstance(raw, dict):
            for side in ("A", "B"):
                ids = raw.get(side, raw.get(side.lower(), []))
                if isinstance(ids, str):
                    ids = [ids]
                if isinstance(ids, list):
                    viol[side] = {str(x) for x in ids}
        return Verdict(choice, viol)
    matches = _FALLBACK.findall(text)
    return Verdict(_norm_choice(matches[-1]) if matches else None)


def _order_score(v: Verdict, first_is_i: bool) -> float:
    """Response i's score from one verdict: 1 win, 0.5 tie or unparseable, 0 loss."""
    if v.preferred in (None, "tie"):
        return 0.5
    return 1.0 if (v.preferred == "A") == first_is_i else 0.0


@dataclass
class PairOutcome:
    """Responses i and j compared in both orders: ``first`` has i as A, ``second`` has j as A."""

    i: int
    j: int
    first: Verdict
    second: Verdict

    @property
    def score(self) -> float:
        """i's score against j: the mean of the two orders' (1 win, 0.5 tie, 0 loss)."""
        return (_order_score(self.first, True) + _order_score(self.second, False)) / 2

    @property
    def decisive(self) -> bool:
        return self.first.preferred in ("A", "B") and self.second.preferred in ("A", "B")

    @property
    def position_inconsistent(self) -> bool:
        """Both verdicts decisive and naming the same position: the critic followed the order."""
        return self.decisive and self.first.preferred == self.second.preferred


def bradley_terry(
    wins: Sequence[Sequence[float]], prior: float = 0.5, max_iter: int = 10_000, tol: float = 1e-10
) -> list[float]:
    """Bradley-Terry strengths by Hunter's MM iterations, as win probabilities against an average
    player. ``wins[i][j]``: (fractional) wins of i over j (ties as half wins each); each item also
    has ``prior`` wins and ``prior`` losses against a virtual player of fixed strength 1, which
    anchors the scale and keeps an unbeaten item finite. Returns ``p_i / (p_i + 1)``."""
    K = len(wins)
    p = [1.0] * K
    for _ in range(max_iter):
        new = []
        for i in range(K):
            w = prior + sum(wins[i][j] for j in range(K) if j != i)
            den = 2 * prior / (p[i] + 1.0)
            den += sum((wins[i][j] + wins[j][i]) / (p[i] + p[j]) for j in range(K) if j != i)
            new.append(w / den if den > 0 else 1.0)
        delta = max((abs(math.log(a / b)) for a, b in zip(new, p)), default=0.0)
        p = new
        if delta < tol:
            break
    return [x / (x + 1.0) for x in p]


# ----------------------------------------------------------------------------- the reward


@dataclass
class GroupScores:
    """The rubric rewards of a batch of groups and what the critic did."""

    rewards: list[list[float]]  # per group, per response (floored)
    ranking: list[list[float]]  # the aggregation before the floor
    violations: list[list[list[str]]]  # per group, per response: ids of prescriptive rubrics violated
    pairs: list[list[PairOutcome]]
    stats: dict[str, Any]


@dataclass
class Refinement:
    """The critic checked against verifiable rewards on one batch."""

    pairs: int
    agree: int
    disagree: int
    undecided: int  # ties and position-inconsistent answers
    position_bias: float | None
    sft_records: list[dict]

    @property
    def agreement(self) -> float | None:
        return self.agree / self.pairs if self.pairs else None

    def metrics(self) -> dict[str, Any]:
        return {
            "critic_agreement": self.agreement,
            "critic_pairs": self.pairs,
            "critic_undecided": self.undecided,
            "critic_refine_position_bias": self.position_bias,
            "critic_sft_rows": len(self.sft_records),
        }


def _stats(pairs: Sequence[PairOutcome], violations: Sequence[Sequence[str]]) -> dict[str, int]:
    verdicts = [v for p in pairs for v in (p.first, p.second)]
    decisive = [v for v in verdicts if v.preferred in ("A", "B")]
    return {
        "pairs": len(pairs),
        "decisive_pairs": sum(p.decisive for p in pairs),
        "position_inconsistent": sum(p.position_inconsistent for p in pairs),
        "verdicts": len(verdicts),
        "decisive_verdicts": len(decisive),
        "first_position": sum(v.preferred == "A" for v in decisive),
        "parse_failures": sum(v.preferred is None for v in verdicts),
        "responses": len(violations),
        "violating": sum(bool(v) for v in violations),
    }


def _rates(c: dict[str, int]) -> dict[str, Any]:
    def ratio(a: int, b: int) -> float | None:
        return a / b if b else None

    return {
        **c,
        "position_bias": ratio(c["position_inconsistent"], c["decisive_pairs"]),
        "first_position_rate": ratio(c["first_position"], c["decisive_verdicts"]),
        "parse_failure_rate": ratio(c["parse_failures"], c["verdicts"]),
        "violation_rate": ratio(c["violating"], c["responses"]),
    }


@register_reward("rubric")
class RubricReward(GroupReward):
    """The self-critique rubric reward (see the module docstring).

    Args:
        critic: a :class:`~k2_rl.rewards.critic.Critic` (``complete(requests) -> texts``), e.g.
            ``HTTPCritic(url)``; required to score (constructible without, for the registry).
        rubric_dirs: user rubric files or directories, read after the shipped ones.
        aggregation: "winrate" (default) or "bt".
        floor: the reward of a response that violates a prescriptive rubric.
        violations: "both" (default), "patterns" (deterministic checks only) or "critic".
        vote: the share of a response's parsed verdicts that must flag a rubric for the critic's
            flag to count.
        max_tokens, temperature: the critic's sampling (greedy by default).
    """

    name = "rubric"
    group = True
    needs_critic = True

    def __init__(
        self,
        critic: Any = None,
        *,
        rubric_dirs: Sequence[str | Path] = (),
        aggregation: str = "winrate",
        floor: float = 0.0,
        violations: str = "both",
        vote: float = 0.5,
        max_tokens: int = 256,
        temperature: float = 0.0,
    ) -> None:
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"rubric reward: aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        if violations not in VIOLATION_MODES:
            raise ValueError(
                f"rubric reward: violations must be one of {VIOLATION_MODES}, got {violations!r}"
            )
        if not 0 < vote <= 1:
            raise ValueError(f"rubric reward: vote must be in (0, 1], got {vote}")
        self.critic = critic
        self.rubrics = load_rubrics(*rubric_dirs)
        self.aggregation, self.floor, self.violations = aggregation, float(floor), violations
        self.vote, self.max_tokens, self.temperature = vote, max_tokens, temperature

    @classmethod
    def from_config(cls, cfg: Any, critic: Any) -> RubricReward:
        """From an RLConfig's rubric component (``cfg.rubric``: rubric_dir, rubric_aggregation, ...)."""
        rubric = cfg.rubric
        return cls(
            critic,
            rubric_dirs=[rubric.rubric_dir] if rubric.rubric_dir else [],
            aggregation=rubric.rubric_aggregation,
            floor=rubric.rubric_floor,
            max_tokens=rubric.critic_max_tokens,
        )

    def rubrics_for(self, task: dict) -> list[Rubric]:
        return self.rubrics + task_rubrics(task)

    # -- asking the critic

    def _ask(self, jobs: Sequence[tuple[Sequence[dict], str, str, list[Rubric]]], seed: int) -> list[Verdict]:
        if self.critic is None:
            raise RuntimeError("the rubric reward has no critic: pass critic= (e.g. HTTPCritic(url))")
        reqs = [
            build_request(m, a, b, rs, max_tokens=self.max_tokens, temperature=self.temperature, seed=seed)
            for m, a, b, rs in jobs
        ]
        texts = self.critic.complete(reqs)
        if reqs and all(t is None for t in texts):
            errors = getattr(getattr(self.critic, "stats", None), "errors", [])
            raise RuntimeError(f"the critic answered none of {len(reqs)} requests: {errors[:3]}")
        return [parse_verdict(t) for t in texts]

    def _compare(
        self,
        groups: Sequence[tuple[Sequence[dict], Sequence[str], list[Rubric], list[tuple[int, int]]]],
        seed: int,
    ) -> list[list[PairOutcome]]:
        """Each group's listed pairs, in both orders, in one batch of critic requests."""
        jobs = []
        for messages, responses, rubrics, pairs in groups:
            for i, j in pairs:
                jobs.append((messages, responses[i], responses[j], rubrics))
                jobs.append((messages, responses[j], responses[i], rubrics))
        verdicts = iter(self._ask(jobs, seed))
        return [[PairOutcome(i, j, next(verdicts), next(verdicts)) for i, j in g[3]] for g in groups]

    # -- scoring

    def score_groups(
        self, groups: Sequence[tuple[Sequence[dict], Sequence[str], dict]], *, seed: int = 0
    ) -> GroupScores:
        """Rubric rewards for each ``(messages, responses, task)`` group (all pairs, both orders)."""
        prepared = []
        for messages, responses, task in groups:
            K = len(responses)
            pairs = [(i, j) for i in range(K) for j in range(i + 1, K)]
            prepared.append((messages, list(responses), self.rubrics_for(task), pairs))
        outcomes = self._compare(prepared, seed)
        rewards, ranking, violations = [], [], []
        for (_, responses, rubrics, _), pairs in zip(prepared, outcomes):
            rank = self._aggregate(len(responses), pairs)
            viol = self._violations(responses, rubrics, pairs)
            ranking.append(rank)
            violations.append(viol)
            rewards.append([self.floor if v else r for r, v in zip(rank, viol)])
        counts = _stats([p for g in outcomes for p in g], [v for g in violations for v in g])
        stats = _rates(counts)
        flat = [r for g in rewards for r in g]
        stats["reward_mean"] = sum(flat) / len(flat) if flat else None
        return GroupScores(rewards, ranking, violations, outcomes, stats)

    def _aggregate(self, K: int, pairs: Sequence[PairOutcome]) -> list[float]:
        if K == 1:
            return [0.5]
        if self.aggregation == "winrate":
            total = [0.0] * K
            for p in pairs:
                total[p.i] += p.score
                total[p.j] += 1.0 - p.score
            return [t / (K - 1) for t in total]
        wins = [[0.0] * K for _ in range(K)]
        for p in pairs:  # two comparisons per pair, one per order
            wins[p.i][p.j] += 2 * p.score
            wins[p.j][p.i] += 2 * (1.0 - p.score)
        return bradley_terry(wins)

    def _violations(
        self, responses: Sequence[str], rubrics: Sequence[Rubric], pairs: Sequence[PairOutcome]
    ) -> list[list[str]]:
        prescriptive = [r for r in rubrics if r.kind == "prescriptive"]
        ids = {r.id for r in prescriptive}
        out: list[set[str]] = [set() for _ in responses]
        if self.violations in ("both", "patterns"):
            for k, text in enumerate(responses):
                out[k].update(pattern_violations(text, prescriptive))
        if self.violations in ("both", "critic") and ids:
            flags = [dict.fromkeys(ids, 0) for _ in responses]
            seen = [0] * len(responses)
            for p in pairs:
                for v, a, b in ((p.first, p.i, p.j), (p.second, p.j, p.i)):
                    if v.preferred is None:
                        continue
                    for side, k in (("A", a), ("B", b)):
                        seen[k] += 1
                        for rid in v.violations[side] & ids:
                            flags[k][rid] += 1
            for k in range(len(responses)):
                out[k].update(r for r, n in flags[k].items() if seen[k] and n >= self.vote * seen[k])
        return [sorted(s) for s in out]

    # -- closed-loop refinement

    def refine(
        self,
        groups: Sequence[tuple[Sequence[dict], Sequence[str], dict, Sequence[float]]],
        *,
        max_pairs: int | None = None,
        seed: int = 0,
    ) -> Refinement:
        """Check the critic against verifiable rewards: ``(messages, responses, task, rewards)``
        groups; the pairs with different rewards (at most ``max_pairs``, drawn with ``seed``) are
        judged in both orders. Returns the counts and the critic SFT records of the pairs it got
        wrong or left undecided (both orders, the verified verdict as the answer)."""
        candidates = [
            (g, i, j)
            for g, (_, responses, _, rewards) in enumerate(groups)
            for i in range(len(responses))
            for j in range(i + 1, len(responses))
            if abs(float(rewards[i]) - float(rewards[j])) > 1e-9
        ]
        if max_pairs is not None and len(candidates) > max_pairs:
            candidates = sorted(random.Random(seed).sample(candidates, max_pairs))
        by_group: dict[int, list[tuple[int, int]]] = {}
        for g, i, j in candidates:
            by_group.setdefault(g, []).append((i, j))
        order = sorted(by_group)
        prepared = [
            (groups[g][0], list(groups[g][1]), self.rubrics_for(groups[g][2]), by_group[g]) for g in order
        ]
        outcomes = self._compare(prepared, seed) if prepared else []
        agree = disagree = undecided = 0
        records: list[dict] = []
        for (messages, responses, rubrics, _), pairs, g in zip(prepared, outcomes, order):
            rewards = groups[g][3]
            prescriptive = [r for r in rubrics if r.kind == "prescriptive"]
            for p in pairs:
                better_i = rewards[p.i] > rewards[p.j]
                s = p.score if better_i else 1.0 - p.score
                if s > 0.5:
                    agree += 1
                    continue
                if s < 0.5:
                    disagree += 1
                else:
                    undecided += 1
                w, lo = (p.i, p.j) if better_i else (p.j, p.i)
                for a, b in ((w, lo), (lo, w)):
                    records.append(
                        self._sft_record(
                            messages,
                            responses[a],
                            responses[b],
                            rubrics,
                            prescriptive,
                            "A" if a == w else "B",
                            float(rewards[w]),
                            float(rewards[lo]),
                        )
                    )
        counts = _stats([p for g in outcomes for p in g], [])
        bias = (
            counts["position_inconsistent"] / counts["decisive_pairs"] if counts["decisive_pairs"] else None
        )
        return Refinement(len(candidates), agree, disagree, undecided, bias, records)

    def _sft_record(
        self,
        messages: Sequence[dict],
        a: str,
        b: str,
        rubrics: Sequence[Rubric],
        prescriptive: Sequence[Rubric],
        preferred: str,
        r_win: float,
        r_lose: float,
    ) -> dict:
        req = build_request(messages, a, b, rubrics, max_tokens=self.max_tokens)
        other = "B" if preferred == "A" else "A"
        reason = (
            f"Response {preferred} is correct and response {other} is not."
            if r_win >= 1.0 and r_lose <= 0.0
            else f"Response {preferred} satisfies more of the request than response {other}."
        )
        target = {
            "reason": reason,
            "preferred": preferred,
            "violations": {
                "A": pattern_violations(a, prescriptive),
                "B": pattern_violations(b, prescriptive),
            },
        }
        return {"messages": req["messages"] + [{"role": "assistant", "content": json.dumps(target)}]}


def write_sft(records: Sequence[dict], path: str | Path) -> Path:
    """Write critic SFT records as chat JSONL (``k2 sft --data`` reads it), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path

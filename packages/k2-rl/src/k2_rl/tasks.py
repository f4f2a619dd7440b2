"""Verifiable tasks a tiny model can learn on a CPU, generated with a seed.

`addition`: "What is 347 + 589?" with the answer 936. Operands have `digits` digits; whether a pair
(a, b) is held out is a fixed hash of the pair, so train and held-out prompts never overlap and
the split does not depend on the seed or the counts. For SFT, each prompt gets a worked solution
(the column sum right to left with carries, then `\\boxed{sum}`), the form the RL reward
(`math_reward`, answer extraction from `\\boxed{}`) scores.

A task record (`rl.jsonl`, `heldout.jsonl`): `{"messages": [system, user], "answer": "936",
"task": "addition"}`. An SFT record (`sft.jsonl`): `{"messages": [system, user, assistant]}`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from pathlib import Path

SYSTEM = "You are a careful calculator. Show the column sum, then the answer in \\boxed{}."
TEMPLATES = [
    "What is {a} + {b}?",
    "Compute {a} + {b}.",
    "Add {a} and {b}.",
    "{a} + {b} = ?",
    "Find the sum of {a} and {b}.",
]


def _heldout(a: int, b: int, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(f"{min(a, b)},{max(a, b)}".encode()).digest()[:4], "little")
    return h / 2**32 < fraction


def worked_solution(a: int, b: int) -> str:
    """The column sum, right to left with carries, then the boxed answer."""
    xs, ys = str(a)[::-1], str(b)[::-1]
    carry, steps = 0, []
    for i in range(max(len(xs), len(ys))):
        x = int(xs[i]) if i < len(xs) else 0
        y = int(ys[i]) if i < len(ys) else 0
        s = x + y + carry
        steps.append(f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={s}")
        carry = s // 10
    if carry:
        steps.append(f"carry {carry}")
    return "; ".join(steps) + f". The answer is \\boxed{{{a + b}}}."


def addition_problems(
    n: int, seed: int, split: str, digits: int = 3, heldout_fraction: float = 0.1
) -> list[tuple[int, int, str]]:
    """`n` distinct (a, b, prompt) of the split ("train" or "heldout")."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    rng = random.Random(f"addition:{seed}:{split}:{digits}")
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    seen: set[tuple[int, int]] = set()
    out = []
    while len(out) < n:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if (a, b) in seen or _heldout(a, b, heldout_fraction) != (split == "heldout"):
            continue
        seen.add((a, b))
        out.append((a, b, rng.choice(TEMPLATES).format(a=a, b=b)))
    return out


def _prompt(text: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def _write_jsonl(path: Path, records: list[dict]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def write_addition_dataset(
    out_dir: str | Path,
    n_sft: int = 2000,
    n_rl: int = 2000,
    n_heldout: int = 200,
    seed: int = 0,
    digits: int = 3,
) -> dict:
    """sft.jsonl (worked solutions), rl.jsonl (prompts + answers, disjoint from sft.jsonl) and
    heldout.jsonl (held-out pairs), written atomically. Returns the counts."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = addition_problems(n_sft + n_rl, seed, "train", digits)
    held = addition_problems(n_heldout, seed, "heldout", digits)
    sft = [
        {"messages": _prompt(p) + [{"role": "assistant", "content": worked_solution(a, b)}]}
        for a, b, p in train[:n_sft]
    ]
    rl = [{"messages": _prompt(p), "answer": str(a + b), "task": "addition"} for a, b, p in train[n_sft:]]
    ho = [{"messages": _prompt(p), "answer": str(a + b), "task": "addition"} for a, b, p in held]
    _write_jsonl(out / "sft.jsonl", sft)
    _write_jsonl(out / "rl.jsonl", rl)
    _write_jsonl(out / "heldout.jsonl", ho)
    return {"sft": len(sft), "rl": len(rl), "heldout": len(ho), "digits": digits, "seed": seed}


def read_tasks(path: str | Path, default_reward: str | None = None) -> list[dict]:
    """Task records of a JSONL file; each needs `messages` and the fields its `reward` reads
    (`task_fields`: `answer` for math, `tests` for code, `constraints` for instruction, none for a
    group reward such as `rubric`; a task without a `reward` field has `default_reward`, the run's
    `--reward`). A missing field is named with file:line."""
    from k2_rl.rewards.base import task_fields

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such task file")
    tasks = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{i}: invalid JSON ({e})") from None
        reward = rec.get("reward") or default_reward
        needed = ("messages", *task_fields(reward)) if reward else ("messages", "answer")
        for key in needed:
            if key not in rec:
                raise ValueError(f"{path}:{i}: task record has no field {key!r}")
        rec.setdefault("answer", None)
        tasks.append(rec)
    if not tasks:
        raise ValueError(f"{path}: no task records")
    return tasks


def read_env_tasks(path: str | Path) -> list[dict]:
    """Episode tasks of a JSONL file for `--env`: each needs `messages`; the environment checks the
    fields it scores against (`expected_state`, `answer`, `tests`, ...) when an episode starts."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such task file")
    tasks = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{i}: invalid JSON ({e})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("messages"), list):
            raise ValueError(f"{path}:{i}: task record has no list field 'messages'")
        tasks.append(rec)
    if not tasks:
        raise ValueError(f"{path}: no task records")
    return tasks


__all__ = ["addition_problems", "read_env_tasks", "read_tasks", "worked_solution", "write_addition_dataset"]


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m k2_rl.tasks",
        description="Write the generated addition task: "
        "sft.jsonl (worked solutions), rl.jsonl and heldout.jsonl (prompts + answers).",
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-sft", type=int, default=2000)
    ap.add_argument("--n-rl", type=int, default=2000)
    ap.add_argument("--n-heldout", type=int, default=200)
    ap.add_argument("--digits", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    counts = write_addition_dataset(a.out, a.n_sft, a.n_rl, a.n_heldout, a.seed, a.digits)
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

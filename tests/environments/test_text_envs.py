"""The Python text environments on their own: math QA, Search QA (BM25, HTTP, mock), TextWorld,
and the WebShop / ALFWorld adapters on stand-ins with the real environments' interfaces.

References are hand-worked examples and the shipped files' own answers; BM25's ranking is checked
against the questions generated with the corpus.
"""
from __future__ import annotations

import json

import pytest

from environments.text import DATA_DIR
from environments.text import retrieval, retrieval_server
from environments.text.adapters import ALFWorld, WebShop
from environments.text.math_qa import MathQA, extract_answer, generate_problems
from environments.text.search_qa import SearchQA, extract_answer as search_extract, generate_corpus, score_answer


def test_shipped_files_are_the_generators_output():
    rows = [json.loads(line) for line in open(DATA_DIR / "arithmetic_word_problems.jsonl")]
    assert rows == generate_problems()
    docs, questions = generate_corpus()
    assert [json.loads(line) for line in open(DATA_DIR / "search_corpus.jsonl")] == docs
    assert [json.loads(line) for line in open(DATA_DIR / "search_questions.jsonl")] == questions


def test_math_qa_answers_and_tries():
    assert extract_answer("Add them: 2 + 3 = 5. The answer is:  5 \n") == "5"
    assert extract_answer("no final line") is None
    env = MathQA()
    question = env.reset(11)
    assert question.endswith("?") and env.answer is not None
    assert env.step("") == ("Incorrect. Please think again.", 0.0, False, {"action_is_valid": False, "success": False})
    text, reward, done, info = env.step(" " + env.answer.upper() + " ")
    assert (text, reward, done, info["success"]) == ("Correct!", 0.5, True, True)  # second try: 1 / 2**1
    env.reset(11)
    assert env.step(env.answer)[1] == 1.0
    test = MathQA(split="test")
    assert {r["split"] for r in test.rows} == {"test"}


def test_missing_data_files_name_the_path_and_key(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope.jsonl does not exist; set config.env.data_path"):
        MathQA(data_path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"config.env.corpus_path"):
        SearchQA(corpus_path=str(tmp_path / "corpus.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"query": "q"}) + "\n")
    with pytest.raises(ValueError, match=r"has no column\(s\) \['response'\]"):
        MathQA(data_path=str(bad))


def test_search_scores_and_extraction():
    assert score_answer("The Velsk", ["velsk"]) == (1.0, True)
    reward, exact = score_answer("river Lune valley", ["Lune"])
    assert not exact and abs(reward - 0.5) < 1e-9  # F1 = 2 * (1/3 * 1) / (1/3 + 1) = 0.5
    assert score_answer("Paris", ["Lune"]) == (0.0, False)
    assert search_extract("I think **Velsk** is right") == "Velsk"
    assert search_extract("So the answer is: Larkmoor.") == "Larkmoor"


def test_bm25_finds_the_document_of_single_hop_questions():
    r = retrieval.BM25Retriever()
    docs, questions = generate_corpus()
    hits = 0
    asked = [q for q in questions if q["question"].startswith("In which town")]
    for q in asked:
        name = q["question"][len("In which town was "):-len(" born?")]
        top = r.search(q["question"], 3)
        hits += any(name in d["content"] and q["ground_truth"][0] in d["content"] for d in top)
    assert hits / len(asked) > 0.9, hits


def test_search_protocol_in_process_over_http_and_mock():
    server = retrieval_server.serve(retrieval.BM25Retriever(), port=0)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        local, remote = SearchQA(), SearchQA(retrieval_url=url)
        for env in (local, remote):
            assert env.reset(0).startswith("Question: In which town was")
        a, b = local.step("search[born in Velsk]"), remote.step("search[born in Velsk]")
        assert a == b and a[0].startswith("Search results for 'born in Velsk':\n[Document 1] (ID: ")
        text, reward, done, info = local.step(f"finish[{local.truth[0]}]")
        assert reward == 1.0 and done and info["success"]
    finally:
        server.shutdown()
    with pytest.raises(ConnectionError, match="did not answer"):
        SearchQA(retrieval_url="http://127.0.0.1:9").step("search[x]")
    mock = SearchQA(mock=True, max_steps=2)
    mock.reset(3)
    assert "Placeholder document for the query 'abc'" in mock.step("search[abc]")[0]
    text, reward, done, info = mock.step("search[again]")
    assert done and "Maximum search steps reached" in text
    mock.reset(3)
    text, reward, done, info = mock.step("I believe the answer is Nowhere at all")
    assert done and not info["action_is_valid"] and text.startswith("Your answer (extracted): Nowhere at all")


def test_textworld_walkthrough_wins(tmp_path):
    textworld = pytest.importorskip("textworld")
    from environments.text.textworld_env import TextWorld

    env = TextWorld(num_games=1, games_dir=str(tmp_path))
    obs = env.reset(0)
    assert "Admissible commands: " in obs and "$$" not in obs
    game = textworld.Game.load(env.games[0].replace(".z8", ".json"))
    total, done, info = 0.0, False, {}
    for command in game.metadata["walkthrough"]:
        assert command in obs.split("Admissible commands: ")[1]
        obs, reward, done, info = env.step(command)
        total += reward
        if done:
            break
    assert done and info["success"] and total == game.max_score
    env.reset(0)
    assert env.step("dance wildly")[3]["action_is_valid"] is False


class FakeWebAgentTextEnv:
    """WebShop's text env interface: a store with one product."""

    def __init__(self):
        self.page = "search"

    def reset(self, session=None):
        self.page = "search"
        return f"Instruction: buy a red mug [session {session}]", {}

    def get_available_actions(self):
        return {"has_search_bar": self.page == "search", "clickables": [] if self.page == "search" else ["b01", "buy now"]}

    def step(self, action):
        if action.startswith("search["):
            self.page = "results"
            return "Results: b01 red mug", 0.0, False, {}
        if action == "click[buy now]":
            return "Thank you for shopping", 1.0, True, {}
        return "Nothing happens", 0.0, False, {"valid": False}


class FakeAlfred:
    """ALFWorld's batched env interface (batch of one)."""

    def reset(self):
        self.done = False
        return ["You are in a kitchen. Your task is to: put a mug in the sink."], \
            {"admissible_commands": [["go to sink 1", "take mug 1"]], "won": [False]}

    def step(self, commands):
        won = commands[0] == "take mug 1"
        return ["You take the mug." if won else "Nothing happens."], [float(won)], [won], \
            {"admissible_commands": [["go to sink 1", "take mug 1"]], "won": [won]}


def make_webshop():
    return FakeWebAgentTextEnv()


def make_alfworld():
    return FakeAlfred()


def test_webshop_and_alfworld_adapters_on_stand_ins():
    shop = WebShop(factory="tests.environments.test_text_envs:make_webshop", num_sessions=10)
    assert shop.reset(13) == "Instruction: buy a red mug [session 3]\nAvailable actions: search[<content>]"
    assert shop.step("search[red mug]")[0].endswith("Available actions: click[b01], click[buy now]")
    assert shop.step("click[buy now]")[1:3] == (1.0, True)
    alf = ALFWorld(factory="tests.environments.test_text_envs:make_alfworld")
    assert alf.reset(0).endswith("Admissible commands: go to sink 1, take mug 1")
    assert alf.step("jump")[3] == {"success": False, "action_is_valid": False}
    text, reward, done, info = alf.step("take mug 1")
    assert (reward, done, info["success"]) == (1.0, True, True)
    with pytest.raises(ValueError, match="needs config.env.factory"):
        WebShop()


def test_math_qa_reads_parquet_too(tmp_path):
    import datasets

    rows = generate_problems(20, seed=3)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "qa.parquet"))
    env = MathQA(data_path=str(tmp_path / "qa.parquet"))
    assert len(env.rows) == sum(r["split"] == "train" for r in rows)
    env.reset(0)
    assert env.step(env.answer)[1] == 1.0

"""Search QA (RAGEN's ``search`` env: SearchQA / SearchQAMock): answer by searching a corpus.

Protocol (the original's): the model answers ``search[query]`` to retrieve documents (shown as the
next observation) or ``finish[answer]`` to submit (``answer[...]`` is accepted as a synonym);
anything else is read as an answer in free text (the original's fallback extraction: a boxed or
bold phrase, "the answer is ...", else the first sentence) and marked invalid. After ``max_steps``
searches the episode ends without an answer.

Reward (the original's, HotpotQA/SQuAD normalisation: lower case, no punctuation or articles): an
exact match earns ``correct_reward`` (1); otherwise a token F1 of at least ``f1_threshold`` (0.3)
earns ``correct_reward * F1``, less earns 0. ``success`` is a reward above 0.

Retrieval: BM25 over a local JSONL corpus in process (``corpus_path``), a retrieval server
(``retrieval_url``, see ``environments.text.retrieval``), or ``mock=True`` (placeholder documents).
The shipped corpus and questions (``environments/data/search_*.jsonl``) are generated facts about
fictional people and towns, with one- and two-hop questions, so the env runs offline.
"""
from __future__ import annotations

import re
import string
from collections import Counter

import numpy as np

from environments.text import data_file, load_records
from environments.text import retrieval

DEFAULT_QUESTIONS = "search_questions.jsonl"


def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(prediction: str, truth: str) -> float:
    p, t = normalize_answer(prediction), normalize_answer(truth)
    if (p in ("yes", "no", "noanswer") or t in ("yes", "no", "noanswer")) and p != t:
        return 0.0
    common = Counter(p.split()) & Counter(t.split())
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p.split()), same / len(t.split())
    return 2 * precision * recall / (precision + recall)


def score_answer(answer: str, truths, correct_reward: float = 1.0, f1_threshold: float = 0.3) -> tuple[float, bool]:
    """-> (reward, exact match) against one or several ground truths."""
    truths = [truths] if isinstance(truths, str) else list(truths)
    if any(normalize_answer(answer) == normalize_answer(str(t)) for t in truths):
        return correct_reward, True
    f1 = max(f1_score(answer, str(t)) for t in truths)
    return (correct_reward * f1 if f1 >= f1_threshold else 0.0), False


def extract_answer(text: str) -> str:
    """The original's fallback: an answer phrase out of free text."""
    text = re.sub(r"<think>.*?</think>", "", text.strip(), flags=re.DOTALL)
    text = re.sub(r"\s+", " ", text).strip()
    if not text:
        return ""
    m = re.search(r"\\boxed\{([^}]+)\}", text)
    if m:
        return m.group(1).strip()
    for pattern in (r"\*\*([^*]+)\*\*", r"\*([^*]+)\*"):
        found = [x.strip() for x in re.findall(pattern, text) if len(x.strip()) > 2 and not re.match(r"^[^\w]*$", x.strip())]
        if found:
            return found[0]
    for pattern in (r"(?:the\s+)?(?:correct\s+)?answer\s+is\s*:?\s*([^.!?]+)", r"(?:therefore|thus|so|hence)\s*,?\s*([^.!?]+)"):
        m = re.search(pattern, text, re.IGNORECASE)
        if m:
            ans = re.sub(r"^\W+|\W+$", "", m.group(1).strip())
            if len(ans) > 3:
                return ans
    sentences = [s.strip() for s in re.split(r"[.!?]+", text) if len(s.strip()) > 5]
    return sentences[0] if sentences else text[:100].strip()


class SearchQA:
    """Multi-turn search-then-answer over a local corpus (see the module docstring)."""

    action_names = None
    instruction = (
        "You are a search agent answering questions with a document search engine.\n"
        "Write search[your query] to look something up, and finish[your answer] to give the final answer.\n"
        "Think step by step inside <think> </think>, then put exactly one action inside <answer> </answer>, "
        "for example <answer>search[birthplace of Maren Holt]</answer> or <answer>finish[Velsk]</answer>.\n"
    )

    def __init__(self, questions_path: str | None = None, corpus_path: str | None = None,
                 retrieval_url: str | None = None, mock: bool = False, max_steps: int = 10,
                 max_search_results: int = 5, max_total_chars: int = 4000, correct_reward: float = 1.0,
                 f1_threshold: float = 0.3, split: str = "train"):
        self.path = data_file(questions_path, DEFAULT_QUESTIONS, "questions_path")
        rows = load_records(self.path, ("question", "ground_truth"), "questions_path")
        if "split" in rows[0]:
            rows = [r for r in rows if r["split"] == split] or rows
        self.rows = rows
        if mock:
            self.retriever = retrieval.MockRetriever()
        elif retrieval_url:
            self.retriever = retrieval.HTTPRetriever(retrieval_url)
        else:
            self.retriever = shared_bm25(corpus_path)
        self.max_steps, self.max_results, self.max_chars = int(max_steps), int(max_search_results), int(max_total_chars)
        self.correct_reward, self.f1_threshold = float(correct_reward), float(f1_threshold)
        self.steps = 0
        self.question = self.truth = None

    def reset(self, seed: int) -> str:
        row = self.rows[int(seed) % len(self.rows)]
        self.question, self.truth, self.steps = row["question"], row["ground_truth"], 0
        return f"Question: {self.question}\nAvailable actions: search[<query>], finish[<answer>]"

    def _finish(self, answer: str, valid: bool, extracted: bool = False):
        reward, exact = score_answer(answer, self.truth, self.correct_reward, self.f1_threshold)
        label = "Your answer (extracted)" if extracted else "Your answer"
        return (f"{label}: {answer}. Reward: {reward:.2f}", reward, True,
                {"action_is_valid": valid, "action_is_effective": True, "success": exact or reward > 0})

    def step(self, action: str):
        self.steps += 1
        action = (action or "").strip()
        m = re.fullmatch(r"(search|finish|answer)\[(.*)\]", action, flags=re.DOTALL)
        if m and m.group(1) == "search":
            query = m.group(2)
            results = retrieval.format_results(self.retriever.search(query, self.max_results), self.max_results,
                                               self.max_chars)
            done = self.steps >= self.max_steps
            tail = ("Maximum search steps reached. Episode ended without an answer." if done
                    else "Available actions: search[<query>], finish[<answer>]")
            return f"Search results for '{query}':\n{results}\n\n{tail}", 0.0, done, \
                {"action_is_valid": True, "action_is_effective": True, "success": False}
        if m:
            return self._finish(m.group(2), True)
        if not action:
            done = self.steps >= self.max_steps
            return ("Invalid action. Use search[<query>] to search or finish[<answer>] to answer.\n"
                    "Available actions: search[<query>], finish[<answer>]"), 0.0, done, \
                {"action_is_valid": False, "action_is_effective": False, "success": False}
        return self._finish(extract_answer(action), False, extracted=True)


_BM25_CACHE: dict = {}


def shared_bm25(corpus_path):
    """One index per corpus in the process (a HostEnv holds one env per batch row)."""
    key = str(data_file(corpus_path, retrieval.DEFAULT_CORPUS, "corpus_path"))
    if key not in _BM25_CACHE:
        _BM25_CACHE[key] = retrieval.BM25Retriever(key)
    return _BM25_CACHE[key]


def generate_corpus(n_people: int = 60, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """A small encyclopedia of fictional people and towns, and questions answerable from it."""
    rng = np.random.default_rng(seed)
    first = ["Maren", "Ilan", "Tove", "Rasmus", "Sella", "Odile", "Bram", "Ysolde", "Caspian", "Liesel", "Tamsin",
             "Oskar", "Petra", "Anouk", "Joris", "Mirela", "Teodor", "Vanja", "Elio", "Greta"]
    last = ["Holt", "Drost", "Varga", "Lindqvist", "Okafor", "Marchetti", "Novak", "Ferreira", "Haugen", "Brennan",
            "Castel", "Dufresne", "Ekberg", "Falk", "Gallo", "Iversen"]
    towns = ["Velsk", "Amberfall", "Corran", "Dunmere", "Eskby", "Frayton", "Galloway Cross", "Hollin", "Istra",
             "Juniper Bay", "Kessock", "Larkmoor"]
    rivers = ["Tamber", "Ousel", "Brenna", "Calder", "Dovey", "Elwy", "Fenn", "Glass", "Hodder", "Isbourne",
              "Kelvin", "Lune"]
    countries = ["Orland", "Vestria", "Caldoria", "Marnesse"]
    jobs = ["cartographer", "violinist", "glassblower", "astronomer", "beekeeper", "shipwright", "botanist",
            "clockmaker", "translator", "stonemason"]
    town_river = {t: rivers[i] for i, t in enumerate(towns)}
    town_country = {t: countries[i % len(countries)] for i, t in enumerate(towns)}
    docs = [{"id": f"town_{i}", "contents": f"{t} is a town in {town_country[t]} on the river {town_river[t]}. "
             f"Its market is held every {['Monday', 'Thursday', 'Saturday'][i % 3]}."} for i, t in enumerate(towns)]
    names = set()
    while len(names) < n_people:
        names.add(f"{rng.choice(first)} {rng.choice(last)}")
    people = sorted(names)
    questions = []
    for i, p in enumerate(people):
        town, job = str(rng.choice(towns)), str(rng.choice(jobs))
        year = int(rng.integers(1850, 1990))
        docs.append({"id": f"person_{i}", "contents": f"{p} was a {job} born in {town} in {year}. "
                     f"{p.split()[0]} is remembered for work that took decades to finish."})
        split = "test" if i % 5 == 4 else "train"
        questions += [
            {"question": f"In which town was {p} born?", "ground_truth": [town], "split": split},
            {"question": f"What was the profession of {p}?", "ground_truth": [job], "split": split},
            {"question": f"On which river lies the town where {p} was born?", "ground_truth": [town_river[town]],
             "split": split},
        ]
    return docs, questions

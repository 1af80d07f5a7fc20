"""A task solved through tools, as a multi-turn host environment (``HostEnv``: text in, text out).

Each turn the model's answer either calls tools — the calls in the configured format (``hermes``:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, several per turn) — or gives its final
answer (``finish[...]``, or any text without a call). Tool calls run (``run_calls``: in parallel,
timeouts and errors returned as text) and their outputs come back as the next observation, each in
``<tool_response>`` tags; they are environment text, so never part of the loss. The final answer is
scored by the task's reward function and ends the episode, as do ``max_turns`` turns or a call past
the episode's tool budget (``max_tool_calls``; that turn is answered with a note instead). A call
that does not parse is a format failure (``action_is_valid`` False, the rollout's format penalty)
with feedback saying what was wrong.

``ToolSearchQA`` is the Search-R1-style task: the shipped QA data (``environments/data/
search_*.jsonl``: one- and two-hop questions about fictional people and towns) with the BM25
``search`` tool, rewarded by exact match (F1 above 0.3 earns partial credit), as ``SearchQA``.
"""
from __future__ import annotations

import json
import re
from typing import Callable, Sequence

from environments.core import Plan
from environments.text import data_file, load_records, retrieval
from environments.text.search_qa import DEFAULT_QUESTIONS, score_answer, shared_bm25
from ragen_jax.rollout.chat import system_with_tools
from ragen_jax.tools.builtin import search_tool
from ragen_jax.tools.calls import parse_calls, run_calls
from ragen_jax.tools.openai_format import tools_listing
from ragen_jax.tools.schema import Tool

_SENTENCE = re.compile(r"[^.\n]*[.]")
_FINISH = re.compile(r"^\s*(?:finish|answer)\[(.*)\]\s*$", flags=re.DOTALL)


# How a reply carries its calls and its final answer (the rollout parses <answer> ... </answer>).
REPLY_FORMAT = ("Think inside <think> </think>. Put your tool calls, or your final answer as finish[your answer], "
                "inside <answer> </answer>.")


def tools_instruction(tools: Sequence[Tool], task: str) -> str:
    """The system prompt's tool section, in the words Qwen2.5's chat template uses for ``tools=``:
    what a tokenizer whose template lists no tools is shown (``ToolEnv.instruction_for``)."""
    return f"{task}\n\n{tools_listing([t.schema for t in tools])}\n{REPLY_FORMAT}\n"


class ToolEnv:
    """Tools + tasks + a reward function as a host environment (see the module docstring).

    ``tasks``: rows with a ``question`` and a ``ground_truth``; ``reward_fn(answer, ground_truth) ->
    (reward, exact)``. ``fmt``: the call format (``TOOL_CALL_PARSERS``).
    """

    action_names = None

    def __init__(self, tools: Sequence[Tool], tasks: Sequence[dict], reward_fn: Callable, *, task_text: str,
                 fmt: str = "hermes", max_turns: int = 6, max_tool_calls: int = 4):
        if not tools:
            raise ValueError("ToolEnv needs at least one tool")
        if not tasks:
            raise ValueError("ToolEnv needs at least one task (rows with 'question' and 'ground_truth')")
        self.tools = {t.name: t for t in tools}
        self.tasks, self.reward_fn, self.fmt = list(tasks), reward_fn, fmt
        self.max_turns, self.max_tool_calls = int(max_turns), int(max_tool_calls)
        self.task_text = task_text
        self.instruction = tools_instruction(tools, task_text)
        self.turns = self.calls_made = 0
        self.task = None
        self.responses: list[str] = []  # this episode's tool outputs, in order (what an expert reads)
        self.counts = {"tool_calls": 0, "tool_errors": 0, "malformed_calls": 0}

    def instruction_for(self, tokenizer) -> str:
        """The system prompt for ``tokenizer``'s model: its own chat template's listing of the tools
        (``apply_chat_template(..., tools=schemas)``, as Qwen2.5 was trained to read them) when the
        template lists tools, else ``instruction`` (the same listing in Qwen2.5's words)."""
        if self.fmt == "hermes":  # the templates that list tools teach the <tool_call> convention
            listed = system_with_tools(tokenizer, f"{self.task_text}\n{REPLY_FORMAT}",
                                       [t.schema for t in self.tools.values()])
            if listed is not None:
                return listed
        return self.instruction

    def reset(self, seed: int) -> str:
        self.task = self.tasks[int(seed) % len(self.tasks)]
        self.turns = self.calls_made = 0
        self.responses = []
        return f"Question: {self.task['question']}"

    def take_counters(self) -> dict:
        out, self.counts = self.counts, {k: 0 for k in self.counts}
        return out

    def _final(self, answer: str, valid: bool):
        reward, exact = self.reward_fn(answer, self.task["ground_truth"])
        return (f"Your answer: {answer}. Reward: {reward:.2f}", float(reward), True,
                {"action_is_valid": valid, "action_is_effective": True, "success": bool(exact or reward > 0)})

    def step(self, action: str):
        self.turns += 1
        action = action or ""
        calls = parse_calls(action, self.fmt)
        if not calls:
            finish = _FINISH.match(action)
            return self._final(finish.group(1).strip() if finish else action.strip(), valid=bool(finish))
        out_of_turns = self.turns >= self.max_turns
        if self.calls_made + len(calls) > self.max_tool_calls:
            return (f"The tool budget of this episode ({self.max_tool_calls} calls) is used up: "
                    "answer now with finish[your answer].", 0.0, out_of_turns,
                    {"action_is_valid": True, "action_is_effective": False, "success": False})
        self.calls_made += len(calls)
        results = run_calls(calls, self.tools)
        self.responses.extend(r.content for r in results)
        malformed = sum(bool(c.error) for c in calls)
        self.counts["tool_calls"] += len(calls)
        self.counts["malformed_calls"] += malformed
        self.counts["tool_errors"] += sum(bool(r.error) for r in results) - malformed
        text = "\n".join(f"<tool_response>\n{r.content}\n</tool_response>" for r in results)
        if out_of_turns:
            text += "\nNo turns left: the episode ended without an answer."
        return text, 0.0, out_of_turns, {"action_is_valid": malformed == 0,
                                         "action_is_effective": malformed < len(calls), "success": False}


class ToolSearchQA(ToolEnv):
    """Search-R1-style question answering with the BM25 ``search`` tool over the shipped corpus (see the
    module docstring); ``retrieval_url`` searches a retrieval server instead."""

    def __init__(self, questions_path: str | None = None, corpus_path: str | None = None,
                 retrieval_url: str | None = None, max_turns: int = 6, max_tool_calls: int = 4, top_k: int = 2,
                 max_result_chars: int = 1500, correct_reward: float = 1.0, f1_threshold: float = 0.3,
                 split: str = "train", fmt: str = "hermes"):
        rows = load_records(data_file(questions_path, DEFAULT_QUESTIONS, "questions_path"),
                            ("question", "ground_truth"), "questions_path")
        if "split" in rows[0]:
            rows = [r for r in rows if r["split"] == split] or rows
        retriever = retrieval.HTTPRetriever(retrieval_url) if retrieval_url else shared_bm25(corpus_path)
        search = search_tool(retriever, top_k=top_k, max_chars=max_result_chars)
        super().__init__([search], rows, lambda a, t: score_answer(a, t, correct_reward, f1_threshold),
                         task_text="Answer the user's question. Search the knowledge corpus for the facts you need.",
                         fmt=fmt, max_turns=max_turns, max_tool_calls=max_tool_calls)

    # --- the warm-up's expert (``HostEnv.expert_episode``) ------------------------------------------
    def expert(self) -> Plan:
        """What a searcher who knows the answer does next, reading only this episode's tool outputs.

        Once a result states the ground truth, it answers ``finish[truth]`` quoting that sentence.
        Before that it searches: first the question; then, for a two-hop question, the bridge entity
        (a name the results mention and the question does not) whose own search returns the answer,
        found by trying the results' names with the tool (the expert knows what it is looking for).
        """
        truths = self.task["ground_truth"]
        truths = [truths] if isinstance(truths, str) else [str(t) for t in truths]
        evidence = _sentence_with(self.responses, truths)
        if evidence is not None:
            sentence, truth = evidence
            return Plan(answers=[f"finish[{truth}]"],
                        reasoning=lambda answers, s=sentence, t=truth: f"The search result says: {s} So the answer is {t}.")
        if not self.responses:
            query = self.task["question"]
            reasoning = "I do not know this yet, so I search the corpus for the question."
        else:
            query, sentence = self._bridge(truths)
            reasoning = f"The search result says: {sentence} Next I search for {query}."
        call = json.dumps({"name": "search", "arguments": {"query": query}})
        return Plan(answers=[f"<tool_call>{call}</tool_call>"], reasoning=lambda answers, r=reasoning: r)

    def _bridge(self, truths: list[str]) -> tuple[str, str]:
        """``(name, sentence)``: the first name in this episode's results, not in the question, whose
        search returns a passage stating a ground truth, with the sentence that mentions it (the first
        result's first sentence when none does)."""
        question = self.task["question"].lower()
        seen = []
        for text in self.responses:
            for sentence in _SENTENCE.findall(_passages(text)):
                for name in re.findall(r"\b[A-Z][a-z]+\b", sentence):
                    if name.lower() not in question and name not in seen and name not in _NOT_NAMES:
                        seen.append(name)
                        if _sentence_with([str(self.tools["search"](query=name))], truths) is not None:
                            return name, sentence.strip()
        first = _SENTENCE.findall(_passages(self.responses[-1]))
        return self.task["question"], (first[0].strip() if first else "nothing useful.")


_NOT_NAMES = {"Document", "ID", "Score", "Its", "The", "He", "She", "They", "In", "On", "A", "An"}


def _passages(text: str) -> str:
    """A search tool's output without its ``[Document i] (ID: ..., Score: ...)`` headers."""
    return re.sub(r"\[Document \d+\] \(ID: [^)]*\)\s*", "", text)


def _sentence_with(texts: Sequence[str], truths: Sequence[str]) -> tuple[str, str] | None:
    """The first ``(sentence, truth)`` of ``texts``' passages that states one of ``truths`` (as a whole
    word, any case)."""
    for text in texts:
        for sentence in _SENTENCE.findall(_passages(text)):
            for truth in truths:
                if re.search(rf"\b{re.escape(truth)}\b", sentence, flags=re.IGNORECASE):
                    return sentence.strip(), truth
    return None

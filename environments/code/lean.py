"""Theorem proving in Lean 4, tactic by tactic, checked by a Kimina Lean server (RAGEN's ``lean``).

Each episode is one theorem (a JSONL file, ``data_path``: ``formal_statement`` ending in ``:= by``,
optional ``natural_language_statement``, ``imports``, ``preamble``, ``name``; miniF2F exported to it
runs as it is). Each turn the answer is one tactic. The server checks the proof so far plus the new
tactic (imports, preamble, statement, the accepted tactics indented under it) and the original's
rules decide:

* **accepted**: no error message other than ``unsolved goals`` (the proof is not finished yet), and
  no ``sorry`` (a ``sorry`` is never accepted); only an accepted tactic joins the proof;
* **success**: no error at all and no ``sorry`` — the proof is complete; the episode ends;
* reward per step: ``step_penalty`` (−0.1) plus ``valid_step_reward`` (+1) if accepted or
  ``invalid_step_reward`` (−1) if not, ``success_reward`` (+10) on success, ``timeout_penalty`` (−1)
  when Lean timed out; after ``max_steps`` tactics without success the episode ends with
  ``max_steps_penalty`` (−2); an empty tactic counts as a rejected step.

The protocol is the Kimina server's ``POST /api/check``: ``{"snippets": [{"id", "code"}], "timeout",
"debug", "reuse", "infotree"}`` -> ``{"results": [{"id", "time", "error", "response": {"messages":
[{"severity", "pos", "endPos", "data"}], "sorries": [...]}}]}`` (a REPL failure comes back as
``error``, or as ``response: {"message": ...}``). Requests go through ``httpx`` with retries and
backoff; a server that stays unreachable stops the run with an error naming ``server_url`` (a
silently dead prover would train on noise). The API key, if any, comes from the environment
variable ``api_key_env``.

Running it: start a Kimina Lean server (its README: a Lean toolchain, Mathlib, then the server on
port 8000), then ``python -m ragen_jax.launch --config configs/lean.py --config.env.data_path=F.jsonl
--config.env.server_url=http://127.0.0.1:8000``.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import numpy as np

from environments.code.env import cut_text

DEFAULT_IMPORTS = "import Mathlib\nimport Aesop\nset_option maxHeartbeats 400000\nopen BigOperators Real Nat Topology Rat"


def load_theorems(data_path: str | None) -> list[dict]:
    if not data_path:
        raise ValueError("config.env.data_path is required: a JSONL file of theorems (formal_statement, optional "
                         "natural_language_statement / imports / preamble), e.g. miniF2F exported to JSONL")
    path = Path(data_path)
    if not path.is_file():
        raise ValueError(f"config.env.data_path={data_path!r} is not a file (a JSONL file of Lean theorems)")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    for i, r in enumerate(rows):
        if not isinstance(r.get("formal_statement"), str) or not r["formal_statement"].strip():
            raise ValueError(f"{path}:{i + 1}: a theorem needs a non-empty 'formal_statement'")
    if not rows:
        raise ValueError(f"{path} holds no theorems")
    return rows


def verdict(result: dict) -> tuple[str, bool, bool, list[dict]]:
    """``(status, accepted, success, messages)`` of one ``/api/check`` result, by the original's rules."""
    error = result.get("error")
    if error:
        return ("timeout" if "timed out" in str(error).lower() else "error"), False, False, \
            [{"severity": "error", "data": str(error)}]
    response = result.get("response")
    if not isinstance(response, dict):
        return "error", False, False, [{"severity": "error", "data": "the Lean server returned no response"}]
    if "message" in response and "messages" not in response:  # the REPL itself refused the command
        return "error", False, False, [{"severity": "error", "data": str(response["message"])}]
    messages = [m for m in response.get("messages") or [] if isinstance(m, dict)]
    errors = [m for m in messages if str(m.get("severity", "")).lower() == "error"]
    blocking = [m for m in errors if "unsolved goals" not in str(m.get("data", "")).lower()]
    sorry = bool(response.get("sorries"))
    accepted = not blocking and not sorry
    success = not errors and not sorry
    return ("valid" if accepted else "invalid"), accepted, success, messages


class LeanEnv:
    """One theorem per episode, one tactic per step (see the module docstring)."""

    action_names = None  # free text: a tactic
    instruction = ("You are proving a theorem in Lean 4 with Mathlib, one tactic per turn. Answer with exactly one "
                   "tactic inside <answer> </answer>, e.g. <answer>nlinarith [sq_nonneg (a - b)]</answer>. A rejected "
                   "tactic is not added to the proof; sorry is never accepted.\n")

    def __init__(self, data_path: str | None = None, server_url: str = "http://127.0.0.1:8000",
                 api_key_env: str | None = None, request_timeout_s: float = 30.0, max_retries: int = 3,
                 max_steps: int = 100, step_penalty: float = -0.1, valid_step_reward: float = 1.0,
                 invalid_step_reward: float = -1.0, success_reward: float = 10.0, timeout_penalty: float = -1.0,
                 max_steps_penalty: float = -2.0, default_imports: str = DEFAULT_IMPORTS,
                 max_feedback_chars: int = 600):
        self.theorems = load_theorems(data_path)
        self.server_url = server_url.rstrip("/")
        key = os.environ.get(api_key_env) if api_key_env else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.request_timeout_s = float(request_timeout_s)
        self.max_retries = int(max_retries)
        self._http = httpx.Client(timeout=self.request_timeout_s + 30.0, headers=headers)
        self.rules = dict(step_penalty=float(step_penalty), valid=float(valid_step_reward),
                          invalid=float(invalid_step_reward), success=float(success_reward),
                          timeout=float(timeout_penalty), max_steps=float(max_steps_penalty))
        self.max_steps = int(max_steps)
        self.default_imports = default_imports
        self.max_feedback_chars = int(max_feedback_chars)
        self.theorem: dict | None = None
        self.tactics: list[str] = []
        self.steps = 0
        self.feedback = ""

    # ---- the proof text ----------------------------------------------------------------
    def proof(self, tactics: list[str]) -> str:
        t = self.theorem
        parts = [(t.get("imports") or self.default_imports).strip()]
        if t.get("preamble"):
            parts.append(t["preamble"].strip())
        body = t["formal_statement"].rstrip() + "".join("\n  " + line for tac in tactics for line in tac.splitlines())
        parts.append(body)
        return "\n\n".join(parts) + "\n"

    # ---- the episode -------------------------------------------------------------------
    def reset(self, seed: int) -> str:
        self.theorem = self.theorems[int(np.random.default_rng(seed).integers(len(self.theorems)))]
        self.tactics, self.steps, self.feedback = [], 0, ""
        return self.render()

    def render(self) -> str:
        t = self.theorem
        lines = []
        if t.get("natural_language_statement"):
            lines += ["Informal statement:", t["natural_language_statement"].strip(), ""]
        lines += ["Proof so far:", t["formal_statement"].rstrip()]
        lines += ["  " + line for tac in self.tactics for line in tac.splitlines()]
        lines += ["", f"Tactics accepted: {len(self.tactics)}; steps used: {self.steps}/{self.max_steps}."]
        if self.feedback:
            lines += ["Lean: " + self.feedback]
        return "\n".join(lines) + "\n"

    def step(self, action: str):
        tactic = action.strip()
        r = self.rules
        self.steps += 1
        if not tactic:
            status, accepted, success, messages = "invalid", False, False, [{"severity": "error",
                                                                              "data": "empty tactic"}]
        else:
            status, accepted, success, messages = verdict(self.check(self.proof(self.tactics + [tactic])))
        reward = r["step_penalty"] + (r["valid"] if accepted else r["invalid"])
        reward += r["success"] if success else 0.0
        reward += r["timeout"] if status == "timeout" else 0.0
        if accepted:
            self.tactics.append(tactic)
        done = success
        if not success and self.steps >= self.max_steps:
            done = True
            reward += r["max_steps"]
        self.feedback = self._describe(status, accepted, success, messages)
        info = {"success": success, "action_is_valid": accepted, "action_is_effective": accepted, "status": status}
        return self.render(), float(reward), done, info

    def _describe(self, status, accepted, success, messages) -> str:
        if success:
            return "the proof is complete."
        head = {"timeout": "timed out", "error": "error", "valid": "accepted", "invalid": "rejected"}[status]
        shown = [m for m in messages if str(m.get("severity", "")).lower() in ("error", "warning")]
        text = "; ".join(str(m.get("data", "")).strip() for m in shown)
        out = f"{head}." + (f" {text}" if text else "")
        return cut_text(out, self.max_feedback_chars)

    # ---- the server --------------------------------------------------------------------
    def check(self, code: str) -> dict:
        """One ``/api/check`` result for ``code``; retried with backoff, then an error naming the server."""
        body = {"snippets": [{"id": f"step-{self.steps}", "code": code}], "timeout": int(self.request_timeout_s),
                "debug": False, "reuse": True, "infotree": None}
        last = None
        for attempt in range(self.max_retries + 1):
            try:
                reply = self._http.post(self.server_url + "/api/check", json=body)
                if reply.status_code < 500:
                    reply.raise_for_status()
                    results = reply.json().get("results") or []
                    return results[0] if results else {"error": "the Lean server returned no result"}
                last = f"HTTP {reply.status_code}"
            except httpx.HTTPStatusError as e:
                raise ConnectionError(f"the Lean server at {self.server_url} refused the request: {e}") from None
            except (httpx.TransportError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            time.sleep(min(8.0, 0.5 * 2 ** attempt))
        raise ConnectionError(f"the Lean server at {self.server_url} did not answer after {self.max_retries + 1} tries "
                              f"({last}); start it (a Kimina Lean server) or set config.env.server_url")

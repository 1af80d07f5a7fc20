"""The Lean environment against a stand-in Kimina server on 127.0.0.1 that replays responses in the
server's ``/api/check`` format. No Lean toolchain installs on these machines, so the responses are
written by hand in that format (the messages Lean gives for these proofs), not recorded; the rules
checked are the original's: accepted = no error but ``unsolved goals`` and no ``sorry``; success =
no error and no ``sorry``; −0.1 a step, +1 / −1 accepted / rejected, +10 solved, −1 timed out,
−2 at the step cap. Rewards below are worked by hand from those rules.
"""
from __future__ import annotations

import json

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from environments.code.lean import LeanEnv, verdict  # noqa: E402
from tests.local_server import free_port, serving  # noqa: E402

STATEMENT = "theorem two_steps (a b : ℕ) (h : a = b) : a + 0 = b := by"
UNSOLVED = {"severity": "error", "pos": {"line": 6, "column": 52}, "endPos": {"line": 7, "column": 9},
            "data": "unsolved goals\na b : ℕ\nh : a = b\n⊢ a = b"}


def _result(messages=(), sorries=(), error=None):
    if error:
        return {"time": 0.1, "error": error, "response": None}
    return {"time": 0.1, "error": None, "response": {"messages": list(messages), "sorries": list(sorries), "env": 0}}


class StandIn:
    """``/api/check`` answering from ``replies`` (the last tactic of the proof -> a result);
    ``fail_first`` 503s before answering."""

    def __init__(self):
        self.replies = {
            "simp": _result([UNSOLVED]),  # progress, not finished: accepted
            "exact h": _result(),  # closes the goal: success
            "rfl": _result([{"severity": "error", "pos": {"line": 7, "column": 2},
                             "data": "The rfl tactic failed. Possible reasons: ..."}]),
            "sorry": _result([{"severity": "warning", "data": "declaration uses 'sorry'"}],
                             sorries=[{"pos": {"line": 7, "column": 2}, "goal": "⊢ a = b"}]),
            "omega": _result(error="Lean REPL command timed out."),
            "norm_num at h": {"time": 0.1, "error": None, "response": {"message": "unknown identifier 'norm_num'"}},
        }
        self.requests = []
        self.fail_first = 0
        app = fastapi.FastAPI()

        @app.post("/api/check")
        async def check(request: fastapi.Request):
            body = await request.json()
            self.requests.append(body)
            if self.fail_first > 0:
                self.fail_first -= 1
                return fastapi.responses.JSONResponse({"detail": "busy"}, status_code=503)
            out = []
            for snippet in body["snippets"]:
                last = snippet["code"].rstrip("\n").splitlines()[-1].strip()
                out.append({"id": snippet["id"], **self.replies[last]})
            return {"results": out}

        self.app = app


@pytest.fixture(scope="module")
def server():
    stand_in = StandIn()
    with serving(stand_in.app) as base:
        yield base, stand_in


@pytest.fixture()
def theorems(tmp_path):
    path = tmp_path / "theorems.jsonl"
    path.write_text(json.dumps({"name": "two_steps", "formal_statement": STATEMENT,
                                "natural_language_statement": "If a = b then a + 0 = b."}) + "\n")
    return str(path)


def test_a_proof_tactic_by_tactic(server, theorems):
    url, stand_in = server
    env = LeanEnv(data_path=theorems, server_url=url, max_steps=10)
    obs = env.reset(seed=0)
    assert "If a = b then a + 0 = b." in obs and STATEMENT in obs
    # Rejected: an error that is not "unsolved goals"; not added to the proof.
    obs, reward, done, info = env.step("rfl")
    assert (reward, done, info["action_is_valid"]) == (pytest.approx(-1.1), False, False)
    assert "rejected. The rfl tactic failed" in obs and env.tactics == []
    # A sorry is never accepted, whatever Lean's severity.
    obs, reward, done, info = env.step("sorry")
    assert (reward, done, info["action_is_valid"]) == (pytest.approx(-1.1), False, False)
    # Accepted with goals left: joins the proof, sent indented under the statement.
    obs, reward, done, info = env.step("simp")
    assert (reward, done, info["action_is_valid"], info["success"]) == (pytest.approx(0.9), False, True, False)
    assert env.tactics == ["simp"] and "\n  simp" in obs
    sent = stand_in.requests[-1]["snippets"][0]["code"]
    assert sent.startswith("import Mathlib") and sent.endswith(STATEMENT + "\n  simp\n")
    # A time-out: rejected and penalised.
    obs, reward, done, info = env.step("omega")
    assert (reward, info["status"]) == (pytest.approx(-0.1 - 1.0 - 1.0), "timeout")
    # The REPL refusing the command is an error.
    assert env.step("norm_num at h")[1] == pytest.approx(-1.1)
    # Success: -0.1 + 1 + 10, the episode ends.
    obs, reward, done, info = env.step("exact h")
    assert (reward, done, info["success"]) == (pytest.approx(10.9), True, True)
    assert stand_in.requests[-1]["snippets"][0]["code"].endswith("  simp\n  exact h\n")


def test_the_step_cap_and_the_empty_tactic(server, theorems):
    url, _ = server
    env = LeanEnv(data_path=theorems, server_url=url, max_steps=2)
    env.reset(seed=1)
    assert env.step("   ")[1:3] == (pytest.approx(-1.1), False)
    assert env.step("rfl")[1:3] == (pytest.approx(-1.1 - 2.0), True)


def test_the_rules_on_raw_results():
    assert verdict(_result([UNSOLVED]))[1:3] == (True, False)
    assert verdict(_result())[1:3] == (True, True)
    assert verdict(_result([{"severity": "warning", "data": "unused variable"}]))[1:3] == (True, True)
    assert verdict(_result(sorries=[{"goal": "⊢ True"}]))[1:3] == (False, False)
    assert verdict(_result(error="Lean REPL command timed out."))[0] == "timeout"


def test_a_busy_server_is_retried_and_a_dead_one_is_named(server, theorems):
    url, stand_in = server
    env = LeanEnv(data_path=theorems, server_url=url, max_retries=2)
    env.reset(seed=0)
    stand_in.fail_first = 2
    assert env.step("simp")[1] == pytest.approx(0.9)
    dead = free_port()
    env = LeanEnv(data_path=theorems, server_url=f"http://127.0.0.1:{dead}", max_retries=1)
    env.reset(seed=0)
    with pytest.raises(ConnectionError, match=f"the Lean server at http://127.0.0.1:{dead} did not answer"):
        env.step("simp")


def test_bad_theorem_files_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="config.env.data_path is required"):
        LeanEnv(data_path=None)
    bad = tmp_path / "t.jsonl"
    bad.write_text(json.dumps({"name": "x"}) + "\n")
    with pytest.raises(ValueError, match="t.jsonl:1: a theorem needs a non-empty 'formal_statement'"):
        LeanEnv(data_path=str(bad))

"""Chat framing taken from the tokenizer's own chat template, computed once on the host.

The template is rendered on marker messages and cut at the markers, which yields the literal text
the template puts around each role's content. The rollout never re-renders the template: it
writes these framing strings as token pieces around the device-built content, so the conversation
in the KV cache is exactly what ``apply_chat_template`` would have produced for the same messages.

Works for any template that frames each message independently (Qwen ``<|im_start|>``/``<|im_end|>``,
Llama-3 headers, SmolLM, ...). A template that rewrites earlier messages (e.g. drops earlier
assistant turns) is detected and rejected, because no append-only KV cache can represent it.
"""
from __future__ import annotations

import dataclasses

_MARK = "\u2063{}\u2063"  # invisible separator around an index: never produced by a template itself


@dataclasses.dataclass(frozen=True)
class ChatFraming:
    """Framing text around message contents.

    A conversation ``[system s, user u1, assistant a1, user u2, ..., assistant aT]`` renders as::

        preamble + s + system_to_user + u1 + user_to_assistant + a1
                 + assistant_to_user + u2 + user_to_assistant + a2 + ... + aT + assistant_end

    ``user_to_assistant`` is the generation prompt after a user message (e.g.
    ``"<|im_end|>\\n<|im_start|>assistant\\n"``); ``assistant_end`` closes the final assistant message
    (``"<|im_end|>\\n"``) and ``assistant_to_user`` is ``assistant_end`` followed by the next user header.
    ``end_of_turn`` is the special token that ends an assistant message (the model's stop token).
    """

    preamble: str
    system_to_user: str
    user_to_assistant: str
    assistant_to_user: str
    assistant_end: str
    end_of_turn: str
    trims_content: bool = False  # the template strips surrounding whitespace from each content

    @property
    def user_header(self) -> str:
        """The user-message opening that follows ``assistant_end``."""
        return self.assistant_to_user[len(self.assistant_end):]

    def render(self, system: str, users: list[str], assistants: list[str]) -> str:
        """The conversation text (host reference), ``len(assistants)`` in ``{len(users) - 1, len(users)}``."""
        c = (lambda x: x.strip()) if self.trims_content else (lambda x: x)
        text = self.preamble + c(system) + self.system_to_user
        for i, u in enumerate(users):
            if i:
                text += self.assistant_to_user
            text += c(u) + self.user_to_assistant
            if i < len(assistants):
                text += assistants[i]
        if len(assistants) == len(users) and users:
            text += self.assistant_end
        return text


def _apply(tokenizer, messages, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _between(text: str, a: str | None, b: str | None) -> str:
    start = 0 if a is None else text.index(a) + len(a)
    end = len(text) if b is None else text.index(b, start)
    return text[start:end]


def chat_framing(tokenizer) -> ChatFraming:
    """Cut the tokenizer's chat template into :class:`ChatFraming` pieces.

    Raises ``ValueError`` naming the problem when the tokenizer has no chat template or the
    template is not append-only.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template (tokenizer.chat_template is empty); set one, e.g. "
            "tokenizer.chat_template = <a Qwen or Llama-3 style Jinja template>, or load an instruct "
            "tokenizer that ships one"
        )
    # Contents padded with whitespace reveal templates that trim message contents (Llama-3's
    # ``| trim``); the framing is then cut at the bare markers and ``trims_content`` is set.
    m = [" \n" + _MARK.format(i) + "\n " for i in range(5)]
    roles = ["system", "user", "assistant", "user", "assistant"]
    msgs = [{"role": r, "content": c} for r, c in zip(roles, m)]
    full = _apply(tokenizer, msgs, add_generation_prompt=False)
    trims_content = m[0] not in full
    if trims_content:
        m = [mk.strip() for mk in m]
        msgs = [{"role": r, "content": c} for r, c in zip(roles, m)]
    for mark in m:
        if full.count(mark) != 1:
            raise ValueError(
                "the chat template does not render each message's content verbatim exactly once "
                f"(marker {mark!r} appears {full.count(mark)} times); an append-only rollout needs a "
                "template that frames messages independently"
            )
    preamble = _between(full, None, m[0])
    system_to_user = _between(full, m[0], m[1])
    user_to_assistant = _between(full, m[1], m[2])
    assistant_to_user = _between(full, m[2], m[3])
    assistant_end = _between(full, m[4], None)
    if _between(full, m[3], m[4]) != user_to_assistant:
        raise ValueError("the chat template frames the second user turn differently from the first")

    # The generation prompt must be exactly the opening of the assistant message: then a prompt
    # rendered for generation is a prefix of the finished conversation (append-only).
    gen = _apply(tokenizer, msgs[:2], add_generation_prompt=True)
    if (preamble + m[0] + system_to_user + m[1] + user_to_assistant) != gen:
        raise ValueError(
            "the chat template's generation prompt differs from the opening of a rendered assistant "
            f"message ({gen!r} vs the framing {user_to_assistant!r}); the rollout cannot "
            "append turns to one KV cache with it"
        )
    if not assistant_to_user.startswith(assistant_end):
        raise ValueError(
            f"the chat template closes a final assistant message with {assistant_end!r} but closes a "
            f"middle one with {assistant_to_user!r}; expected the latter to start with the former"
        )
    end_of_turn = _end_of_turn(tokenizer, assistant_end)
    return ChatFraming(
        preamble, system_to_user, user_to_assistant, assistant_to_user, assistant_end, end_of_turn, trims_content
    )


def system_with_tools(tokenizer, system: str, tools: list[dict], framing: ChatFraming | None = None) -> str | None:
    """The system message's content as the tokenizer's own chat template writes it when given
    ``tools=`` (OpenAI function schemas): Qwen2.5's and Hermes-style templates append the tool list
    and the ``<tool_call>`` convention to the system message. None when the template leaves the tools
    out (it ignores ``tools``) or puts them outside the system message, where the append-only
    framing (``chat_framing``) cannot carry them.
    """
    framing = framing or chat_framing(tokenizer)  # a caller that has the tokenizer's framing passes it
    user = _MARK.format("user")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=False)
    except Exception:  # noqa: BLE001 - a template that cannot render tools lists none
        return None
    end = text.find(framing.system_to_user + user)
    if not text.startswith(framing.preamble) or end < 0:
        return None
    content = text[len(framing.preamble):end]
    names = [t["function"]["name"] for t in tools]
    if system.strip() not in content or not all(name in content for name in names):
        return None
    return content


def _end_of_turn(tokenizer, assistant_end: str) -> str:
    """The special token that opens ``assistant_end`` (``<|im_end|>``, ``<|eot_id|>``, ...)."""
    specials = sorted(
        {t for t in tokenizer.all_special_tokens} | {str(t) for t in tokenizer.added_tokens_decoder.values()},
        key=len,
        reverse=True,
    )
    stripped = assistant_end.lstrip()
    for tok in specials:
        if tok and stripped.startswith(tok):
            return tok
    raise ValueError(
        f"the chat template ends an assistant message with {assistant_end!r}, which does not start with "
        "a special token; the rollout needs an end-of-turn token to stop generation"
    )


def split_conversation(framing: ChatFraming, text: str) -> tuple[list[dict], str | None]:
    """Cut a rendered conversation back into OpenAI-style messages — the inverse of ``render``.

    ``text`` is ``preamble + system + system_to_user + u1 + user_to_assistant + a1 + ...`` as the
    rollout writes it. -> ``(messages, open_reply)``: ``messages`` alternate ``system``, ``user``,
    ``assistant`` (each ``{"role", "content"}``); ``open_reply`` is the text of an assistant message
    that was opened and not closed (the forced ``<think>`` of a turn about to be sampled), None when
    the conversation ends on a closed message. A final assistant message closed by the end of
    turn alone (the rollout's last close) counts as closed.
    """
    if not text.startswith(framing.preamble):
        raise ValueError(f"the conversation does not open with the chat template's preamble {framing.preamble!r}")
    pos = len(framing.preamble)
    end = text.find(framing.system_to_user, pos)
    if end < 0:
        raise ValueError("the conversation has no user message after its system message")
    messages = [{"role": "system", "content": text[pos:end]}]
    pos = end + len(framing.system_to_user)
    while True:
        end = text.find(framing.user_to_assistant, pos)
        if end < 0:  # a user message with no reply opened (cannot come from the rollout)
            messages.append({"role": "user", "content": text[pos:]})
            return messages, None
        messages.append({"role": "user", "content": text[pos:end]})
        pos = end + len(framing.user_to_assistant)
        end = text.find(framing.assistant_to_user, pos)
        if end < 0:
            reply = text[pos:]
            for close in (framing.assistant_end, framing.end_of_turn):
                if close and reply.endswith(close):
                    messages.append({"role": "assistant", "content": reply[:-len(close)]})
                    return messages, None
            return messages, reply
        messages.append({"role": "assistant", "content": text[pos:end]})
        pos = end + len(framing.assistant_to_user)


def conversation_segments(framing: ChatFraming, messages: list[dict], *, continue_final: bool,
                          user_lines: bool = False) -> list[str]:
    """The rendered conversation as the rollout tokenises it: piece by piece, never across a message
    boundary. Concatenated they are the chat template's text (``render``, plus the generation prompt
    or, with ``continue_final``, the open last assistant message); tokenising each on its own gives
    the token sequence a policy trained by this package saw (BPE run over the whole text may merge
    across a boundary, e.g. a template's ``"\\n"`` with a content's leading ``"\\n"``).

    ``messages``: one ``system`` message, then ``user`` / ``assistant`` alternating from a ``user``.
    """
    c = (lambda x: x.strip()) if framing.trims_content else (lambda x: x)
    out = [framing.preamble + c(messages[0]["content"]) + framing.system_to_user]
    rest = messages[1:]
    for i, m in enumerate(rest):
        last = i == len(rest) - 1
        if m["role"] == "user":
            if i:
                out += [framing.assistant_end, framing.user_header]
            content = c(m["content"])
            out += (content.splitlines(keepends=True) if user_lines else [content]) + [framing.user_to_assistant]
        elif last and continue_final:
            out.append(m["content"])  # continued as written: no trimming, no close
        else:
            out.append(c(m["content"]))
    if rest and rest[-1]["role"] == "assistant" and not continue_final:
        out.append(framing.assistant_end)
    return [s for s in out if s]

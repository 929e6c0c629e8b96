"""Chat: a model's chat template, and conversations that keep their KV cache across turns.

A bundle compiled from a model with a chat template (an instruct model's
tokenizer config, or a GGUF's ``tokenizer.chat_template``) stores it in the
manifest (``tokenizer.chat_template``). :class:`ChatTemplate` renders a list of
``{"role", "content"}`` messages with it the way HuggingFace transformers'
``apply_chat_template`` does: Jinja2 in a sandbox, ``trim_blocks`` and
``lstrip_blocks``, loop controls, the tokenizer's special tokens as variables,
``raise_exception`` and ``strftime_now``, a ``tojson`` that keeps non-ASCII
text, and ``{% generation %}`` blocks rendered as their body.

:class:`Conversation` runs a multi-turn chat on a :class:`~llmc.runtime.Session`.
Each turn renders the whole conversation, keeps the cached positions whose
tokens are unchanged (the longest common prefix of what the cache holds and
the new rendering) and prefills only the rest, so a turn costs its own tokens,
not the history's. The renderer's text of an earlier reply can tokenize
differently from the ids that were generated; the cache is then rewound to
where they first differ.

Jinja2 is the only dependency this adds to the runtime (no torch, no transformers).
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterator, Sequence

from llmc.runtime.errors import BundleError, ChatTemplateError, PromptError, PromptTooLongError
from llmc.runtime.session import Metrics, Session, TokenEvent, check_utf8


def _environment():
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ChatTemplateError("chat templates need Jinja2, which is not installed", hint="pip install jinja2") from e

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks): its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return time.strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env, jinja2


class ChatTemplate:
    """A chat template (Jinja2 source) and the special-token strings it may write."""

    def __init__(self, source: str, variables: dict[str, str] | None = None, where: str = "the model") -> None:
        env, self._jinja2 = _environment()
        try:
            self._template = env.from_string(source)
        except self._jinja2.TemplateError as e:
            raise ChatTemplateError(f"{where}: the chat template does not parse: {e}",
                                    hint="the template comes from the model's tokenizer config; fix it there and recompile") from e
        self.variables = dict(variables or {})

    @classmethod
    def of(cls, session: Session) -> "ChatTemplate":
        """The chat template of ``session``'s bundle (``BundleError`` if it has none)."""
        tok = session.manifest.get("tokenizer") or {}
        source = tok.get("chat_template")
        if session.tokenizer is None:
            raise PromptError(f"{session.bundle} has no tokenizer, so it cannot take text or chat",
                              hint="pass token ids (llmc run --prompt-ids), or compile from a model directory that has tokenizer files")
        if not source:
            raise BundleError(f"{session.bundle} has no chat template: its model did not come with one",
                              hint="run it with a plain --prompt (no chat formatting), or compile an instruct model "
                                   "whose tokenizer config has a chat_template")
        if not isinstance(source, str):
            raise BundleError(f"{session.bundle}: the manifest's chat_template is not a string",
                              hint="recompile the bundle with this version of llmc")
        variables = tok.get("special_tokens")
        if not isinstance(variables, dict):  # bundles of earlier versions: the tokens of the BOS and first EOS id
            ids = {"bos_token": tok.get("bos_token_id"), "eos_token": min(tok.get("eos_token_ids") or [], default=None)}
            variables = {k: session.tokenizer.id_to_token(int(i)) or "" for k, i in ids.items() if i is not None}
        return cls(source, variables, where=str(session.bundle))

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The text of ``messages`` in the model's format; with ``add_generation_prompt``, followed by
        what opens the assistant's reply."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} must be a dict with string 'role' and 'content', got {m!r}")
        try:
            # tools and documents are None, as transformers passes them when there are none
            return self._template.render(messages=list(messages), tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                                         **self.variables)
        except self._jinja2.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template refused the conversation: {e}",
                                    hint="check the order of roles (many templates want user and assistant turns to alternate)") from e


class Conversation:
    """A multi-turn chat on ``session``: :meth:`say` one user turn at a time. The conversation owns the
    session's cache: running the session otherwise between turns needs :meth:`reset` after."""

    def __init__(self, session: Session, system: str | None = None) -> None:
        if system is not None:
            check_utf8(system, "the system message")
        self.session = session
        self.template = ChatTemplate.of(session)
        self.system = system
        self._open: _Turn | None = None  # the reply being streamed
        self.reset()

    def reset(self) -> None:
        """Start over: no messages (but the system prompt), an empty cache."""
        self._finish()
        self.messages: list[dict[str, str]] = [{"role": "system", "content": self.system}] if self.system else []
        self._cached: list[int] = []  # the token ids at the cache's positions 0..len-1
        self.session.reset()

    def prompt_ids(self, user: str) -> list[int]:
        """The token ids of the conversation with ``user`` as the next turn, ready for the reply
        (a reply still streaming is ended and recorded first)."""
        self._finish()
        check_utf8(user, "the message")
        text = self.template.render([*self.messages, {"role": "user", "content": user}])
        return self.session.encode(text, add_special_tokens=False)

    def say(self, user: str, max_new_tokens: int = 256, *, metrics: Metrics | None = None, **sampling: Any) -> Iterator[TokenEvent]:
        """Add the user turn ``user`` and stream the reply.

        The reply joins the conversation when its stream ends or is closed after its first token,
        and otherwise (never read, or left unfinished) when the next turn, :meth:`prompt_ids` or
        :meth:`reset` starts: always with the tokens it had produced. Raises
        :class:`PromptError` (nothing changed) if the conversation no longer fits the bundle's
        context or renders to no tokens."""
        s = self.session
        ids = self.prompt_ids(user)
        if not ids:
            raise PromptTooLongError("the conversation renders to no tokens with the model's chat template",
                                     hint="give a non-empty message")
        if len(ids) >= s.max_context:
            raise PromptTooLongError(
                f"the conversation has {len(ids)} tokens with this turn; the bundle's --max-context is {s.max_context}",
                hint="start a new conversation (/reset in llmc chat), or recompile with a larger --max-context")
        keep = 0
        for a, b in zip(self._cached, ids):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(ids) - 1, s.position)  # at least one token to prefill: its logits start the reply
        s.rewind(keep)
        self._cached = self._cached[:keep]
        metrics = metrics if metrics is not None else Metrics()
        events = s.continue_stream(ids[keep:], max_new_tokens, metrics=metrics, **sampling)
        self.messages.append({"role": "user", "content": user})
        self._cached = list(ids)
        turn = self._open = _Turn(events)
        return self._reply(turn)

    def _reply(self, turn: "_Turn") -> Iterator[TokenEvent]:
        try:
            for ev in turn.events:
                turn.generated.append(ev.token_id)
                yield ev
        finally:
            self._finish(turn)

    def _finish(self, turn: "_Turn | None" = None) -> None:
        """Record the open reply (``turn``, if it is still the open one): the generated tokens the cache
        holds (all but the last one yielded, which was never fed), and its text as the assistant's
        message (without end-of-turn tokens)."""
        if self._open is None or (turn is not None and turn is not self._open):
            return
        turn, self._open = self._open, None
        turn.events.close()  # a stream left unfinished stops here; later next() calls end it
        fed = max(0, self.session.position - len(self._cached))
        self._cached += turn.generated[:fed]
        eos = self.session.eos_ids
        self.messages.append({"role": "assistant", "content": self.session.decode_text([t for t in turn.generated if t not in eos])})


class _Turn:
    """A reply being streamed: the session's token stream and the tokens it has yielded."""

    def __init__(self, events: Iterator[TokenEvent]) -> None:
        self.events = events
        self.generated: list[int] = []

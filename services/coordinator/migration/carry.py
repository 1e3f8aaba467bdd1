"""What one request keeps so it can continue on another instance, read off the answer as it is
relayed, and the request that continues it (docs/migration.md).

The engine is asked for token ids (``return_token_ids``, vLLM's): the prompt's, once, and each
event's output ids. A continuation then sends the prompt ids followed by the output ids already
delivered — as a completion's ``prompt``, or as a chat request's
``kv_transfer_params.prompt_token_ids`` (which vLLM uses instead of rendering the messages, so
the chat's tool and reasoning parsers still run) — and nothing is detokenized and tokenized
again on the way: the new engine sees exactly the context the failed one had. Where an engine
gives no ids (SGLang) the text delivered is sent instead (a completion's prompt plus the text; a
chat's messages plus a partial assistant message with ``continue_final_message``), which is what
the client saw, though its tokenization may differ from the one the engine generated.

Every event reaches the client as it came, except that the token ids the client did not ask for
are removed and, on a continuation, the answer keeps the first leg's ``id`` and ``created``, the
new leg's role event is dropped, and ``usage`` counts the prompt once and the whole output.
"""

from __future__ import annotations

import re
from typing import Any

from motor_mesh.coordinator.bodies import KV, _dumps, loads
from motor_mesh.coordinator.migration.budget import STEP, StateBudget
from motor_mesh.coordinator.migration.refusal import refusal, single_prompt
from motor_mesh.coordinator.migration.sse import events_of

DONE = b"[DONE]"
_PROMPT_IDS = b'"prompt_token_ids"'
_TOOLS = b'"tool_calls"'
_DONE_EVENT = b"data: [DONE]"
# A key and its value found in the bytes of JSON: inside a string every quote is escaped, so
# these can only match the keys themselves.
_IDS_CUT = re.compile(rb',"token_ids":\[([0-9, ]*)\]')
_NO_FINISH = b'"finish_reason":null'
_FINISH_KEY = b'"finish_reason":"'
ID_BYTES = 8  # what one kept token id is counted as


class Carry:
    """One request's continuation state; the relay feeds it every event of every leg."""

    __slots__ = (
        "before",
        "budget",
        "chat",
        "client_ids",
        "count",
        "created",
        "done",
        "error",
        "finish",
        "gap_from",
        "held",
        "id",
        "id_parts",
        "ids_ok",
        "last",
        "model",
        "moves",
        "prompt_ids",
        "prompt_n",
        "reason",
        "refused",
        "req",
        "size",
        "started",
        "stream",
        "text",
        "text_ok",
        "usage_sent",
        "want_ids",
    )

    def __init__(
        self, req: dict[str, Any], chat: bool, budget: StateBudget, raw_bytes: int, want_ids: bool
    ) -> None:
        self.req = req  # the client's request, as parsed
        self.chat = chat
        self.stream = bool(req.get("stream"))
        self.budget = budget
        self.want_ids = want_ids  # the engines are asked for token ids
        self.client_ids = bool(req.get("return_token_ids"))  # ... and the client wants them too
        # Why the request cannot continue once output was delivered; None: it can. A
        # non-streamed answer delivers nothing before its end: it always can.
        self.refused: str | None = refusal(req, chat) if self.stream else None
        self.prompt_ids: list[int] | None = None
        # Output ids delivered, as the engine wrote them ("12,34" per part: parsed only if the
        # request continues); ids_ok false once an event came without them.
        self.id_parts: list[bytes] = []
        self.ids_ok = True
        self.text: list[str] = []  # output text delivered
        self.text_ok = True  # the text is the whole output (no reasoning or tool-call deltas)
        self.count = 0  # output tokens delivered (by ids; else one per event with text)
        self.before = 0  # ... of them before the current leg began
        self.prompt_n: int | None = None  # the prompt's length in tokens, as the first leg said
        self.id: Any = None  # the first leg's answer id, created and model: the client's
        self.created: Any = None
        self.model: Any = None
        self.moves = 0  # continuations so far
        self.reason = ""  # why the last one was needed (Break.reason)
        self.finish: Any = None  # the finish_reason delivered, once one was
        self.done = False  # "data: [DONE]" delivered
        self.usage_sent = False
        self.error: dict[str, Any] | None = None  # an error event the current leg's engine sent
        self.started = False  # the response head went to the client
        self.last = 0.0  # loop time the last event reached the client
        self.gap_from: float | None = None  # ... as it was when the leg broke
        self.size = 0
        self.held = 0  # bytes taken from the budget
        if not self.stream:
            return  # a non-streamed answer is sent whole: a continuation starts afresh
        self._grow(raw_bytes)

    # -- the bound on kept state --------------------------------------------------------------

    def _grow(self, n: int) -> None:
        self.size += n
        if self.size <= self.held or self.refused in ("state_bytes", "state_total_bytes"):
            return
        if self.size > self.budget.per_request:
            self._forget("state_bytes")
            return
        # A step at a time (one check per step, not per token), smaller near a bound that has
        # little room left: one request must not take what several small ones would fit in.
        room = self.budget.total - self.budget.used
        step = max(self.size - self.held, min(STEP, room // 16))
        if not self.budget.take(step):
            self._forget("state_total_bytes")
            return
        self.held += step

    def _forget(self, why: str) -> None:
        """Past a bound: keep nothing more, and never continue."""
        self.refused = why
        self.text = []
        self.id_parts = []
        self.ids_ok = False
        self.prompt_ids = None
        self.release()

    def release(self) -> None:
        """The request is over: its kept bytes go back to the budget."""
        if self.held:
            self.budget.give(self.held)
            self.held = 0

    @property
    def keeping(self) -> bool:
        return self.refused is None

    # -- reading events -----------------------------------------------------------------------

    def feed(self, event: bytes) -> bytes | None:
        """One complete SSE event from the engine: what to send the client (None: nothing).
        An error event is kept in ``error`` and not sent: the caller decides."""
        if not event.startswith(b"data:"):
            return event  # a comment or another field: as it came
        payload = event[5:].strip()
        if payload == DONE:
            self.done = True
            return event
        try:
            obj = loads(payload)
        except (ValueError, RecursionError):
            return event
        if not isinstance(obj, dict):
            return event
        if "error" in obj and not obj.get("choices"):
            self.error = obj
            return None
        later = self.moves > 0
        changed = later
        if self.id is None:
            self.id, self.created, self.model = obj.get("id"), obj.get("created"), obj.get("model")
        elif later:
            obj["id"] = self.id
            if self.created is not None:
                obj["created"] = self.created
        if "prompt_token_ids" in obj:  # a chat answer's first event
            changed = True
            self._prompt(obj, obj.pop("prompt_token_ids"), later)
        drop = False
        choices = obj.get("choices")
        if isinstance(choices, list):
            for c in choices:
                if isinstance(c, dict):
                    changed |= self._choice(c, later)
                    drop = later and _empty_role_event(c)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage_sent = not choices
            if later:
                changed = True
                self._usage(usage)
            elif self.prompt_n is None and isinstance(usage.get("prompt_tokens"), int):
                self.prompt_n = usage["prompt_tokens"]
        if drop and not isinstance(usage, dict):
            return None
        if not changed:
            return event
        return b"data: " + _dumps(obj) + b"\n\n"

    def feed_block(self, block: bytes) -> bytes:
        """Complete SSE events (each with its blank line) as they arrived together: what to
        send the client. An error event stops the block (what came before it is returned) and
        is kept in ``error``.

        A first leg's events are read as bytes, the block at once: the output ids collected and
        cut out, the finish and the end looked for, and nothing parsed. Parsing and dumping each
        event as JSON cost more than relaying it; only the first event (the answer's id and the
        prompt's ids), a continuation's, and anything unusual (an error, a tool call, a client
        that asked for the ids itself) take the parsing way."""
        if self.moves or self.client_ids or not self.want_ids or self.id is None:
            if self.id is None and not self.moves:
                return self._first(block)
            return self._each(block)  # a continuation, ids the client wants, or text to keep
        # Most blocks are only output: each of their events says "finish_reason":null (an
        # error, the end, a usage-only event and a finish do not), so two counts tell. Anything
        # else is looked at key by key.
        marked = block.count(_NO_FINISH) != block.count(b"\n\n")
        if (marked and (b"\r" in block or b'"error"' in block or _PROMPT_IDS in block)) or (
            self.chat and _TOOLS in block
        ):
            return self._each(block)
        parts = _IDS_CUT.split(block)  # the text between the ids, and the ids (odd items)
        found = parts[1::2]
        if len(found) != block.count(b'"finish_reason":'):
            return self._each(block)  # a choice without its ids: its text must be kept
        if found:
            joined = b",".join(found)
            self.count += joined.count(b",") + 1 - found.count(b"")
            if self.ids_ok and self.refused is None:
                self.id_parts.append(joined)
                self.size += len(joined)
                if self.size > self.held:
                    self._grow(0)
            block = b"".join(parts[::2])
        self.text_ok = False  # the text is not kept this way: the ids carry the output
        if marked:
            at = block.find(_FINISH_KEY)  # the one choice's finish (a string: not null)
            if at >= 0:
                at += len(_FINISH_KEY)
                self.finish = block[at : block.find(b'"', at)].decode("utf-8", "replace")
            if block.startswith(_DONE_EVENT) or b"\n\n" + _DONE_EVENT in block:
                self.done = True
            if b'"choices":[]' in block and b'"usage":{' in block:
                self.usage_sent = True
        return block

    def _first(self, block: bytes) -> bytes:
        """A first leg's first event (its answer's id, the prompt's ids) the parsing way, the
        rest of the block as :meth:`feed_block` reads it."""
        cut = block.find(b"\n\n") + 2
        if not cut:  # \r\n line ends
            return self._each(block)
        head = self.feed(block[:cut]) or b""
        if self.error is not None or cut >= len(block) or self.id is None:
            return head + (b"" if self.error is not None or cut >= len(block) else self._each(block[cut:]))
        return head + self.feed_block(block[cut:])

    def _each(self, block: bytes) -> bytes:
        """``block`` one event at a time, the parsing way."""
        sent = []
        for event in events_of(block)[0]:
            data = self.feed(event)
            if self.error is not None:
                break
            if data:
                sent.append(data)
        return b"".join(sent)

    def _prompt(self, holder: dict[str, Any], pids: Any, later: bool) -> None:
        if not later and isinstance(pids, list):
            if self.prompt_n is None:
                self.prompt_n = len(pids)
            if self.keeping and self.prompt_ids is None:
                self.prompt_ids = pids
                self._grow(ID_BYTES * len(pids))
            if self.client_ids:
                holder["prompt_token_ids"] = pids

    def _choice(self, c: dict[str, Any], later: bool) -> bool:
        changed = False
        if "prompt_token_ids" in c:  # a completion answer's first event
            changed = True
            self._prompt(c, c.pop("prompt_token_ids"), later)
        ids = c.get("token_ids") if self.client_ids else c.pop("token_ids", None)
        if ids is not None and not self.client_ids:
            changed = True
        if self.chat:
            delta = c.get("delta")
            if not isinstance(delta, dict):
                return changed
            text = delta.get("content")
            if delta.get("tool_calls"):
                # A tool call's parser state is the engine's: it cannot resume mid-call.
                if self.refused is None:
                    self.refused = "tool_call_streamed"
            if delta.get("reasoning_content") or delta.get("reasoning"):
                self.text_ok = False  # output beyond the content: only ids carry it
            if later and "role" in delta:
                del delta["role"]
                changed = True
        else:
            text = c.get("text")
        self._took(text if isinstance(text, str) else "", ids)
        finish = c.get("finish_reason")
        if finish is not None:
            self.finish = finish
        return changed

    def _took(self, text: str, ids: Any) -> None:
        if isinstance(ids, list):  # empty with text: bytes the detokenizer had held back
            if ids:
                self.count += len(ids)
                if self.ids_ok and self.keeping:
                    part = b",".join(b"%d" % i for i in ids if isinstance(i, int))
                    self.id_parts.append(part)
                    self._grow(len(part))
        elif text:
            self.count += 1  # an engine that gives no ids streams about a token per event
            self.ids_ok = False
        if text and self.keeping:
            self.text.append(text)
            self._grow(len(text))

    def _usage(self, usage: dict[str, Any]) -> None:
        """A continuation's usage counts its prompt (the original plus the output delivered)
        and only its own output: the client's counts the prompt once and the whole output."""
        out = usage.get("completion_tokens")
        if not isinstance(out, int):
            return
        prompt = self.prompt_n
        if prompt is None:
            p = usage.get("prompt_tokens")
            prompt = p - self.before if isinstance(p, int) else 0
        usage["prompt_tokens"] = prompt
        usage["completion_tokens"] = out + self.before
        usage["total_tokens"] = prompt + out + self.before

    # -- continuing ---------------------------------------------------------------------------

    @property
    def over(self) -> bool:
        """The answer already ended (finish_reason or [DONE] delivered): nothing to continue."""
        return self.done or self.finish is not None

    def why_not(self) -> str | None:
        """Why the request cannot continue now; None when it can."""
        if not self.count:
            return None if self.refused in (None, "tool_call_streamed") else _bound(self.refused)
        if self.refused is not None:
            return self.refused
        if not (self.ids_ok and self.prompt_ids is not None) and not self._text_continues():
            return "no_token_ids"
        return None

    def output_ids(self) -> list[int]:
        """The output token ids delivered, parsed from what was kept."""
        return [int(x) for x in b",".join(self.id_parts).split(b",") if x.strip()]

    def _text_continues(self) -> bool:
        if not self.text_ok:
            return False
        return self.chat or isinstance(single_prompt(self.req.get("prompt")), str)

    def next_request(self) -> dict[str, Any] | None:
        """The request that continues this one (call :meth:`why_not` first); None when the
        output already delivered used the whole ``max_tokens``: the answer only has to end."""
        req = dict(self.req)
        for key in ("echo", "prompt_logprobs"):
            req.pop(key, None)  # delivered with the first leg
        if self.want_ids:
            req["return_token_ids"] = True
        n = self.count
        self.before = n
        if not n:
            return req
        if self.ids_ok and self.prompt_ids is not None:
            context = self.prompt_ids + self.output_ids()
            if self.chat:
                req[KV] = {"prompt_token_ids": context}
            else:
                req["prompt"] = context
        else:
            text = "".join(self.text)
            if self.chat:
                messages = list(req.get("messages") or [])
                last = messages[-1] if messages else None
                if (
                    req.get("continue_final_message")
                    and isinstance(last, dict)
                    and last.get("role") == "assistant"
                    and isinstance(last.get("content"), str)
                ):
                    messages[-1] = {**last, "content": last["content"] + text}
                else:
                    messages.append({"role": "assistant", "content": text})
                req["messages"] = messages
                req["continue_final_message"] = True
                req["add_generation_prompt"] = False
            else:
                req["prompt"] = str(single_prompt(req.get("prompt"))) + text
        for key in ("max_tokens", "max_completion_tokens"):
            limit = req.get(key)
            if isinstance(limit, int) and not isinstance(limit, bool):
                if limit - n <= 0:
                    return None
                req[key] = limit - n
        least = req.get("min_tokens")
        if isinstance(least, int) and not isinstance(least, bool):
            req["min_tokens"] = max(0, least - n)
        return req

    def ending(self) -> bytes:
        """The events that end an answer whose output is complete though its engine's last
        events were lost: the finish (length), the usage when asked, and [DONE]."""
        parts: list[bytes] = []
        if self.finish is None:
            obj: dict[str, Any] = {
                "id": self.id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [
                    {"index": 0, "delta": {}, "finish_reason": "length"}
                    if self.chat
                    else {"index": 0, "text": "", "finish_reason": "length"}
                ],
            }
            parts.append(b"data: " + _dumps(obj) + b"\n\n")
        options = self.req.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage") and not self.usage_sent:
            prompt = self.prompt_n or 0
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": self.count,
                "total_tokens": prompt + self.count,
            }
            obj = {
                "id": self.id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage,
            }
            parts.append(b"data: " + _dumps(obj) + b"\n\n")
        if not self.done:
            parts.append(b"data: [DONE]\n\n")
        return b"".join(parts)


def _bound(refused: str) -> str | None:
    """Before any output only the state bounds stop a continuation (it starts afresh)."""
    return refused if refused in ("state_bytes", "state_total_bytes") else None


def _empty_role_event(c: dict[str, Any]) -> bool:
    """A continuation's first event, which says only who speaks: the client heard it already."""
    delta = c.get("delta")
    return (
        isinstance(delta, dict)
        and not delta.get("content")
        and len(delta) <= 1
        and c.get("finish_reason") is None
        and not c.get("logprobs")
        and not c.get("token_ids")
    )

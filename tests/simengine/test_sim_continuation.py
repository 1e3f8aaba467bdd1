"""No stream lost: an answer cut short continues on another engine, token for token.

A router that lost a decode engine mid-stream resends the prompt plus the output it already
delivered, asking for that many fewer tokens: as token ids (a completion's `prompt`, a chat's
`kv_transfer_params.prompt_token_ids`, as vLLM 0.32 takes them), or as text (a chat's final
assistant message with `continue_final_message`). Each output token of the simulated engine is a
function of the whole context before it, so the resent request yields exactly the tokens the
uninterrupted answer had left: same ids, same text, on a union engine or a PD pair. The
`return_token_ids` fields say which ids those are, placed where vLLM places them, and the
`die_after_tokens` fault is the crash that cuts a stream.

Engines run in this process (fast) except where a real crash is the point.
"""

from __future__ import annotations

import json
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from motor_mesh.common.tokenizer import Builtin
from motor_mesh.simengine.generation import VOCAB, context_state, pack_ids
from tests.poll import until
from tests.procs import exited
from tests.simengine.test_sim_pd import PREFILL_KV

from .test_sim_pd_fast import Served, serve

pytestmark = pytest.mark.timeout(60)

MAX = 12
KS = (0, 1, 5, MAX - 1)  # tokens delivered before the cut
QUESTION = [{"role": "user", "content": "What is 12+30? Then say why prefill and decode split."}]
PLAIN = [{"role": "user", "content": "tell me about disaggregated serving"}]
PROMPT = "once upon a time a cache met a router"
TOK = Builtin()  # the engine's default tokenizer: ids and text must agree by it


@dataclass
class Answer:
    """What a client saw of choice 0 (a stream: every event; a whole answer: the body)."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    pieces: list[str] | None = None  # a stream's text, delta by delta
    prompt_ids: list[int] | None = None
    finish: str | None = None
    usage: dict[str, int] | None = None
    role: str | None = None
    body: dict[str, Any] = field(default_factory=dict)  # a whole answer's JSON
    events: list[Any] = field(default_factory=list)  # a stream's events, `[DONE]` as a string
    complete: bool = True  # a stream that ended with `[DONE]` (not cut)


def parse_sse(raw: str) -> list[Any]:
    events: list[Any] = []
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def read_stream(events: list[Any], chat: bool) -> Answer:
    out = Answer(pieces=[], events=events, complete=bool(events) and events[-1] == "[DONE]")
    assert out.pieces is not None
    for ev in events:
        if ev == "[DONE]":
            continue
        if "prompt_token_ids" in ev:
            out.prompt_ids = ev["prompt_token_ids"]
        out.usage = ev.get("usage") or out.usage
        for ch in ev["choices"]:
            if ch["index"] != 0:
                continue
            if chat and "role" in ch["delta"]:
                out.role = ch["delta"]["role"]
                continue
            if "prompt_token_ids" in ch:
                out.prompt_ids = ch["prompt_token_ids"]
            piece = ch["delta"].get("content") if chat else ch["text"]
            if "token_ids" in ch:  # a token's event (a chat's echo event carries none)
                out.pieces.append(piece)
                out.ids += ch["token_ids"]
            out.text += piece or ""
            out.finish = ch["finish_reason"] or out.finish
    return out


async def observe(s: aiohttp.ClientSession, base: str, body: dict[str, Any]) -> Answer:
    """POST ``body`` (a chat when it has messages); what came back, read as a client reads it."""
    chat = "messages" in body
    url = base + ("/v1/chat/completions" if chat else "/v1/completions")
    async with s.post(url, json={"model": "motor-sim", **body}) as r:
        raw = await r.read()
        assert r.status == 200, raw
    if body.get("stream"):
        return read_stream(parse_sse(raw.decode()), chat)
    obj = json.loads(raw)
    ch = obj["choices"][0]
    text = ch["message"]["content"] if chat else ch["text"]
    prompt = obj.get("prompt_token_ids") if chat else ch.get("prompt_token_ids")
    role = ch["message"]["role"] if chat else None
    return Answer(text, ch.get("token_ids", []), None, prompt, ch["finish_reason"], obj["usage"], role, obj)


def request(chat: bool, **body: Any) -> dict[str, Any]:
    body.setdefault("return_token_ids", True)
    if body.get("stream"):
        body.setdefault("stream_options", {"include_usage": True})
    return {"messages": QUESTION, **body} if chat else {"prompt": PROMPT, **body}


def resend(chat: bool, context: list[int], **body: Any) -> dict[str, Any]:
    """The request a router sends to continue: the context as ids, where each API takes them."""
    if chat:
        kv = {**body.pop("kv_transfer_params", {}), "prompt_token_ids": context}
        return request(True, kv_transfer_params=kv, **body)
    return request(False, **body) | {"prompt": context}


async def uncut(s: aiohttp.ClientSession, eng: Served, chat: bool) -> Answer:
    """The answer as it is when nothing fails (streamed: its pieces one by one)."""
    full = await observe(s, eng.base, request(chat, max_tokens=MAX, stream=True))
    assert full.complete and full.finish == "length" and len(full.ids) == MAX == len(full.pieces or [])
    assert TOK.encode(full.text) == full.ids  # the ids are what the text tokenizes to
    return full


def assert_continues(part: Answer, full: Answer, k: int, stream: bool) -> None:
    assert full.pieces is not None and full.prompt_ids is not None
    assert part.ids == full.ids[k:], k
    assert part.text == "".join(full.pieces[k:]), k
    if stream:
        assert part.pieces == full.pieces[k:]
    assert part.prompt_ids == full.prompt_ids + full.ids[:k]
    assert part.finish == "length"
    n = len(full.prompt_ids) + k
    assert part.usage == {"prompt_tokens": n, "completion_tokens": MAX - k, "total_tokens": n + MAX - k}


# -- (a) continuation ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_a_resent_context_continues_the_answer_token_for_token(chat: bool, stream: bool) -> None:
    async with serve() as eng, aiohttp.ClientSession() as s:
        full = await uncut(s, eng, chat)
        if chat:
            assert full.pieces is not None and full.pieces[0] == " 42"  # a known answer, then the rest
        for k in KS:
            context = (full.prompt_ids or []) + full.ids[:k]
            part = await observe(s, eng.base, resend(chat, context, max_tokens=MAX - k, stream=stream))
            assert_continues(part, full, k, stream)


@pytest.mark.parametrize("prompt", [PROMPT, "What is 12+30? Answer with a number."])
async def test_a_completion_resent_as_text_continues_too(prompt: str) -> None:
    """The fallback for an engine that gives no ids: the prompt plus the text delivered. With
    the built-in tokenizer that is the same context; a question already followed by its answer
    is not answered again."""
    async with serve() as eng, aiohttp.ClientSession() as s:
        full = await observe(s, eng.base, request(False, prompt=prompt, max_tokens=MAX, stream=True))
        assert full.pieces is not None
        for k in KS:
            said = "".join(full.pieces[:k])
            part = await observe(s, eng.base, {"prompt": prompt + said, "max_tokens": MAX - k})
            assert part.text == "".join(full.pieces[k:]), k


async def test_the_continuation_is_the_same_on_another_engine_and_another_seed_is_not() -> None:
    async with serve() as a, serve() as b, serve(seed=7) as c, aiohttp.ClientSession() as s:
        full = await uncut(s, a, True)
        context = (full.prompt_ids or []) + full.ids[:5]
        part = await observe(s, b.base, resend(True, context, max_tokens=MAX - 5))
        assert part.ids == full.ids[5:]
        other = await observe(s, c.base, resend(True, context, max_tokens=MAX - 5))
        assert other.ids != full.ids[5:]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_pd_legs_continue_the_answer_as_a_union_engine_does(chat: bool, stream: bool) -> None:
    """vLLM's hand-off: the prefill leg (kv_transfer_params do_remote_decode) and the decode leg
    (the prefill's kv_transfer_params back) both take the context as ids; a chat's ride in the
    kv_transfer_params of each leg, as the router sends them."""
    async with AsyncExitStack() as stack:
        union = await stack.enter_async_context(serve())
        p = await stack.enter_async_context(serve(engine_id="p-1", role="prefill"))
        d = await stack.enter_async_context(serve(engine_id="d-1", role="decode"))
        s = await stack.enter_async_context(aiohttp.ClientSession())
        full = await uncut(s, union, chat)
        for k in KS:
            context = (full.prompt_ids or []) + full.ids[:k]
            pre = await observe(
                s, p.base, resend(chat, context, max_tokens=1, kv_transfer_params=dict(PREFILL_KV))
            )
            assert pre.ids == full.ids[k : k + 1]  # the prefill's one token is the next one
            kv = pre.body["kv_transfer_params"]
            assert kv["do_remote_prefill"] is True and "prompt_token_ids" not in kv
            dec = await observe(
                s, d.base, resend(chat, context, max_tokens=MAX - k, stream=stream, kv_transfer_params=kv)
            )
            assert_continues(dec, full, k, stream)
        assert 'result="unknown"' in await d.metrics(s)  # the tickets came from the prefill engine


async def test_decode_legs_are_kept_by_their_prompt_ids() -> None:
    """A leg's kept plan is found by its body without the kv_transfer_params (their ticket
    changes every time): legs that differ only in their prompt ids must not share one."""
    async with serve() as eng, aiohttp.ClientSession() as s:
        full = await uncut(s, eng, True)
        for _ in range(2):  # the second round is served from kept plans
            for k in (0, 3, 6):
                context = (full.prompt_ids or []) + full.ids[:k]
                pre = await observe(
                    s, eng.base, resend(True, context, max_tokens=1, kv_transfer_params=PREFILL_KV)
                )
                kv = pre.body["kv_transfer_params"]
                dec = await observe(s, eng.base, resend(True, context, max_tokens=3, kv_transfer_params=kv))
                assert dec.ids == full.ids[k : k + 3] and dec.prompt_ids == context
        assert eng.hits >= 3


async def test_with_an_hf_tokenizer_the_ids_are_that_tokenizers(tmp_path: Path) -> None:
    """--tokenizer: the answer's ids are what that tokenizer makes of its text (the known answer
    included), the prompt's are its encoding, and a resent context continues as with the
    built-in one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "user", ":", "What", "is", "12", "+", "30", "?", "42", *VOCAB[:40]]
    hf = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    msgs = [{"role": "user", "content": "What is 12+30?"}]
    async with serve(tokenizer=str(path)) as eng, aiohttp.ClientSession() as s:
        full = await observe(
            s, eng.base, {"messages": msgs, "max_tokens": MAX, "stream": True, "return_token_ids": True}
        )
        assert full.pieces is not None and full.pieces[0] == " 42"
        assert full.ids == hf.encode(full.text, add_special_tokens=False).ids and 0 not in full.ids
        assert set(full.text.split()) <= set(words)  # only words it spells as one token
        assert full.prompt_ids == hf.encode("user: What is 12+30?", add_special_tokens=False).ids
        for k in (0, 1, 7):
            part = await observe(
                s,
                eng.base,
                resend(True, full.prompt_ids + full.ids[:k], max_tokens=MAX - k) | {"messages": msgs},
            )
            assert part.ids == full.ids[k:] and part.text == "".join(full.pieces[k:])


def test_the_context_fold_continues_where_it_stopped() -> None:
    import zlib

    a, b = [5, 17, 31999], [0, 42]
    assert context_state(a + b) == zlib.crc32(pack_ids(b), context_state(a))
    assert pack_ids([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"  # little-endian words everywhere


# -- (b) token ids in and out, as vLLM 0.32 places them ------------------------------------------


async def test_return_token_ids_on_a_whole_chat_answer() -> None:
    async with serve() as eng, aiohttp.ClientSession() as s:
        a = await observe(s, eng.base, {"messages": PLAIN, "max_tokens": 5, "return_token_ids": True})
        assert list(a.body) == ["id", "object", "created", "model", "choices", "usage", "prompt_token_ids"]
        assert list(a.body["choices"][0]) == ["index", "message", "logprobs", "finish_reason", "token_ids"]
        assert a.prompt_ids == TOK.encode("user: tell me about disaggregated serving", special=False)
        assert a.ids == TOK.encode(a.text) and len(a.ids) == 5 == a.body["usage"]["completion_tokens"]
        plain = await observe(s, eng.base, {"messages": PLAIN, "max_tokens": 5})
        assert "prompt_token_ids" not in plain.body and "token_ids" not in plain.body["choices"][0]
        assert plain.text == a.text


async def test_return_token_ids_on_a_chat_stream() -> None:
    async with serve() as eng, aiohttp.ClientSession() as s:
        a = await observe(
            s, eng.base, {"messages": PLAIN, "max_tokens": 5, "stream": True, "return_token_ids": True}
        )
        first, *chunks, done = a.events
        assert done == "[DONE]" and len(chunks) == 5
        assert first["prompt_token_ids"] == TOK.encode(
            "user: tell me about disaggregated serving", special=False
        )
        assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]  # fmt: skip
        for c in chunks:
            assert "prompt_token_ids" not in c
            [ch] = c["choices"]
            assert list(ch) == ["index", "delta", "logprobs", "finish_reason", "token_ids"]
            assert ch["token_ids"] == TOK.encode(ch["delta"]["content"]) and len(ch["token_ids"]) == 1
        plain = await observe(s, eng.base, {"messages": PLAIN, "max_tokens": 5, "stream": True})
        assert not any("prompt_token_ids" in c or "token_ids" in c["choices"][0] for c in plain.events[:-1])
        assert plain.text == a.text


async def test_return_token_ids_on_completions_whole_and_streamed() -> None:
    """Two prompts, two choices each: choice i is prompt i // 2's, and carries its ids."""
    body = {"prompt": ["a b", "c d e"], "n": 2, "max_tokens": 3, "return_token_ids": True}
    prompts = [TOK.encode("a b"), TOK.encode("c d e")]
    async with serve() as eng, aiohttp.ClientSession() as s:
        whole = (await observe(s, eng.base, body)).body
        for i, ch in enumerate(whole["choices"]):
            assert list(ch) == ["index", "text", "logprobs", "finish_reason", "token_ids", "prompt_token_ids"]
            assert ch["prompt_token_ids"] == prompts[i // 2] and ch["token_ids"] == TOK.encode(ch["text"])
        assert "prompt_token_ids" not in whole
        stream = await observe(s, eng.base, {**body, "stream": True})
        seen: dict[int, list[int]] = {}
        for c in stream.events[:-1]:
            assert "prompt_token_ids" not in c
            for ch in c["choices"]:
                i = ch["index"]
                assert ("prompt_token_ids" in ch) == (i not in seen)  # in its first chunk only
                if i not in seen:
                    assert ch["prompt_token_ids"] == prompts[i // 2]
                    assert list(ch) == [
                        "index",
                        "text",
                        "logprobs",
                        "finish_reason",
                        "prompt_token_ids",
                        "token_ids",
                    ]
                seen.setdefault(i, []).extend(ch["token_ids"])
        assert seen == {i: ch["token_ids"] for i, ch in enumerate(whole["choices"])}


async def test_a_completion_prompt_of_ids_is_those_ids() -> None:
    async with serve() as eng, aiohttp.ClientSession() as s:
        ids = [7, 8, 9, 31999, 0]
        a = await observe(s, eng.base, {"prompt": ids, "max_tokens": 4, "return_token_ids": True})
        assert a.prompt_ids == ids and a.usage is not None and a.usage["prompt_tokens"] == 5
        # The same context as text: the same answer.
        text = await observe(s, eng.base, {"prompt": PROMPT, "max_tokens": 4, "return_token_ids": True})
        again = await observe(s, eng.base, {"prompt": text.prompt_ids, "max_tokens": 4})
        assert again.text == text.text
        batch = await observe(
            s, eng.base, {"prompt": [ids, [1, 2]], "max_tokens": 2, "return_token_ids": True}
        )
        assert [c["prompt_token_ids"] for c in batch.body["choices"]] == [ids, [1, 2]]
        for bad in ([1, 32000], [-1, 2]):
            async with s.post(eng.base + "/v1/completions", json={"prompt": bad}) as r:
                err = (await r.json())["error"]
            assert r.status == 400 and err["param"] == "prompt" and "out of vocabulary" in err["message"]


async def test_chat_prompt_token_ids_are_the_prompt_as_vllm_reuses_them() -> None:
    async with serve() as eng, aiohttp.ClientSession() as s:
        ids = [3, 1, 4, 1, 5, 9, 2, 6]
        kv = {"prompt_token_ids": ids}
        a = await observe(
            s,
            eng.base,
            {"messages": PLAIN, "max_tokens": 4, "return_token_ids": True, "kv_transfer_params": kv},
        )
        # The messages are not rendered: other messages, the same ids, the same answer.
        b = await observe(s, eng.base, {"messages": QUESTION, "max_tokens": 4, "kv_transfer_params": kv})
        assert (
            a.prompt_ids == ids and a.usage is not None and a.usage["prompt_tokens"] == 8 and b.text == a.text
        )
        assert "kv_transfer_params" not in a.body  # popped: they were no KV parameter
        rendered = TOK.encode("user: tell me about disaggregated serving", special=False)
        # echo, or media in a message: ignored, the messages are rendered.
        echo = await observe(
            s,
            eng.base,
            {
                "messages": PLAIN,
                "max_tokens": 2,
                "echo": True,
                "return_token_ids": True,
                "kv_transfer_params": kv,
            },
        )
        assert echo.prompt_ids == rendered
        media = [{"role": "user", "content": [{"type": "text", "text": "tell me about disaggregated serving"},
                                              {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]  # fmt: skip
        m = await observe(
            s,
            eng.base,
            {"messages": media, "max_tokens": 2, "return_token_ids": True, "kv_transfer_params": kv},
        )
        assert m.prompt_ids == rendered
        for bad in ([], "1 2", [1, True], [1, -2], [1.0], [[1]], [1, 32000]):
            body = {"model": "motor-sim", "messages": PLAIN, "kv_transfer_params": {"prompt_token_ids": bad}}
            async with s.post(eng.base + "/v1/chat/completions", json=body) as r:
                err = (await r.json())["error"]
            assert r.status == 400 and err["param"] == "kv_transfer_params.prompt_token_ids", bad


# -- (d) continue_final_message: the delivered text as the final assistant message -------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_continue_final_message_continues_the_delivered_text(stream: bool) -> None:
    async with serve() as eng, aiohttp.ClientSession() as s:
        full = await uncut(s, eng, True)
        assert full.pieces is not None
        for k in KS:
            said = "".join(full.pieces[:k])
            body = {
                "messages": [*QUESTION, {"role": "assistant", "content": said}],
                "continue_final_message": True,
                "add_generation_prompt": False,
                "max_tokens": MAX - k,
                "stream": stream,
                "return_token_ids": True,
            }
            part = await observe(s, eng.base, body)
            assert part.ids == full.ids[k:] and part.text == "".join(full.pieces[k:]), k
            assert part.role == "assistant"  # the last message's, as vLLM answers without a generation prompt
            echoed = await observe(s, eng.base, {**body, "echo": True})
            assert echoed.text == full.text  # echo puts the continued message before its continuation


async def test_continue_final_message_refusals_are_vllms() -> None:
    msgs = [*PLAIN, {"role": "assistant", "content": " the"}]

    async def status(**body: Any) -> tuple[int, str]:
        async with s.post(eng.base + "/v1/chat/completions", json={"messages": msgs, **body}) as r:
            return r.status, (await r.json()).get("error", {}).get("message", "")

    async with serve() as eng, aiohttp.ClientSession() as s:
        code, msg = await status(continue_final_message=True, add_generation_prompt=True)
        assert code == 400 and "Cannot set both `continue_final_message` and `add_generation_prompt`" in msg
        # add_generation_prompt defaults to true: the template refuses the pair when it renders...
        code, msg = await status(continue_final_message=True)
        assert code == 400 and "not compatible" in msg
        # ...and with prompt ids nothing is rendered.
        code, _ = await status(continue_final_message=True, kv_transfer_params={"prompt_token_ids": [1, 2]})
        assert code == 200
        msgs[-1] = {"role": "assistant", "content": None}
        code, msg = await status(continue_final_message=True, add_generation_prompt=False)
        assert code == 400 and 'no "content" to continue' in msg
        code, _ = await status(continue_final_message="yes", add_generation_prompt=False)
        assert code == 400


# -- (c) die_after_tokens: the crash that cuts a stream ------------------------------------------


async def stream_until_cut(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Answer:
    """Read a stream as far as it goes: the events that arrived, whether it ended or was cut."""
    raw = b""
    async with s.post(url, json=body) as r:
        assert r.status == 200
        try:
            async for chunk in r.content.iter_any():
                raw += chunk
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
            pass
    return read_stream(parse_sse(raw.decode()), "messages" in body)


async def test_die_after_tokens_kills_the_engine_mid_stream_and_another_continues(spawn_engine) -> None:
    eng = spawn_engine("--fault", "die_after_tokens", "--fault-after-tokens", "5", "--workers", "1")
    spare = spawn_engine()
    workers = eng.worker_pids()
    assert "die_after=5" in eng.wait_line("event=fault_armed")
    body = {"model": "motor-sim", **request(True, max_tokens=MAX, stream=True)}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        cut = await stream_until_cut(s, eng.v1 + "/chat/completions", body)
        assert not cut.complete and "[DONE]" not in cut.events  # the connection dropped mid-stream
        assert len(cut.ids) == 5 and cut.prompt_ids and cut.finish is None
        assert await eng.await_exit() == -signal.SIGKILL  # a real crash
        await until(lambda: all(map(exited, workers)), 10, "the workers to follow their leader")
        assert "event=fault_die" in eng.output()
        # The router's move: the same request to another engine, with the context so far.
        rest = await observe(
            s, spare.base, resend(True, cut.prompt_ids + cut.ids, max_tokens=MAX - 5, stream=True)
        )
        whole = await observe(s, spare.base, request(True, max_tokens=MAX))
    assert cut.text + rest.text == whole.text and cut.ids + rest.ids == whole.ids


@asynccontextmanager
async def dying(**cfg: Any) -> AsyncIterator[tuple[Served, list[int]]]:
    """An engine in this process whose die_after_tokens calls a stand-in instead of SIGKILL
    (then its connection is cut as the crash would cut it): the tokens counted when it died."""
    async with serve(**cfg) as eng:
        died: list[int] = []
        eng.engine.faults.on_die = lambda: died.append(eng.engine.faults.tokens)
        yield eng, died


async def test_die_after_tokens_counts_across_requests_and_sends_nothing_past_n() -> None:
    async with dying() as (eng, died), aiohttp.ClientSession() as s:
        async with s.post(eng.base + "/sim/fault", json={"mode": "die_after_tokens", "after_tokens": 4}) as r:
            state = await r.json()
        assert (state["mode"], state["after_tokens"], state["tokens"], state["active"]) == (
            "die_after_tokens",
            4,
            0,
            True,
        )
        a = await observe(s, eng.base, {"prompt": PROMPT, "max_tokens": 3})  # 3 of 4
        assert len(TOK.encode(a.text)) == 3 and not died
        # 2 more would be 5: the engine dies generating them, nothing of the answer leaves.
        with pytest.raises(aiohttp.ClientError):
            await observe(s, eng.base, {"prompt": PROMPT, "max_tokens": 2})
        assert died == [4]
    async with dying() as (eng, died), aiohttp.ClientSession() as s:
        async with s.post(eng.base + "/sim/fault", json={"mode": "die_after_tokens", "after_tokens": 3}) as r:
            assert r.status == 200
        b = await observe(s, eng.base, {"prompt": PROMPT, "max_tokens": 3})  # exactly N: sent, then death
        assert b.text == a.text and died == [3]
        async with s.get(eng.base + "/sim/fault") as r:
            assert (await r.json())["tokens"] == 3


async def test_die_after_tokens_streams_token_by_token_to_the_last_one() -> None:
    """With no --tpot-ms a stream is one write; armed, it goes token by token, so the Nth token is
    the last to leave, even the stream's own last token (then no [DONE])."""
    async with dying() as (eng, died), aiohttp.ClientSession() as s:
        async with s.post(eng.base + "/sim/fault", json={"mode": "die_after_tokens", "after_tokens": 4}) as r:
            assert r.status == 200
        url = eng.base + "/v1/completions"
        cut = await stream_until_cut(
            s, url, request(False, max_tokens=4, stream=True) | {"model": "motor-sim"}
        )
        assert len(cut.ids) == 4 and cut.finish == "length" and not cut.complete and died == [4]


@pytest.mark.parametrize(
    "body",
    [{"mode": "die_after_tokens", "after_tokens": -1}, {"mode": "die_after_tokens", "after_tokens": "3"}],
)
async def test_die_after_tokens_rejects_a_bad_count(body: dict[str, Any]) -> None:
    async with serve() as eng, aiohttp.ClientSession() as s:
        async with s.post(eng.base + "/sim/fault", json=body) as r:
            assert r.status == 400 and "after_tokens" in (await r.json())["error"]["message"]

"""kv_aware's request path on a real tokenizer: Llama 3's tokenizer.json and chat template.

A chat is encoded in segments cut after the template's added tokens, reusing the ids of the
conversation's earlier turns (prompt.ChatMemo): whatever the conversation, the ids and block keys
must be exactly those of the whole rendered chat encoded at once, as vLLM encodes it.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from motor_mesh.common.tokenizer import HfTokenizer
from motor_mesh.coordinator.kv.hashing import chain
from motor_mesh.coordinator.kv.prompt import (
    CHUNK,
    CUT_WITHIN,
    LONG_TEXT,
    ChatMemo,
    Prompt,
    Tokens,
    chunks_agree,
)
from tests.tokenizers import llama3_dir

ROLES = ("user", "assistant")


@pytest.fixture(scope="module")
def llama3() -> HfTokenizer:
    return HfTokenizer(str(Path(llama3_dir()) / "tokenizer.json"))


class Spy(HfTokenizer):
    """An HfTokenizer that records the texts it is asked to encode, and from which thread."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.texts: list[str] = []
        self.threads: list[str] = []

    def encode(self, text: str, *, special: bool) -> list[int]:
        self.texts.append(text)
        self.threads.append(threading.current_thread().name)
        return super().encode(text, special=special)

    def encode_all(self, texts: list[str], *, special: bool) -> list[list[int]]:
        self.texts.extend(texts)
        self.threads.append(threading.current_thread().name)
        return super().encode_all(texts, special=special)


def whole(tok: HfTokenizer, body: dict[str, Any]) -> list[int]:
    text = tok.chat_text(body["messages"], body.get("tools"))
    assert text is not None
    return tok.encode(text, special=False)


def words(rng: random.Random, n: int) -> str:
    pool = [
        "the",
        "cache",
        "prefill",
        " spaced",
        "naïve",
        "漢字",
        "🙂",
        "12345",
        "<tag>",
        "\n",
        "\n\n",
        "  ",
        "x",
    ]
    return "".join(rng.choice(pool) + rng.choice(["", " "]) for _ in range(n))


def conversation(rng: random.Random, system: str, turns: int) -> list[dict[str, Any]]:
    """The request bodies of one conversation: each turn resends every earlier one."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    bodies = []
    for _ in range(turns):
        messages.append({"role": "user", "content": words(rng, rng.randint(0, 30))})
        bodies.append({"messages": list(messages)})
        messages.append({"role": "assistant", "content": words(rng, rng.randint(0, 40))})
    return bodies


def test_the_llama3_template_is_encoded_in_segments(llama3: HfTokenizer) -> None:
    tokens = Tokens(llama3, sim=False)
    assert tokens.memo is not None, "Llama 3 encodes a chat cut after its added tokens as it encodes it whole"
    assert set(tokens.cutters) >= {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}


def test_conversations_read_turn_after_turn_are_the_whole_chats_ids_and_keys(llama3: HfTokenizer) -> None:
    rng = random.Random(7)
    tokens = Tokens(llama3, sim=False)
    systems = [words(rng, 300) for _ in range(3)]
    checked = 0
    for c in range(40):
        for body in conversation(rng, systems[c % 3], rng.randint(1, 6)):
            prompt = tokens.read(body, True)
            assert prompt is not None
            expected = whole(llama3, body)
            assert prompt.tokens == expected
            for bs in (16, 3):
                assert list(prompt.hashes(bs)) == list(chain(expected, bs))
            checked += 1
    assert checked > 100
    assert tokens.memo is not None and len(tokens.memo) > 40


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(st.sampled_from((*ROLES, "system", "tool")), st.text(max_size=40)), min_size=1, max_size=8
    )
)
def test_any_messages_read_as_the_whole_chat(llama3: HfTokenizer, pairs: list[tuple[str, str]]) -> None:
    tokens = Tokens(llama3, sim=False)
    messages = [{"role": r, "content": t} for r, t in pairs]
    for end in range(1, len(messages) + 1):  # each prefix as a request, as a conversation grows
        body = {"messages": messages[:end]}
        try:
            expected = whole(llama3, body)
        except Exception:  # the Rust tokenizer refuses lone surrogates: so does the hint
            assert tokens.read(body, True) is None
            continue
        prompt = tokens.read(body, True)
        assert prompt is not None and prompt.tokens == expected


def test_a_turn_encodes_only_what_it_adds(tmp_path: Path) -> None:
    spy = Spy(str(Path(llama3_dir()) / "tokenizer.json"))
    tokens = Tokens(spy, sim=False)
    rng = random.Random(3)
    system = words(rng, 400)
    first, second = conversation(rng, system, 2)
    tokens.read(first, True)
    spy.texts.clear()
    prompt = tokens.read(second, True)
    encoded = sum(map(len, spy.texts))
    assert prompt is not None and prompt.tokens == whole(spy, second)
    new = second["messages"][-2]["content"] + second["messages"][-1]["content"]
    assert encoded < len(new) + 200  # the new messages and their headers, not the system prompt

    # Another conversation on the same system prompt reuses its ids too.
    spy.texts.clear()
    (other,) = conversation(rng, system, 1)
    assert tokens.read(other, True) is not None
    assert sum(map(len, spy.texts)) < len(other["messages"][-1]["content"]) + 200


def test_a_template_that_does_not_grow_is_encoded_whole_and_right(
    tmp_path: Path, llama3: HfTokenizer
) -> None:
    """A template writing the message count first: no earlier turn's text is a prefix."""
    model = tmp_path / "counting"
    model.mkdir()
    shutil.copy(Path(llama3_dir()) / "tokenizer.json", model / "tokenizer.json")
    config = json.loads((Path(llama3_dir()) / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages|length }} " + config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HfTokenizer(str(model / "tokenizer.json"))
    tokens = Tokens(tok, sim=False)
    for body in conversation(random.Random(5), "system text", 5):
        prompt = tokens.read(body, True)
        assert prompt is not None and prompt.tokens == whole(tok, body)


def test_added_tokens_that_strip_spaces_turn_segments_off(tmp_path: Path) -> None:
    """An added token that eats the spaces beside it encodes differently once the text is cut
    after it: such a tokenizer is always encoded whole."""
    model = tmp_path / "stripping"
    model.mkdir()
    data = json.loads((Path(llama3_dir()) / "tokenizer.json").read_text())
    for added in data["added_tokens"]:
        if added["content"] in ("<|end_header_id|>", "<|eot_id|>"):
            added["lstrip"] = added["rstrip"] = True
    (model / "tokenizer.json").write_text(json.dumps(data))
    shutil.copy(Path(llama3_dir()) / "tokenizer_config.json", model / "tokenizer_config.json")
    tok = HfTokenizer(str(model / "tokenizer.json"))
    tokens = Tokens(tok, sim=False)
    assert tokens.memo is None or "<|eot_id|>" not in tokens.cutters
    for body in conversation(random.Random(9), "  system  ", 4):
        prompt = tokens.read(body, True)
        assert prompt is not None and prompt.tokens == whole(tok, body)


async def test_a_long_prompt_is_encoded_off_the_event_loop() -> None:
    spy = Spy(str(Path(llama3_dir()) / "tokenizer.json"))
    tokens = Tokens(spy, sim=False)
    long = words(random.Random(1), LONG_TEXT)
    spy.threads.clear()
    prompt = await tokens.prompt({"prompt": long}, False)
    assert prompt is not None and prompt.tokens == spy.encode(long, special=True)
    assert spy.threads[0] != threading.current_thread().name  # encoded in a thread
    spy.threads.clear()
    short = await tokens.prompt({"prompt": "a short prompt"}, False)
    assert short is not None and spy.threads == [threading.current_thread().name]


async def test_a_long_chat_is_encoded_off_the_loop_and_right(llama3: HfTokenizer) -> None:
    tokens = Tokens(llama3, sim=False)
    rng = random.Random(11)
    bodies = conversation(rng, words(rng, 2000), 3)
    results = await asyncio.gather(*(tokens.prompt(b, True) for b in bodies))
    for body, prompt in zip(bodies, results, strict=True):
        assert prompt is not None and prompt.tokens == whole(llama3, body)


def test_the_memo_keeps_its_bounds(llama3: HfTokenizer) -> None:
    tokens = Tokens(llama3, sim=False)
    tokens.memo = ChatMemo(max_chats=5, max_tokens=3000)
    rng = random.Random(2)
    for _ in range(30):
        for body in conversation(rng, words(rng, 50), 3):
            prompt = tokens.read(body, True)
            assert prompt is not None and prompt.tokens == whole(llama3, body)
            assert len(tokens.memo) <= 5 and tokens.memo.tokens <= 3000


def test_ids_outside_64_bits_have_no_keys(llama3: HfTokenizer) -> None:
    tokens = Tokens(llama3, sim=False)
    prompt = tokens.read({"prompt": [1, 2, 2**64] * 20}, False)
    assert prompt is not None and prompt.n == 60 and list(prompt.hashes(16)) == []


def test_llama3_encodes_chunks_cut_between_words_as_whole_texts(llama3: HfTokenizer) -> None:
    assert chunks_agree(llama3)


async def test_a_long_prompt_no_engine_holds_is_encoded_only_its_first_chunk() -> None:
    spy = Spy(str(Path(llama3_dir()) / "tokenizer.json"))
    tokens = Tokens(spy, sim=False)
    document = words(random.Random(8), 3 * CHUNK)
    whole_ids = spy.encode(document, special=True)
    spy.texts.clear()
    asked: list[int] = []

    def nobody(prompt: Prompt) -> bool:
        asked.append(len(prompt.ids))
        return False

    prompt = await tokens.prompt({"prompt": document}, False, nobody)
    assert prompt is not None and len(asked) == 1
    assert sum(map(len, spy.texts)) < CHUNK + CUT_WITHIN  # the first chunk only
    known = list(prompt.ids)
    assert known == whole_ids[: len(known)]  # the leading ids, exactly
    assert abs(prompt.n - len(whole_ids)) < 0.05 * len(whole_ids)  # the rest estimated
    assert list(prompt.hashes(16)) == list(chain(whole_ids, 16))[: len(known) // 16]


async def test_a_long_prompt_held_throughout_is_encoded_whole_in_chunks(llama3: HfTokenizer) -> None:
    tokens = Tokens(llama3, sim=False)
    rng = random.Random(12)
    document = words(rng, 6 * CHUNK)
    body = {"messages": [{"role": "system", "content": document}, {"role": "user", "content": "why?"}]}
    prompt = await tokens.prompt(body, True, lambda p: True)
    expected = whole(llama3, body)
    assert prompt is not None and prompt.tokens == expected and prompt.n == len(expected)
    # Its prefixes were remembered as it went: the next turn encodes only what it adds.
    body["messages"] += [{"role": "assistant", "content": "because"}, {"role": "user", "content": "ok"}]
    again = await tokens.prompt(body, True, lambda p: True)
    assert again is not None and again.tokens == whole(llama3, body)

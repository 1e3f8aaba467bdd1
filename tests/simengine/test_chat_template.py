"""The simulated engine given a real model directory tokenizes a chat as vLLM does: Llama 3's
chat template (tokenizer_config.json) rendered as transformers renders it for vLLM, encoded by its
tokenizer.json without special tokens. Its prompt ids, usage and KV events are then a real
engine's, which a router rendering the same template computes too.

The reference here is the template rendered by Jinja in this file, and for
`continue_final_message` the text transformers 5.19 (vLLM 0.32's) renders, written out. Needs
.tokenizers/llama3 (`make tokenizers`); skips without it.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from motor_mesh.common.tokenizer import Builtin, HfTokenizer, load, sim_chat_text
from motor_mesh.simengine.openai_api import RequestError, parse_request
from motor_mesh.simengine.tokens import prompt_ids
from tests.procs import SimEngine
from tests.tokenizers import llama3_dir
from tests.vllm_kv_events import BlockStored

from .test_sim_kv_events import Subscriber, events_config

pytestmark = pytest.mark.timeout(60)

BOS = 128000  # <|begin_of_text|>
EOT = 128009  # <|eot_id|>
ASSISTANT_HEADER = [128006, 78191, 128007, 271]  # <|start_header_id|>assistant<|end_header_id|>\n\n
BLOCK = 16
MODEL = "llama3"
CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What do prefill and decode do?"},
    {"role": "assistant", "content": "Prefill reads the prompt; decode writes the answer."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "And which"}, {"type": "text", "text": "is faster?"}],
    },
]


@pytest.fixture(scope="module")
def llama3() -> str:
    return llama3_dir()


@pytest.fixture(scope="module")
def hf(llama3: str) -> Tokenizer:
    return Tokenizer.from_file(str(Path(llama3) / "tokenizer.json"))


@pytest.fixture(scope="module")
def engine(llama3: str) -> Iterator[SimEngine]:
    eng = SimEngine(
        "--model", llama3, "--served-model-name", MODEL, "--port", "0", "--kv-events-config", events_config()
    ).start()
    yield eng
    eng.kill()


def render(llama3: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """The model's template rendered in transformers' Jinja environment, text parts joined by
    newlines (vLLM's "string" content format)."""
    config = json.loads((Path(llama3) / "tokenizer_config.json").read_text())
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    flat = [
        {**m, "content": "\n".join(p["text"] for p in m["content"])} if isinstance(m["content"], list) else m
        for m in messages
    ]
    return env.from_string(config["chat_template"]).render(
        messages=flat,
        tools=None,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        bos_token=config["bos_token"],
        eos_token=config["eos_token"],
    )


def chat(eng: SimEngine, status: int = 200, **body: Any) -> dict[str, Any]:
    data = json.dumps({"model": MODEL, "max_tokens": 4, "return_token_ids": True, **body}).encode()
    req = urllib.request.Request(eng.v1 + "/chat/completions", data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            got, raw = r.status, r.read()
    except urllib.error.HTTPError as err:
        got, raw = err.code, err.read()
    assert got == status, raw
    if body.get("stream"):  # the role delta (the first event) carries the prompt's ids
        events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
        return {**events[0], "usage": events[-1]["usage"]}
    out: dict[str, Any] = json.loads(raw)
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_is_the_rendered_template_encoded_without_special_tokens(
    engine: SimEngine, llama3: str, hf: Tokenizer, stream: bool
) -> None:
    body: dict[str, Any] = {"messages": CONVERSATION}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    answer = chat(engine, **body)
    ids = answer["prompt_token_ids"]
    text = render(llama3, CONVERSATION)
    assert text.endswith("And which\nis faster?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ids == hf.encode(text, add_special_tokens=False).ids
    assert ids[0] == BOS and ids.count(BOS) == 1  # the template's, not a second one
    assert ids[-4:] == ASSISTANT_HEADER
    assert answer["usage"]["prompt_tokens"] == len(ids)
    # The code the sim renders with, which a router given the same files renders with too.
    tok = load(llama3)
    assert isinstance(tok, HfTokenizer) and tok.chat_text(CONVERSATION) == text


def test_add_generation_prompt_false_renders_without_asking(
    engine: SimEngine, llama3: str, hf: Tokenizer
) -> None:
    messages = [{"role": "user", "content": "Say nothing."}]
    answer = chat(engine, messages=messages, add_generation_prompt=False)
    ids = answer["prompt_token_ids"]
    assert (
        ids == hf.encode(render(llama3, messages, add_generation_prompt=False), add_special_tokens=False).ids
    )
    # Llama 3's template writes the assistant header whatever add_generation_prompt says; the
    # answer's role is still the last message's (vLLM's rule).
    assert ids[-4:] == ASSISTANT_HEADER
    assert answer["choices"][0]["message"]["role"] == "user"


def test_continue_final_message_leaves_the_message_open(engine: SimEngine, hf: Tokenizer) -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is "}]
    answer = chat(engine, messages=messages, add_generation_prompt=False, continue_final_message=True)
    # What transformers 5.19 renders for vLLM 0.32: the template trims the content, so the text
    # is cut before the marker it appended, trailing spaces and all.
    text = (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nq<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nThe answer is"
    )
    ids = answer["prompt_token_ids"]
    assert ids == hf.encode(text, add_special_tokens=False).ids
    assert ids[-3:] == hf.encode("The answer is", add_special_tokens=False).ids and EOT not in ids[-4:]
    assert answer["usage"]["prompt_tokens"] == len(ids)
    assert answer["choices"][0]["message"]["role"] == "assistant"
    # echo repeats the open message before its continuation, as with the sim's own lines.
    echoed = chat(
        engine, messages=messages, add_generation_prompt=False, continue_final_message=True, echo=True
    )
    assert echoed["choices"][0]["message"]["content"].startswith("The answer is ")
    assert echoed["prompt_token_ids"] == ids
    # transformers refuses continue_final_message beside the default add_generation_prompt.
    refused = chat(engine, 400, messages=messages, continue_final_message=True)
    assert "not compatible" in refused["error"]["message"]


def test_a_known_question_is_answered_and_continued_from_ids(engine: SimEngine, hf: Tokenizer) -> None:
    messages = [{"role": "user", "content": "What is 12+30? Then say why."}]
    whole = chat(engine, messages=messages, max_tokens=6)
    ids, out = whole["prompt_token_ids"], whole["choices"][0]["token_ids"]
    assert whole["choices"][0]["message"]["content"].startswith(" 42")
    assert ids[-4:] == ASSISTANT_HEADER
    # A router resending the rendered ids plus the first token delivered: the rest, exactly.
    kv = {"prompt_token_ids": ids + out[:1]}
    rest = chat(engine, messages=messages, max_tokens=5, kv_transfer_params=kv)
    assert rest["prompt_token_ids"] == ids + out[:1]
    assert rest["choices"][0]["token_ids"] == out[1:]


def test_kv_events_carry_the_template_s_ids(engine: SimEngine, llama3: str, hf: Tokenizer) -> None:
    sub = Subscriber(engine)
    try:
        messages = [
            {"role": "system", "content": "You route requests by the blocks engines report."},
            {"role": "user", "content": "Name the blocks of this conversation, one by one, in order."},
        ]
        ids = chat(engine, messages=messages)["prompt_token_ids"]
        assert ids == hf.encode(render(llama3, messages), add_special_tokens=False).ids
        assert len(ids) >= 2 * BLOCK
        [stored] = sub.next()[1].events
        assert isinstance(stored, BlockStored) and stored.block_size == BLOCK
        full = len(ids) // BLOCK * BLOCK
        assert len(stored.block_hashes) == len(ids) // BLOCK
        assert stored.token_ids == ids[:full]
        assert stored.token_ids[0] == BOS
        # What a router rendering the same template over the same tokenizer.json computes (the
        # Coordinator's reading of a chat for a real engine).
        tok = load(llama3)
        assert isinstance(tok, HfTokenizer)
        rendered = tok.chat_text(messages)
        assert rendered is not None and tok.encode(rendered, special=False)[:full] == stored.token_ids
    finally:
        sub.close()


# -- without a template: the sim's own lines, as before ------------------------------------------


def test_a_tokenizer_without_a_template_keeps_the_sim_s_lines(llama3: str, tmp_path: Path) -> None:
    shutil.copy(Path(llama3) / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = load(str(tmp_path))
    assert isinstance(tok, HfTokenizer) and not tok.has_chat_template
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi there"}]}
    req = parse_request(body, True, tok)
    assert req.prompts == [sim_chat_text([("system", "s"), ("user", "hi there")])]
    assert prompt_ids(tok, req) == [tok.encode("system: s\nuser: hi there", special=False)]
    # The built-in tokenizer, or none given: the same lines.
    assert parse_request(body, True, Builtin()).prompts == parse_request(body, True).prompts == req.prompts
    cont = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "so"}]}
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    assert parse_request({**cont, **flags}, True, tok).prompts == ["system: s\nuser: hi there\nso"]


def test_a_template_s_refusal_is_a_request_error_unless_ids_are_given(llama3: str, tmp_path: Path) -> None:
    shutil.copy(Path(llama3) / "tokenizer.json", tmp_path / "tokenizer.json")
    template = "{% if messages[0]['role'] != 'user' %}{{ messages[0]['content'] | nope }}{% endif %}x"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = load(str(tmp_path))
    assert isinstance(tok, HfTokenizer) and tok.has_chat_template
    assert parse_request({"messages": [{"role": "user", "content": "a"}]}, True, tok).prompts == ["x"]
    bad = {"messages": [{"role": "system", "content": "a"}]}
    with pytest.raises(RequestError):
        parse_request(bad, True, tok)
    # With the prompt as ids nothing is rendered (vLLM's _reused_prompt_token_ids): no refusal.
    given = parse_request({**bad, "kv_transfer_params": {"prompt_token_ids": [1, 2]}}, True, tok)
    assert given.token_prompts == [[1, 2]]

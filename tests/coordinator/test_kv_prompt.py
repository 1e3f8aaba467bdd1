"""A request's prompt tokens as kv_aware computes them, against what the engine itself caches.

The simulated engine's own code (its request parser and ``prompt_ids``, with the tokenizer it
loads from its argv) is the reference for ``sim=True``: the model's chat template when its
tokenizer has one, else the sim's ``<role>: <text>`` lines. For a real engine (``sim=False``) the
reference is the model's chat template rendered as transformers renders it for vLLM, then encoded
without special tokens.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2.ext
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HfTok
from tokenizers import models, pre_tokenizers, processors

from motor_mesh.common.tokenizer import Builtin, HfTokenizer, Tokenizer, load
from motor_mesh.coordinator.kv.hashing import chain
from motor_mesh.coordinator.kv.prompt import Prompt, Tokens
from motor_mesh.simengine.cli import parse
from motor_mesh.simengine.openai_api import RequestError, parse_request
from motor_mesh.simengine.tokens import load_tokenizer, prompt_ids

WORDS = ["hello", "world", "the", "cache", "prefix", "système", "東京", "a", "b", "c", "42", "7"]
SPECIAL = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
BOS, EOS = "<s>", "</s>"
# bos_token, role markers, trim_blocks/lstrip_blocks (the newlines after block tags and the
# indentation before them vanish), add_generation_prompt.
TEMPLATE = """{{ bos_token }}
{% for m in messages %}
    {% if m['role'] == 'system' %}
<|system|>
{{ m['content'] }}<|end|>
    {% else %}
<|{{ m['role'] }}|>
{{ m['content'] }}<|end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""
# What transformers' environment has and plain Jinja lacks: {% break %} (loopcontrols), a tojson
# that neither escapes HTML characters nor sorts keys, strftime_now (Llama 3's "Today Date"), and
# tools defined as none for a request without tools.
TEMPLATE_HF_FEATURES = """{% if tools is not none %}tools: {{ tools }}{% endif %}
year {{ strftime_now('%Y') if strftime_now is defined else '2024' }}
{% for m in messages %}
{% if loop.index > 2 %}{% break %}{% endif %}
<|{{ m['role'] }}|> {{ m['content'] | tojson }} {{ {'z': 1, 'a': '<&>'} | tojson }}
{% endfor %}
<|assistant|>"""


def sim_ids(tok: Tokenizer, body: Any, chat: bool) -> list[int]:
    """The token ids the simulated engine loading ``tok`` caches for the body's first prompt."""
    return prompt_ids(tok, parse_request(body, chat, tok))[0]


def _hf_tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def hf_render(template: str, messages: list[dict[str, Any]]) -> str:
    """The template rendered as transformers' apply_chat_template renders it for vLLM."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _hf_tojson
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(
        messages=messages,
        tools=None,
        documents=None,
        add_generation_prompt=True,
        bos_token=BOS,
        eos_token=EOS,
    )


def write_model(directory: Path, template: str | None) -> Path:
    """A tokenizer.json (whole words, a BOS added with special tokens) and, with ``template``,
    a tokenizer_config.json carrying it."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = HfTok(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    tok.save(str(directory / "tokenizer.json"))
    if template is not None:
        config = {"chat_template": template, "bos_token": BOS, "eos_token": {"content": EOS}}
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("model"), TEMPLATE)


# -- bodies ------------------------------------------------------------------------------------

# Any text a JSON body can carry, lone surrogates included, and words of the test vocabulary
# around every kind of whitespace (so the HF tokenizer yields known ids, not only [UNK]).
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
vocab_text = st.lists(
    st.sampled_from(WORDS) | st.sampled_from([" ", "\n", "\t", "\u3000", "\u2028", "<|user|>", ""]),
    max_size=30,
).map("".join)
roles = st.sampled_from(["system", "user", "assistant", "tool"]) | st.text(max_size=8)
part = st.fixed_dictionaries({"type": st.just("text"), "text": vocab_text | st.text(max_size=20)}) | st.just(
    {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
)


def contents(text: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    return text | st.none() | st.lists(part, max_size=4)


def chat_bodies(text: st.SearchStrategy[str]) -> st.SearchStrategy[dict[str, Any]]:
    message = st.fixed_dictionaries({"role": roles, "content": contents(text)})
    return st.lists(message, min_size=1, max_size=6).map(lambda ms: {"model": "m", "messages": ms})


token_ids = st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=30)


def completion_bodies(text: st.SearchStrategy[str]) -> st.SearchStrategy[dict[str, Any]]:
    prompt = (
        text
        | st.lists(text, min_size=1, max_size=4)
        | token_ids
        | st.lists(st.lists(st.integers(0, 2**31), max_size=20), min_size=1, max_size=4)
    )
    return prompt.map(lambda p: {"model": "m", "prompt": p, "max_tokens": 3})


# -- the simulated engine with its built-in tokenizer ----------------------------------------

SIM_BUILTIN = load_tokenizer(parse([])[0])  # what `motor engine-sim` loads without --tokenizer
# One for the module, as in a Coordinator that serves one request after another.
TOKENS = Tokens(Builtin(), sim=True)


def test_the_sim_loads_the_builtin_tokenizer_by_default() -> None:
    assert isinstance(SIM_BUILTIN, Builtin)


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


TURNS = [
    {"role": "system", "content": "sys"},
    user("q1"),
    {"role": "assistant", "content": "a1"},
    user("q2\nline two"),
]
EXAMPLES: list[tuple[dict[str, Any], bool]] = [
    ({"messages": [user("hello there")]}, True),
    ({"messages": [{"role": "system", "content": "be brief"}, user("hi")]}, True),
    ({"messages": [user([{"type": "text", "text": "a b"}, {"type": "text", "text": "c"}])]}, True),
    ({"messages": TURNS}, True),
    ({"messages": [user(""), {"role": "assistant", "content": None}]}, True),
    ({"prompt": "once upon a time"}, False),
    ({"prompt": ["first prompt here", "second"]}, False),
    ({"prompt": [1, 2, 3, 40000]}, False),
    ({"prompt": [[5, 6, 7], [8]]}, False),
    ({"prompt": [[], [8]]}, False),
    ({"prompt": ""}, False),
]


@pytest.mark.parametrize(("body", "chat"), EXAMPLES)
def test_builtin_examples_match_the_sim(body: dict[str, Any], chat: bool) -> None:
    ids = TOKENS.of(body, chat)
    assert ids == sim_ids(SIM_BUILTIN, body, chat)
    assert Tokens(Builtin(), sim=True).of(body, chat) == ids


@settings(max_examples=400, deadline=None)
@given(chat_bodies(any_text | vocab_text))
def test_builtin_chat_matches_the_sim(body: dict[str, Any]) -> None:
    assert TOKENS.of(body, True) == sim_ids(SIM_BUILTIN, body, True)


@settings(max_examples=300, deadline=None)
@given(completion_bodies(any_text | vocab_text))
def test_builtin_completion_matches_the_sim(body: dict[str, Any]) -> None:
    assert TOKENS.of(body, False) == sim_ids(SIM_BUILTIN, body, False)


# -- a Hugging Face tokenizer ----------------------------------------------------------------


def test_load_gives_the_hf_tokenizer_and_the_sim_loads_the_same(model_dir: Path) -> None:
    tok = load(str(model_dir))
    assert isinstance(tok, HfTokenizer) and tok.has_chat_template
    assert isinstance(load(str(model_dir / "tokenizer.json")), HfTokenizer)
    sim_tok = load_tokenizer(parse(["--tokenizer", str(model_dir)])[0])
    assert isinstance(sim_tok, HfTokenizer)
    assert sim_tok.encode("hello world", special=True) == tok.encode("hello world", special=True)
    # With special tokens a completion starts with the BOS; a rendered chat is encoded without.
    bos = tok.encode(BOS, special=False)
    assert tok.encode("hello", special=True) == bos + tok.encode("hello", special=False)


def test_real_engine_chat_is_the_rendered_template(model_dir: Path) -> None:
    tok = load(str(model_dir))
    assert isinstance(tok, HfTokenizer)
    messages = [
        {"role": "system", "content": "the cache"},
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": "a b c"},
        {"role": "user", "content": "prefix 42"},
    ]
    text = hf_render(TEMPLATE, messages)
    assert text.startswith("<s>\n<|system|>\nthe cache<|end|>\n<|user|>\n")  # block tags' lines gone
    assert text.endswith("<|assistant|>\n")
    assert tok.chat_text(messages) == text
    ids = Tokens(tok, sim=False).of({"messages": messages}, True)
    assert ids == tok.encode(text, special=False)
    assert ids is not None and ids[0] == tok.encode(BOS, special=False)[0]  # once: the template's


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_hf_tokenizer_matches_template_and_sim(model_dir: Path, data: st.DataObject) -> None:
    tok = load(str(model_dir))
    assert isinstance(tok, HfTokenizer)
    sim_tok = load_tokenizer(parse(["--tokenizer", str(model_dir)])[0])
    text = st.text(max_size=30) | vocab_text  # no lone surrogates: Rust strings cannot hold them
    # A real engine: the template over string contents.
    messages = data.draw(
        st.lists(st.fixed_dictionaries({"role": roles, "content": text}), min_size=1, max_size=5)
    )
    expected = tok.encode(hf_render(TEMPLATE, messages), special=False)
    assert Tokens(tok, sim=False).of({"messages": messages}, True) == expected
    # The simulated engine with --tokenizer renders the same template, as vLLM does.
    sim = Tokens(tok, sim=True)
    assert sim.of({"messages": messages}, True) == expected
    assert sim_ids(sim_tok, {"messages": messages}, True) == expected
    chat = data.draw(chat_bodies(text))
    assert sim.of(chat, True) == sim_ids(sim_tok, chat, True)
    completion = data.draw(completion_bodies(text))
    assert sim.of(completion, False) == sim_ids(sim_tok, completion, False)


def test_the_sim_with_a_template_caches_the_rendered_template(model_dir: Path) -> None:
    tok = load(str(model_dir))
    sim_tok = load_tokenizer(parse(["--tokenizer", str(model_dir)])[0])
    messages = [
        {"role": "system", "content": "the cache"},
        {"role": "user", "content": "hello world"},
    ]
    text = hf_render(TEMPLATE, messages)
    expected = tok.encode(text, special=False)
    body = {"messages": messages}
    assert sim_ids(sim_tok, body, True) == expected  # not its own `<role>: <text>` lines
    assert sim_ids(sim_tok, body, True) != tok.encode("system: the cache\nuser: hello world", special=False)
    for sim in (True, False):
        assert Tokens(tok, sim=sim).of(body, True) == expected
    # Without the generation prompt (add_generation_prompt false), as the sim renders it too.
    bare = {**body, "add_generation_prompt": False}
    assert Tokens(tok, sim=True).of(bare, True) == sim_ids(sim_tok, bare, True) != expected


def test_real_engine_completion_ids(model_dir: Path) -> None:
    tok = load(str(model_dir))
    real = Tokens(tok, sim=False)
    assert real.of({"prompt": "hello world"}, False) == tok.encode("hello world", special=True)
    assert real.of({"prompt": ["the cache", "world"]}, False) == tok.encode("the cache", special=True)
    # Token ids go to every engine as they are, the simulated one too (it takes them as vLLM does).
    assert real.of({"prompt": [9, 8, 7]}, False) == [9, 8, 7]
    assert real.of({"prompt": [[4, 5], [6]]}, False) == [4, 5]
    assert Tokens(tok, sim=True).of({"prompt": [9, 8, 7]}, False) == [9, 8, 7]


def test_template_features_of_transformers(tmp_path: Path) -> None:
    tok = load(str(write_model(tmp_path / "m", TEMPLATE_HF_FEATURES)))
    assert isinstance(tok, HfTokenizer)
    messages = [
        {"role": "user", "content": "a <b> & 'c'"},
        {"role": "assistant", "content": "東京"},
        {"role": "user", "content": "never rendered"},
    ]
    text = hf_render(TEMPLATE_HF_FEATURES, messages)
    assert "never" not in text and "\"a <b> & 'c'\"" in text and '{"z": 1, "a": "<&>"}' in text
    assert text.startswith(f"year {datetime.now().year}\n")
    assert tok.chat_text(messages) == text
    assert Tokens(tok, sim=False).of({"messages": messages}, True) == tok.encode(text, special=False)


def test_real_engine_without_a_chat_template(tmp_path: Path) -> None:
    tok = load(str(write_model(tmp_path / "m", None)))
    assert isinstance(tok, HfTokenizer) and not tok.has_chat_template
    real = Tokens(tok, sim=False)
    chat = {"messages": [{"role": "user", "content": "hello"}]}
    assert real.of(chat, True) is None  # the engine's rendering cannot be known
    assert real.of({"prompt": "hello"}, False) == tok.encode("hello", special=True)
    assert Tokens(Builtin(), sim=False).of(chat, True) is None
    # The simulated engine needs no template: its chat lines are its own.
    assert Tokens(tok, sim=True).of(chat, True) == tok.encode("user: hello", special=False)


def test_a_failing_template_costs_only_the_hint(tmp_path: Path) -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x"
    tok = load(str(write_model(tmp_path / "m", template)))
    real = Tokens(tok, sim=False)
    assert real.of({"messages": [{"role": "system", "content": "s"}]}, True) is None
    assert real.of({"messages": [{"role": "user", "content": "s"}]}, True) == tok.encode("x", special=False)
    broken = load(str(write_model(tmp_path / "b", "{% for %}")))
    assert Tokens(broken, sim=False).of({"messages": [{"role": "user", "content": "s"}]}, True) is None


# -- bodies with no prompt to read ------------------------------------------------------------

# No messages to read at all: None whatever the engine.
NO_MESSAGES: list[Any] = [
    {},
    {"messages": None},
    {"messages": []},
    {"messages": "hello"},
    {"messages": {"role": "user"}},
]
# Messages the simulated engine rejects (400): None for it. A real engine's template is rendered
# over whatever the client sent (the engine validates it), so for one these only must not raise.
BAD_MESSAGES: list[Any] = [
    {"messages": [{"content": "no role"}]},
    {"messages": [{"role": 7, "content": "x"}]},
    {"messages": [{"role": "user", "content": 42}]},
    {"messages": [{"role": "user", "content": {"text": "x"}}]},
    {"messages": ["just a string"]},
    {"messages": [None]},
]
NO_PROMPT: list[Any] = [
    {},
    {"prompt": None},
    {"prompt": []},
    {"prompt": 12},
    {"prompt": {"text": "x"}},
    {"prompt": [["a", "b"]]},
    {"prompt": [[1, "a"]]},
    {"prompt": [1.5, 2]},
    {"prompt": [True, False]},
    {"prompt": [None]},
]


@pytest.mark.parametrize("sim", [True, False])
def test_unreadable_bodies_give_none(model_dir: Path, sim: bool) -> None:
    for tokens in (Tokens(Builtin(), sim=sim), Tokens(load(str(model_dir)), sim=sim)):
        for body in NO_MESSAGES:
            assert tokens.of(body, True) is None, body
        for body in BAD_MESSAGES:
            ids = tokens.of(body, True)
            # The sim's own lines need valid messages; a template is rendered over what was sent.
            assert ids is None if sim and not tokens.templated else ids is None or isinstance(ids, list), body
        for body in NO_PROMPT:
            assert tokens.of(body, False) is None, body
        not_dicts: list[Any] = [[], "prompt", None, 3]
        for not_a_dict in not_dicts:
            assert tokens.of(not_a_dict, True) is None
            assert tokens.of(not_a_dict, False) is None
    for body in BAD_MESSAGES:  # the simulated engine agrees it cannot read them
        with pytest.raises(RequestError):
            parse_request(body, True)
    # Lone surrogates: the Builtin reads them (the sim does too), a Rust tokenizer cannot.
    body = {"prompt": "hello \ud800 world"}
    assert Tokens(Builtin(), sim=sim).of(body, False) == sim_ids(SIM_BUILTIN, body, False)
    assert Tokens(load(str(model_dir)), sim=sim).of(body, False) is None


# -- block hashes ------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**31), max_size=70), st.integers(1, 9))
def test_prompt_hashes_are_the_chain_and_memoized(tokens: list[int], block_size: int) -> None:
    p = Prompt(tokens)
    first = p.hashes(block_size)
    assert list(first) == list(chain(tokens, block_size))
    assert len(first) == len(tokens) // block_size
    assert p.hashes(block_size) is first  # computed once per block size
    assert list(p.hashes(block_size + 1)) == list(chain(tokens, block_size + 1))
    assert p.hashes(block_size) is first
    assert (p.cached, p.endpoint) == (0, None)


def test_real_engine_text_parts_and_tools_render_as_vllm_does(model_dir: Path, tmp_path: Path) -> None:
    tok = load(str(model_dir))
    assert isinstance(tok, HfTokenizer)
    parts = [
        {"type": "text", "text": "hello"},
        {"type": "image_url", "image_url": {}},
        {"type": "text", "text": "world"},
    ]
    as_parts = Tokens(tok, sim=False).of({"messages": [{"role": "user", "content": parts}]}, True)
    # vLLM hands a template expecting strings the text parts joined by newlines.
    assert as_parts == tok.encode(
        hf_render(TEMPLATE, [{"role": "user", "content": "hello\nworld"}]), special=False
    )
    # A request's tools reach the template.
    featured = load(str(write_model(tmp_path / "m", TEMPLATE_HF_FEATURES)))
    assert isinstance(featured, HfTokenizer)
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}
    with_tools = featured.chat_text(body["messages"], body["tools"])
    assert with_tools is not None and with_tools.count("tools: ") == 1
    assert Tokens(featured, sim=False).of(body, True) == featured.encode(with_tools, special=False)


SHARED = Tokens(Builtin(), sim=True)  # one across examples, as a Coordinator keeps it
_SHARED_HF: dict[Path, Tokens] = {}


def shared_hf(model_dir: Path) -> Tokens:
    """One Tokens of the templated model across examples: its memo of rendered chats carries over."""
    if model_dir not in _SHARED_HF:
        _SHARED_HF[model_dir] = Tokens(load(str(model_dir)), sim=True)
    return _SHARED_HF[model_dir]


@settings(max_examples=300, deadline=None)
@given(chat_bodies(vocab_text), st.sampled_from([1, 2, 3, 16]))
def test_a_read_chat_hashes_as_its_whole_prompt_would(model_dir: Path, body: dict[str, Any], bs: int) -> None:
    hf = shared_hf(model_dir)
    for tokens, sim_tok in ((SHARED, SIM_BUILTIN), (hf, hf.tokenizer)):
        for _ in range(2):  # the second time a templated chat's text is remembered
            prompt = tokens.read(body, True)
            assert prompt is not None
            assert prompt.tokens == sim_ids(sim_tok, body, True)
            assert list(prompt.hashes(bs)) == list(chain(prompt.tokens, bs))
            assert prompt.n == len(prompt.tokens)


@pytest.mark.parametrize("templated", [False, True])
async def test_a_conversation_reads_right_turn_after_turn(model_dir: Path, templated: bool) -> None:
    """What the request path reads (``prompt``, async), each turn resending the ones before."""
    tok = load(str(model_dir)) if templated else Builtin()
    sim_tok = tok if templated else SIM_BUILTIN
    tokens = Tokens(tok, sim=True)
    words = [w for w in WORDS if w.isascii()]
    messages = [{"role": "system", "content": " ".join(words[i % len(words)] for i in range(37))}]
    for turn in range(30):
        content = " ".join(words[(turn + i) % len(words)] for i in range(turn % 5))
        messages.append({"role": "user" if turn % 2 else "assistant", "content": content})
        body = {"messages": list(messages)}
        prompt = await tokens.prompt(body, True)
        assert prompt is not None and prompt.tokens == sim_ids(sim_tok, body, True)
        assert prompt.tokens == tokens.of(body, True)
        for bs in (3, 16):
            assert list(prompt.hashes(bs)) == list(chain(prompt.tokens, bs))

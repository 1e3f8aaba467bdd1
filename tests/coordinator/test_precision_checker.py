"""The precision checker on answers shaped like vLLM's (and OpenAI's) chat and completions
responses: healthy ones, collapsed log-probabilities, garbled text, repetition, no logprobs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from motor_mesh.coordinator.precision import checker
from motor_mesh.coordinator.precision.checker import COLLAPSED, CONTROL, REPETITION, REPLACEMENT, check
from motor_mesh.simengine.generation import generate, seed_of
from motor_mesh.simengine.openai_api import full_response, parse_request

# (token, chosen logprob, [(alternative, logprob), ...]) as a healthy 7B instruct model gives
# them at temperature 0.7: confident almost everywhere, a few genuinely open positions.
HEALTHY = [
    ("The", -0.0021, [("Paris", -6.4), ("France", -7.9)]),
    (" capital", -0.0009, [(" city", -7.2), (" French", -8.8)]),
    (" of", -0.0000, [(" city", -11.3), (",", -12.0)]),
    (" France", -0.0002, [(" the", -9.1), (" Franc", -10.4)]),
    (" is", -0.0001, [(",", -9.7), (" has", -11.6)]),
    (" Paris", -0.0030, [(" the", -6.1), (" **", -7.0)]),
    (".", -0.0410, [(",", -3.3), (" (", -6.0)]),
    (" It", -1.2040, [(" Paris", -0.5200), ("\n\n", -2.1)]),  # sampled the second choice
    (" is", -0.3320, [(" has", -1.6), ("'s", -3.0)]),
    (" known", -0.9100, [(" the", -1.0), (" also", -2.2)]),
    (" for", -0.0110, [(" as", -4.6), (" worldwide", -8.1)]),
    (" its", -0.0800, [(" the", -2.7), (" being", -6.3)]),
    (" art", -1.7200, [(" rich", -1.3), (" iconic", -1.9)]),
    (",", -0.0500, [(" and", -3.1), (" museums", -5.5)]),
    (" fashion", -0.4500, [(" culture", -1.4), (" cuisine", -2.6)]),
    (",", -0.0200, [(" and", -4.0), (" houses", -9.9)]),
]

# A decode engine whose numerics broke: near-uniform distributions over a 152k vocabulary.
COLLAPSED_TOKENS = [
    (" Gaul", -10.91, [(" ozone", -10.93), ("ifs", -10.95)]),
    ("ifs", -10.87, [(" Gaul", -10.88), ("_REF", -10.90)]),
    (" inaccur", -11.02, [("odor", -11.03), (" Kro", -11.04)]),
    ("odor", -10.99, [(" Kro", -11.00), ("ifs", -11.01)]),
    (" Kro", -10.95, [(" tul", -10.96), (" Gaul", -10.97)]),
    (" tul", -11.08, [("_REF", -11.09), (" ozone", -11.10)]),
    ("_REF", -10.93, [(" Gaul", -10.94), ("odor", -10.95)]),
    (" ozone", -11.01, [(" tul", -11.02), ("ifs", -11.03)]),
]


def _bytes(tok: str) -> list[int]:
    return list(tok.encode())


def chat_response(
    tokens: list[tuple[str, float, list[tuple[str, float]]]] | None,
    text: str | None = None,
    model: str = "Qwen2.5-7B-Instruct",
) -> dict[str, Any]:
    """A vLLM /v1/chat/completions answer (logprobs=true, top_logprobs=3), or without logprobs
    when ``tokens`` is None."""
    content = text if text is not None else "".join(t for t, _, _ in tokens or [])
    logprobs = None
    if tokens is not None:
        logprobs = {
            "content": [
                {
                    "token": tok,
                    "logprob": lp,
                    "bytes": _bytes(tok),
                    "top_logprobs": [
                        {"token": a, "logprob": alp, "bytes": _bytes(a)}
                        for a, alp in sorted([(tok, lp), *alts], key=lambda x: -x[1])
                    ],
                }
                for tok, lp, alts in tokens
            ]
        }
    return {
        "id": "chatcmpl-9f1c2a7e5b8d4c3aa1b2c3d4e5f60718",
        "object": "chat.completion",
        "created": 1718000000,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": content,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": logprobs,
                "finish_reason": "length",
                "stop_reason": None,
            }
        ],
        "usage": {
            "prompt_tokens": 15,
            "total_tokens": 15 + len(tokens or []),
            "completion_tokens": len(tokens or []),
        },
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }


def completion_response(
    tokens: list[tuple[str, float, list[tuple[str, float]]]] | None, text: str | None = None
) -> dict[str, Any]:
    """A vLLM /v1/completions answer (logprobs=3), or without logprobs when ``tokens`` is None."""
    body_text = text if text is not None else "".join(t for t, _, _ in tokens or [])
    logprobs = None
    if tokens is not None:
        offsets, pos = [], 0
        for tok, _, _ in tokens:
            offsets.append(pos)
            pos += len(tok)
        logprobs = {
            "text_offset": offsets,
            "token_logprobs": [lp for _, lp, _ in tokens],
            "tokens": [t for t, _, _ in tokens],
            "top_logprobs": [{tok: lp, **dict(alts)} for tok, lp, alts in tokens],
        }
    return {
        "id": "cmpl-3c1d9e2f7a6b4e8f9d0c1b2a3f4e5d6c",
        "object": "text_completion",
        "created": 1718000000,
        "model": "Qwen2.5-7B",
        "choices": [
            {
                "index": 0,
                "text": body_text,
                "logprobs": logprobs,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": 9,
            "total_tokens": 9 + len(tokens or []),
            "completion_tokens": len(tokens or []),
        },
    }


def _wire(body: dict[str, Any]) -> Any:
    """Through JSON and back, as the sampler reads it (NaN included, as Python's json allows)."""
    return json.loads(json.dumps(body))


@pytest.mark.parametrize("shape", [chat_response, completion_response])
def test_a_healthy_answer_is_normal(shape: Any) -> None:
    v = check(_wire(shape(HEALTHY)))
    assert v is not None and not v.anomalous and v.kind == ""
    assert v.tokens == len(HEALTHY)
    # The top-1 of each position, not the sampled token: " It" was sampled at -1.2 while the
    # most likely token had -0.52.
    assert v.median_top1 is not None and -0.1 < v.median_top1 <= 0


@pytest.mark.parametrize("shape", [chat_response, completion_response])
def test_collapsed_logprobs_are_anomalous_even_when_the_text_looks_like_words(shape: Any) -> None:
    v = check(_wire(shape(COLLAPSED_TOKENS)))
    assert v is not None and v.anomalous and v.kinds == (COLLAPSED,)
    assert v.median_top1 is not None and v.median_top1 < -10


def test_a_few_uncertain_positions_do_not_make_a_collapse() -> None:
    # Half the positions wide open (a list of names, a number): the median still says healthy.
    mixed = [(t, -2.9, [(" x", -3.0)]) if i % 2 else (t, lp, alts) for i, (t, lp, alts) in enumerate(HEALTHY)]
    v = check(_wire(chat_response(mixed)))
    assert v is not None and not v.anomalous


def test_non_finite_logprobs_count_as_collapsed() -> None:
    # vLLM reports -inf as -9999.0; broken numerics can also give NaN.
    nan = [(t, float("nan"), [(a, float("nan")) for a, _ in alts]) for t, _, alts in HEALTHY[:8]]
    v = check(_wire(chat_response(nan)))
    assert v is not None and v.kind == COLLAPSED
    floor = [(t, -9999.0, [(a, -9999.0) for a, _ in alts]) for t, _, alts in HEALTHY[:8]]
    v = check(_wire(completion_response(floor)))
    assert v is not None and v.kind == COLLAPSED


def test_too_few_positions_are_judged_by_text_only() -> None:
    v = check(_wire(chat_response(COLLAPSED_TOKENS[:3])))
    assert v is not None and not v.anomalous and v.median_top1 is None


@pytest.mark.parametrize("shape", [chat_response, completion_response])
def test_replacement_characters_are_anomalous(shape: Any) -> None:
    text = "The capital \ufffd\ufffd of Fr\ufffdance is"
    v = check(_wire(shape(None, text=text)))
    assert v is not None and v.kinds == (REPLACEMENT,) and v.median_top1 is None


def test_one_trailing_replacement_character_is_a_cut_character_not_an_anomaly() -> None:
    # max_tokens can end the answer in the middle of a multi-byte character.
    v = check(_wire(chat_response(None, text="La capitale est Paris. C'est la ville la plus peupl\ufffd")))
    assert v is not None and not v.anomalous


def test_control_characters_are_anomalous_but_tab_newline_return_are_not() -> None:
    v = check(_wire(chat_response(None, text="Paris\x00\x1b[0m\x07 is the capital")))
    assert v is not None and v.kinds == (CONTROL,)
    v = check(_wire(chat_response(None, text="1.\tParis\r\n2.\tLyon\n")))
    assert v is not None and not v.anomalous


def test_one_token_many_times_in_a_row_is_repetition() -> None:
    looping = HEALTHY[:6] + [(" la", -0.05, [(".", -3.2)])] * 8 + HEALTHY[6:8]
    v = check(_wire(completion_response(looping)))
    assert v is not None and v.kinds == (REPETITION,)
    seven = HEALTHY[:6] + [(" la", -0.05, [(".", -3.2)])] * 7 + HEALTHY[6:9]
    v = check(_wire(completion_response(seven)))
    assert v is not None and not v.anomalous


def test_one_token_dominating_a_long_answer_is_repetition() -> None:
    # Never 8 in a row, but 9 of 16 tokens are the same.
    the = (" the", -0.3, [(" a", -1.9)])
    tokens = [the if i % 2 == 0 or i == 15 else HEALTHY[i] for i in range(16)]
    v = check(_wire(chat_response(tokens)))
    assert v is not None and v.kinds == (REPETITION,)
    # Half exactly is not more than half.
    tokens = [the if i % 2 == 0 else HEALTHY[i] for i in range(16)]
    v = check(_wire(chat_response(tokens)))
    assert v is not None and not v.anomalous


def test_without_logprobs_words_stand_in_for_tokens() -> None:
    v = check(_wire(chat_response(None, text="the " * 9 + "end")))
    assert v is not None and v.kinds == (REPETITION,) and v.median_top1 is None
    v = check(_wire(chat_response(None, text="The capital of France is Paris. It is known for its art.")))
    assert v is not None and not v.anomalous


def test_several_symptoms_are_all_named_collapse_first() -> None:
    garbled = [("\ufffd", -10.9, [(" \ufffd", -10.9)])] + [(" the", -10.8, [(" a", -10.8)])] * 9
    v = check(_wire(chat_response(garbled)))
    assert v is not None and v.kinds == (COLLAPSED, REPLACEMENT, REPETITION) and v.kind == COLLAPSED


def test_reasoning_content_is_judged_too() -> None:
    body = chat_response(None, text="Paris.")
    body["choices"][0]["message"]["reasoning_content"] = "The user asks \x01\x02 about"
    v = check(_wire(body))
    assert v is not None and v.kind == CONTROL


@pytest.mark.parametrize(
    "body",
    [
        {"error": {"message": "boom", "type": "server_error", "code": 500}},
        {"choices": []},
        "not an object",
        None,
        chat_response(None, text=""),
        completion_response(None, text=""),
    ],
)
def test_nothing_to_judge_is_no_verdict(body: Any) -> None:
    assert check(body) is None


def _sim_answer(chat: bool, garbled: bool) -> Any:
    """What the simulated engine answers to a sample (16 tokens, 5 top logprobs)."""
    if chat:
        raw = {"messages": [{"role": "user", "content": "Tell me about Paris."}], "max_tokens": 16,
               "logprobs": True, "top_logprobs": 5}  # fmt: skip
    else:
        raw = {"prompt": "Once upon a time", "max_tokens": 16, "logprobs": 5}
    req = parse_request(raw, chat)
    gen = generate(seed_of(req.prompts[0]), 16, None, req.top_k, garbled)
    return json.loads(full_response(req, "id-1", 0, "motor-sim", [gen], "length"))


@pytest.mark.parametrize("chat", [True, False])
def test_the_simulated_engine_healthy_and_under_its_precision_fault(chat: bool) -> None:
    good = check(_sim_answer(chat, garbled=False))
    assert good is not None and not good.anomalous
    bad = check(_sim_answer(chat, garbled=True))
    assert bad is not None and bad.kinds == (COLLAPSED, REPLACEMENT, REPETITION)


@pytest.mark.parametrize(
    ("text", "expected", "right"),
    [
        ("Paris", "Paris", True),
        ("Paris.", "Paris", True),
        ("The capital of France is PARIS!", "Paris", True),
        ("  paris\n", "Paris.", True),
        ("**Paris**", "Paris", True),
        ("Lyon", "Paris", False),
        ("\ufffd \ufffd\ufffd the the the", "Paris", False),
        ("", "Paris", False),
        ("It is 4.", "4", True),
    ],
)
def test_probe_answers_compare_without_case_and_punctuation(text: str, expected: str, right: bool) -> None:
    assert checker.answers(text, expected) is right

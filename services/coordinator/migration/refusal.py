"""Which requests cannot continue on another engine without changing what the client gets.

A continuation resends the prompt plus the output already delivered and lets the new engine
generate the rest. That is the same request exactly when the rest depends only on that context:
true of greedy decoding, and of unseeded sampling in distribution. It is not when the engine's
state holds more than the context (a seeded random stream, several choices, a grammar's parse
state, penalties counting the output so far) or when the continuation could not carry the
context exactly (images, an echoed prompt).
"""

from __future__ import annotations

from typing import Any

# Guided-decoding fields (vLLM's, old and new spellings; SGLang's): a grammar's parse state is
# the engine's, a continuation would restart it on the output's tail.
GUIDED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "json_schema",
    "regex",
    "ebnf",
)


def _number(value: Any, default: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return default
    return float(value)


def greedy(req: dict[str, Any]) -> bool:
    """Temperature 0 (or top_k 1): each token is the context's most likely one."""
    return _number(req.get("temperature"), 1.0) == 0 or req.get("top_k") == 1


def _multimodal(messages: Any) -> bool:
    if not isinstance(messages, list):
        return False
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(
            not (isinstance(part, dict) and part.get("type") == "text") for part in content
        ):
            return True
    return False


def refusal(req: dict[str, Any], chat: bool) -> str | None:
    """Why ``req`` (the client's parsed body) cannot continue elsewhere once output was sent;
    None when it can."""
    if _number(req.get("n"), 1) > 1:
        return "n"
    if _number(req.get("best_of"), 1) > 1:
        return "best_of"
    if req.get("use_beam_search"):
        return "beam_search"
    if any(req.get(k) is not None for k in GUIDED):
        return "guided_decoding"
    fmt = req.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return "response_format"
    choice = req.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):
        return "tool_choice"
    if req.get("echo") and (req.get("logprobs") or req.get("prompt_logprobs")):
        return "echo_logprobs"
    if req.get("seed") is not None and not greedy(req):
        return "seed"
    if _number(req.get("presence_penalty"), 0) or _number(req.get("frequency_penalty"), 0):
        return "penalty"
    if chat:
        if req.get("echo"):
            return "echo"
        if _multimodal(req.get("messages")):
            return "multimodal"
    elif single_prompt(req.get("prompt")) is None:
        return "batch_prompt"  # several prompts: several choices
    return None


def single_prompt(prompt: Any) -> str | list[int] | None:
    """A completion request's one prompt (text or token ids); None for a batch or no prompt."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None

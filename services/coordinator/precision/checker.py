"""Is a sampled answer garbled? Pure functions over an engine's JSON answer (docs/architecture.md,
"Precision detection").

An engine on a faulty device (bad HBM, a broken collective, numerics that overflow) often keeps
answering with status 200 while its output turns to noise. Three symptoms are cheap to see in one
short non-streamed answer, and each is rare in a healthy model's output:

- **collapsed log-probabilities**: the median, over the answer's positions, of the most likely
  token's log-probability is below ``COLLAPSED_TOP1_LOGPROB``;
- **replacement or control characters** in the text (U+FFFD, C0 controls other than tab, line
  feed and carriage return);
- **repetition**: one token ``REPEAT_RUN`` times in a row, or more than ``REPEAT_SHARE`` of an
  answer of at least ``REPEAT_MIN_TOKENS`` tokens.

A verdict is a suspicion, not a conviction: the Coordinator only acts after several anomalous
samples in a row *and* a probe question answered wrong, so a healthy answer that happens to trip
a rule (a random base64 string has a flat distribution, a table of dashes repeats) costs one
probe, never an alarm.
"""

from __future__ import annotations

import itertools
import math
import statistics
import unicodedata
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# Top-1 log-probability, median over the answer's positions. A healthy LLM is confident at most
# positions: the median top-1 probability of ordinary text is well above 50 % (log-probability
# above -0.7; the simulated engine's healthy range is -0.6 .. 0). Broken numerics flatten the
# distribution towards uniform over the vocabulary, log(1/V) = -10 .. -12 for 32k-150k tokens
# (the simulated fault gives -9; vLLM reports -inf as -9999). -3 (top-1 below 5 % at more than
# half the positions) sits far from both: the median ignores the few genuinely uncertain
# positions of a healthy answer (the first word, a name, a number), and the rule still fires
# for a partial collapse, not only for a uniform one.
COLLAPSED_TOP1_LOGPROB = -3.0
# Fewer positions than this say too little about a distribution: judged by text only.
MIN_LOGPROB_POSITIONS = 4
# A healthy 16-token answer almost never repeats one token 8 times in a row; a degenerate
# engine loops on one token, or on a few with one dominating.
REPEAT_RUN = 8
REPEAT_SHARE = 0.5
REPEAT_MIN_TOKENS = 16

COLLAPSED = "collapsed_logprobs"
REPLACEMENT = "replacement_chars"
CONTROL = "control_chars"
REPETITION = "repetition"

_ALLOWED_C0 = frozenset("\t\n\r")


@dataclass(frozen=True, slots=True)
class Output:
    """What a sample's answer says, read out of either response shape."""

    text: str
    # The generated tokens (from the logprobs), or None when the answer carried none.
    tokens: tuple[str, ...] | None
    # Per position, the log-probability of the most likely token; None without logprobs.
    top1: tuple[float, ...] | None


@dataclass(frozen=True, slots=True)
class Verdict:
    kinds: tuple[str, ...]  # the rules the answer broke, in a fixed order; () = normal
    tokens: int  # tokens (or words, without logprobs) judged
    median_top1: float | None  # None: judged without logprobs

    @property
    def anomalous(self) -> bool:
        return bool(self.kinds)

    @property
    def kind(self) -> str:
        """The first rule broken, "" for a normal answer."""
        return self.kinds[0] if self.kinds else ""


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    # NaN is what broken numerics look like; ranked below everything, like -inf.
    return float("-inf") if math.isnan(value) else float(value)


def _best(values: Iterable[Any]) -> float | None:
    nums = [n for n in (_num(v) for v in values) if n is not None]
    return max(nums) if nums else None


def _chat(choice: Mapping[str, Any]) -> Output:
    msg = choice.get("message")
    parts: list[str] = []
    if isinstance(msg, Mapping):
        # Reasoning models put part of the answer beside the content; both come from the engine.
        for key in ("reasoning_content", "reasoning", "content"):
            value = msg.get(key)
            if isinstance(value, str):
                parts.append(value)
    text = "".join(parts)
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, Mapping) else None
    if not isinstance(content, list) or not content:
        return Output(text, None, None)
    tokens: list[str] = []
    top1: list[float] = []
    for entry in content:
        if not isinstance(entry, Mapping):
            continue
        tok = entry.get("token")
        if isinstance(tok, str):
            tokens.append(tok)
        alts = entry.get("top_logprobs")
        alt_lps = [a.get("logprob") for a in alts if isinstance(a, Mapping)] if isinstance(alts, list) else []
        best = _best([entry.get("logprob"), *alt_lps])
        if best is not None:
            top1.append(best)
    return Output(text, tuple(tokens) or None, tuple(top1) or None)


def _completion(choice: Mapping[str, Any]) -> Output:
    text = choice.get("text")
    text = text if isinstance(text, str) else ""
    lp = choice.get("logprobs")
    if not isinstance(lp, Mapping):
        return Output(text, None, None)
    raw_tokens = lp.get("tokens")
    tokens = tuple(t for t in raw_tokens if isinstance(t, str)) if isinstance(raw_tokens, list) else ()
    chosen = lp.get("token_logprobs")
    chosen = chosen if isinstance(chosen, list) else []
    tops = lp.get("top_logprobs")
    tops = tops if isinstance(tops, list) else []
    top1: list[float] = []
    for i in range(max(len(chosen), len(tops))):
        cands: list[Any] = [chosen[i]] if i < len(chosen) else []
        alts = tops[i] if i < len(tops) else None
        if isinstance(alts, Mapping):
            cands += list(alts.values())
        best = _best(cands)
        if best is not None:
            top1.append(best)
    return Output(text, tokens or None, tuple(top1) or None)


def extract(body: Any) -> Output | None:
    """The first choice of a chat or completions answer (vLLM / SGLang / OpenAI shapes), or None
    when the body is not one."""
    if not isinstance(body, Mapping):
        return None
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return None
    choice = choices[0]
    return _chat(choice) if "message" in choice else _completion(choice)


def _bad_chars(text: str) -> list[str]:
    kinds = []
    # One trailing U+FFFD is how a multi-byte character cut by max_tokens can end a detokenised
    # text; anywhere else the engine emitted bytes that decode to nothing.
    if "\ufffd" in text.rstrip("\ufffd"):
        kinds.append(REPLACEMENT)
    if any(ch < " " and ch not in _ALLOWED_C0 for ch in text):
        kinds.append(CONTROL)
    return kinds


def _repeats(tokens: tuple[str, ...] | list[str]) -> bool:
    toks = [t for t in tokens if t]
    if not toks:
        return False
    run = longest = 1
    for a, b in itertools.pairwise(toks):
        run = run + 1 if a == b else 1
        longest = max(longest, run)
    if longest >= REPEAT_RUN:
        return True
    if len(toks) >= REPEAT_MIN_TOKENS:
        top = Counter(toks).most_common(1)[0][1]
        return top > REPEAT_SHARE * len(toks)
    return False


def judge(out: Output) -> Verdict:
    kinds: list[str] = []
    median: float | None = None
    if out.top1 is not None and len(out.top1) >= MIN_LOGPROB_POSITIONS:
        median = statistics.median(out.top1)
        if median < COLLAPSED_TOP1_LOGPROB:
            kinds.append(COLLAPSED)
    kinds += _bad_chars(out.text)
    # Without logprobs the engine's tokens are unknown: whitespace-separated words stand in.
    tokens = out.tokens if out.tokens is not None else tuple(out.text.split())
    if _repeats(tokens):
        kinds.append(REPETITION)
    return Verdict(tuple(kinds), len(tokens), median)


def check(body: Any) -> Verdict | None:
    """The verdict on one sampled answer; None when it holds nothing to judge (not a completion,
    or an empty one), which counts as no sample."""
    out = extract(body)
    if out is None or not (out.text or out.tokens):
        return None
    return judge(out)


def _normal_form(text: str) -> str:
    no_punct = "".join(ch for ch in text.casefold() if not unicodedata.category(ch).startswith("P"))
    return " ".join(no_punct.split())


def answers(text: str, expected: str) -> bool:
    """Whether ``text`` contains the expected answer: case-insensitive, punctuation stripped from
    both, whitespace collapsed ("Paris." and "The capital is paris!" both answer "Paris")."""
    want = _normal_form(expected) or expected.casefold().strip()
    return want in _normal_form(text)


def answer_text(body: Any) -> str | None:
    """The text of an answer, for the probe; None when the body is not a completion."""
    out = extract(body)
    return None if out is None else out.text

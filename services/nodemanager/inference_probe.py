"""The inference probe (the original system's "virtual inference"): a one-token completion
that finds an engine whose ``/health`` still answers while its scheduler is wedged.

Opt-in (``nodemanager.engine_probe_inference``) and sent to DP rank 0 of the instance only, as
the original system did: one request per instance per interval, not one per rank. The ranks of
a vLLM data-parallel group (mixture-of-experts) step together, so one wedged rank stalls rank
0's answer too; independent ranks (dense models, SGLang) are watched at rank 0 only. The probe's
deadline is its interval, so a probe that does not answer in time has already used its turn:
the next one starts as it fails, and two are never in flight at once (a wedged engine would
otherwise collect one stuck request per interval).
"""

from __future__ import annotations

import json
import math
import random
import time

import aiohttp

from motor_mesh.nodemanager.launch import EndpointSpec, LaunchParams

# SGLang's FAKE_BOOTSTRAP_HOST: a prefill or decode engine given it runs the request alone,
# without a KV transfer (SGLang's own warm-up and /health_generate send it the same way).
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
PATH = "/v1/completions"


def wanted(enabled: bool, spec: EndpointSpec) -> bool:
    """Whether this endpoint is probed: DP rank 0's routable endpoint (id 0; a headless rank
    on another node has no HTTP server)."""
    return enabled and spec.id == 0 and not spec.headless


def body(params: LaunchParams) -> bytes:
    fields: dict[str, object] = {"model": params.served_model_name, "prompt": "1", "max_tokens": 1}
    if params.sglang_style and params.disaggregated:
        # A prefill or decode SGLang engine refuses a request without a room.
        fields |= {"bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": random.getrandbits(63)}
    return json.dumps(fields).encode()


def request_id(now: float) -> str:
    """``<unix time>_virtual``: an engine's request log tells the probe from real traffic.
    Milliseconds keep ids unique even with sub-second intervals (vLLM refuses a duplicate id
    while the first is still running, as an abandoned probe may be)."""
    return f"{now:.3f}_virtual"


async def ask(
    http: aiohttp.ClientSession, base: str, params: LaunchParams, deadline_s: float
) -> tuple[bool, str]:
    """One probe: (answered, why not)."""
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id(time.time())}
    # aiohttp rounds a total deadline of ceil_threshold (5 s) or more up to the next whole
    # second: at the default interval every failed probe took up to 6 s, not 5. Never rounded.
    timeout = aiohttp.ClientTimeout(total=deadline_s, ceil_threshold=math.inf)
    try:
        async with http.post(base + PATH, data=body(params), headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                return False, f"{PATH} answered {resp.status}"
            answer = await resp.json(content_type=None)
    except TimeoutError:
        return False, f"{PATH} did not answer within {deadline_s:g}s"
    except (aiohttp.ClientError, ValueError, OSError) as exc:
        return False, f"{PATH} failed: {type(exc).__name__}"
    if not isinstance(answer, dict) or not answer.get("choices"):
        return False, f"{PATH} answered 200 without choices"
    return True, ""

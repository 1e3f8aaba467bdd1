"""Reading a service's Prometheus ``/metrics`` answer (the Controller's and each NodeManager's
``metrics_port``)."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.poll import Retry, until


class Scrape:
    """The samples of one ``/metrics`` answer."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples = [s for f in text_string_to_metric_families(text) for s in f.samples]

    def value(self, name: str, **labels: str) -> float:
        """The one sample named ``name`` whose labels include ``labels``."""
        found = [s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items()]
        assert len(found) == 1, f"{len(found)} samples {name} {labels}"
        return float(found[0])

    def has(self, name: str) -> bool:
        """Whether metric ``name`` (a histogram by its ``_count``) has a sample."""
        return any(s.name in (name, name + "_count") for s in self.samples)


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        return Scrape(resp.read().decode())


async def ascrape(url: str) -> Scrape:
    async with aiohttp.ClientSession() as s, s.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
        assert resp.status == 200, resp.status
        assert resp.content_type == "text/plain"
        return Scrape(await resp.text())


async def scrape_until(url: str, check: Callable[[Scrape], Any], *, retry: Retry = ()) -> Scrape:
    """The first scrape of ``url`` for which ``check`` holds (within 20 s); ``retry``: the errors
    of the scrape or the check that mean "not yet" (tests/poll.py)."""

    async def once() -> Scrape | None:
        m = await ascrape(url)
        return m if check(m) else None

    return await until(once, 20, f"metrics at {url}", retry=retry)

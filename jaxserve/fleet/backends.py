"""The replicas (or, for the router, the servers) as the front sees them: where they are, what
the front has open there, and their load as their /metrics last said, polled in the
background so a routing decision never waits on the network.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from jaxserve.fleet.metrics import KV_USAGE, WAITING, load_gauges
from jaxserve.fleet.routing import ReplicaLoad

logger = logging.getLogger("jaxserve")


@dataclass
class Backend:
    """One server behind the front. in_flight: requests forwarded there whose response has not
    ended (mutated by the proxy only); waiting, kv_usage, healthy: from the latest poll."""

    url: str
    in_flight: int = 0
    waiting: float = 0.0
    kv_usage: float = 0.0
    healthy: bool = True

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(self.in_flight, self.waiting, self.kv_usage, self.healthy)


class BackendPool:
    """The backends and their poller: ``start`` in the server's event loop, ``close`` at its
    end. ``interval_s``: seconds between polls of every backend's /metrics."""

    def __init__(self, urls: Sequence[str], interval_s: float = 0.5) -> None:
        if not urls:
            raise ValueError("at least one backend URL is needed")
        self.backends = [Backend(url.rstrip("/")) for url in urls]
        self.interval_s = interval_s
        self.session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task | None = None

    def loads(self) -> list[ReplicaLoad]:
        return [b.load() for b in self.backends]

    async def start(self) -> None:
        # No total timeout: a stream lasts as long as its generation. Connections to the
        # replicas are kept alive and reused.
        timeout = aiohttp.ClientTimeout(total=None, connect=10)
        self.session = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
        )
        self._poller = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    async def fetch_metrics(self) -> list[str | None]:
        """Every backend's /metrics text (None where it did not answer 200)."""
        return list(await asyncio.gather(*(self._get_text(b, "/metrics") for b in self.backends)))

    async def _get_text(self, backend: Backend, path: str) -> str | None:
        assert self.session is not None
        try:
            timeout = aiohttp.ClientTimeout(total=5)
            async with self.session.get(backend.url + path, timeout=timeout) as response:
                if response.status != 200:
                    return None
                return await response.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    async def poll_once(self) -> None:
        """Read every backend's /health and /metrics: healthy while /health answers 200."""
        texts, alive = await asyncio.gather(
            self.fetch_metrics(),
            asyncio.gather(*(self._get_text(b, "/health") for b in self.backends)),
        )
        for backend, text, up in zip(self.backends, texts, alive, strict=True):
            was = backend.healthy
            backend.healthy = up is not None
            if text is not None:
                gauges = load_gauges(text)
                backend.waiting, backend.kv_usage = gauges[WAITING], gauges[KV_USAGE]
            if was != backend.healthy:
                logger.warning(
                    "backend %s is %s", backend.url, "back" if backend.healthy else "unreachable"
                )

    async def _poll_forever(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval_s)

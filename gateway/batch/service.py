"""The Batch API's running parts in one gateway: the Redis link, the stores and the runner."""

from __future__ import annotations

import asyncio
import contextlib

from gateway.batch.files import FileStore
from gateway.batch.redis_link import RedisLink
from gateway.batch.runner import BatchRunner
from gateway.batch.store import BatchStore
from gateway.core import RequestCore


class BatchService:
    """Built when the configuration has a `redis` section; its runner starts with the app."""

    def __init__(self, core: RequestCore) -> None:
        state = core.state
        config = state.config
        assert config.redis is not None
        self.config = config.batch
        self.link = RedisLink(config.redis, on_change=state.observer.redis_up)
        self.files = FileStore(self.link)
        self.store = BatchStore(self.link)
        cls = config.batch_class
        pool = state.pool_for_class[cls]
        self.runner = BatchRunner(self.link, self.store, self.files, core, config.batch, cls,
                                  pool.models, pool.router.block_chars, state.observer)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """The runner starts in the background: Redis may not be there yet, and serving
        must not wait for it."""
        self.runner.observer.batch_inflight(0)  # the series exist from the start, at zero
        self.runner.observer.batch_unwritten(0)
        self._task = asyncio.create_task(self.runner.run(), name="batch-runner")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.runner.stop()
        await self.link.aclose()

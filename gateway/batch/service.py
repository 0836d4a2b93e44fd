"""The Batch API's running parts in one gateway: the Redis link, the stores and the runner."""

from __future__ import annotations

import asyncio

from gateway.batch.files import FileStore
from gateway.batch.runner import BatchRunner
from gateway.batch.store import BatchStore
from gateway.core import RequestCore
from gateway.redis_link import RedisLink


class BatchService:
    """Built when the configuration has a `redis` section; its runner starts with the app."""

    def __init__(self, core: RequestCore) -> None:
        state = core.state
        config = state.config
        assert config.redis is not None
        self.config = config.batch
        self.link = RedisLink(config.redis, on_change=state.observer.redis_up,
                              client=state.redis)
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
        # Told to stop before it is cancelled: a cancellation can be lost in a race inside
        # asyncio.wait_for (Python 3.11), and the loop must end anyway. Bounded waits: a
        # shutdown never hangs on the runner.
        self.runner.halt()
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=5)
        await self.runner.stop()
        await self.link.aclose()

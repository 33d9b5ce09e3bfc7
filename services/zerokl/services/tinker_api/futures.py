"""Futures: every Tinker call answers at once with a request id; its result is retrieved later.

    request_id, future = store.new()                     # the caller runs (or queues) the work into future
    done, result = await store.wait(request_id, timeout_s)   # not done: still pending (the SDK polls again)

A result is kept until it is retrieved and then for ``keep_s`` more (the SDK fetches again after
a dropped connection), and an unretrieved one for ``unretrieved_s``; at most ``max_kept`` results
are held (the oldest finished go first). Failures are kept the same way: a
:class:`~zerokl.services.tinker_api.types.FutureFailure` is the result the SDK raises as
``RequestFailedError``.
"""
from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from zerokl.services.runtime.errors import NotFound

__all__ = ["FutureStore"]


@dataclass
class _Entry:
    future: asyncio.Future[Any]
    finished: float | None = None
    retrieved: float | None = None


class FutureStore:
    """Request ids -> results. Call from the event loop."""

    def __init__(self, *, keep_s: float = 600.0, unretrieved_s: float = 3600.0, max_kept: int = 100_000) -> None:
        self.keep_s, self.unretrieved_s, self.max_kept = keep_s, unretrieved_s, max_kept
        self._entries: dict[str, _Entry] = {}
        self._prefix = secrets.token_hex(4)     # ids of two server lifetimes never collide
        self._counter = itertools.count(1)

    def new(self) -> tuple[str, asyncio.Future[Any]]:
        """A fresh request id and the future its result goes into (the caller sets it)."""
        self._sweep()
        request_id = f"req-{self._prefix}-{next(self._counter)}"
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        entry = _Entry(future)
        future.add_done_callback(lambda _: setattr(entry, "finished", time.monotonic()))
        self._entries[request_id] = entry
        return request_id, future

    async def wait(self, request_id: str, timeout_s: float) -> tuple[bool, Any]:
        """(done, result) of a request, waiting up to ``timeout_s`` for it to finish (a long poll).
        NOT_FOUND for an id this server never issued or no longer holds."""
        entry = self._get(request_id)
        if not entry.future.done():
            try:
                await asyncio.wait_for(asyncio.shield(entry.future), timeout_s)
            except asyncio.TimeoutError:
                return False, None
        entry.retrieved = entry.retrieved or time.monotonic()
        return True, entry.future.result()

    def _get(self, request_id: str) -> _Entry:
        entry = self._entries.get(request_id)
        if entry is None:
            raise NotFound(f"no request {request_id!r}: it was never submitted here, or its result expired "
                           f"(results are kept {self.keep_s:.0f}s after retrieval)")
        return entry

    def _sweep(self) -> None:
        now = time.monotonic()
        for request_id, e in list(self._entries.items()):
            if e.finished is None:
                continue
            if (e.retrieved is not None and now - e.retrieved > self.keep_s) or now - e.finished > self.unretrieved_s:
                del self._entries[request_id]
        excess = len(self._entries) - self.max_kept
        if excess > 0:
            finished = sorted((e.finished, rid) for rid, e in self._entries.items() if e.finished is not None)
            for _, request_id in finished[:excess]:
                del self._entries[request_id]

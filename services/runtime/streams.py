"""Stopping an await or a stream when an event is set (an Abort, a shutdown).

The one copy of this logic: the scheduler stops relaying a request that was
aborted, a decode replica stops reading a KV handoff that was aborted.
"""
from __future__ import annotations

import asyncio
from contextlib import suppress
from typing import AsyncIterator, Awaitable, TypeVar

import grpc.aio

__all__ = ["unless_set", "until_set"]

T = TypeVar("T")


async def unless_set(awaitable: Awaitable[T], stop: asyncio.Event) -> T | None:
    """``awaitable``'s result, or None if ``stop`` is set first (the awaitable is then cancelled)."""
    task = asyncio.ensure_future(awaitable)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        return None
    finally:
        stopper.cancel()
        if not task.done():
            task.cancel()
            # Let the cancelled await unwind before the caller closes what it was reading.
            with suppress(asyncio.CancelledError, StopAsyncIteration, grpc.aio.AioRpcError):
                await task


async def until_set(stream: AsyncIterator[T], stop: asyncio.Event) -> AsyncIterator[T]:
    """Items of ``stream`` until it ends or ``stop`` is set (checked while waiting for each item)."""
    it = aiter(stream)
    while True:
        try:
            item = await unless_set(anext(it), stop)
        except StopAsyncIteration:
            return
        if item is None:  # stopped (a stream never yields None)
            return
        yield item

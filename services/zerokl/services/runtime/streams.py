"""Stopping an await or a stream when an event is set (an Abort, a shutdown).

The one copy of this logic: the scheduler stops relaying a request that was
aborted (:func:`batches_until_set`, which also hands it what arrived meanwhile
in one batch), a decode replica stops reading a KV handoff that was aborted.
"""
from __future__ import annotations

import asyncio
from contextlib import suppress
from typing import AsyncIterator, Awaitable, TypeVar

import grpc.aio

__all__ = ["unless_set", "batches_until_set"]

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


async def batches_until_set(stream: AsyncIterator[T], stop: asyncio.Event) -> AsyncIterator[list[T]]:
    """Items of ``stream`` until it ends or ``stop`` is set, in batches: everything that arrived
    while the consumer was busy with the last batch (never an empty one).

    One task reads ``stream`` ahead into a buffer (the stop is watched once, not per item),
    so a consumer that falls behind handles and forwards many items at once instead of
    waiting once per item. An error of ``stream`` is raised after the items before it.
    """
    buffer: list[T] = []
    wake = asyncio.Event()

    async def read() -> None:
        try:
            async for item in stream:
                buffer.append(item)
                wake.set()
        finally:
            wake.set()

    async def watch() -> None:
        await stop.wait()
        wake.set()

    reader = asyncio.ensure_future(read())
    watcher = asyncio.ensure_future(watch())
    try:
        while not stop.is_set():
            if buffer:
                batch = buffer[:]
                buffer.clear()
                yield batch
            elif reader.done():
                reader.result()   # the stream's error, if it ended with one
                return
            else:
                wake.clear()
                await wake.wait()
    finally:
        watcher.cancel()
        if not reader.done():
            reader.cancel()
        # Let the cancelled read unwind before the caller closes what it was reading; an error
        # it ended with after the consumer left is nobody's to handle any more.
        with suppress(asyncio.CancelledError, Exception):
            await reader

"""The API server's side of the IPC: send requests, route results to per-request queues.

One asyncio task reads the detokenizer's socket and puts each output (a `ReqOutput`, its text
filled in) on the queue its request id was submitted with; handlers only ever await their own.
When the backend goes away (a drain that ran out of time, or a process that died), every open
request still ends: as aborted, or with a BackendUnavailable on its queue.
"""

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

from minisgl.core import FinishReason, ReqOutput
from minisgl.runtime import messages as msg

logger = logging.getLogger(__name__)

SHUTTING_DOWN = "The server is shutting down."
BACKEND_STOPPED = "The inference backend stopped unexpectedly; the request was not completed."
SCHEDULER_SILENT = "The scheduler did not answer."


class BackendUnavailable(Exception):
    """The backend takes no more requests (shutting down, or stopped): `submit` raises it, and
    `abort_all(message)` puts it on each open request's queue. The API answers it with a 503;
    its one argument is the message."""


class EngineClient:
    def __init__(self, endpoints: msg.Endpoints) -> None:
        # Sends go through plain sockets: with no high-water mark they never block the loop.
        self._to_scheduler = msg.MessageQueue("push", endpoints.scheduler_in)
        self._to_scheduler_ctl = msg.MessageQueue("push", endpoints.scheduler_ctl)
        self._inbox = msg.MessageQueue("pull", endpoints.api_in, asyncio=True)
        self._routes: dict[str, asyncio.Queue] = {}  # by request id
        # Control replies (stats, cache flush) by request id: one counter for both kinds.
        self._waiters: dict[int, asyncio.Future[Any]] = {}
        self._request_ids = itertools.count()
        self.last_stats: msg.StatsReply | None = None
        # Event-loop time of the latest output from the backend: proof that it generates
        # (/health_generate).
        self.last_output_s = float("-inf")
        # Set when the scheduler is going away (shutdown, or it died): why new submits fail.
        self._closed_message: str | None = None
        # Made on the event loop that serves the requests; reads until `close`.
        self._reader = asyncio.create_task(self._read_loop(), name="minisgl-engine-reader")

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        for queue in (self._to_scheduler, self._to_scheduler_ctl, self._inbox):
            queue.close()

    async def _read_loop(self) -> None:
        while True:
            try:
                self._dispatch(await self._inbox.aget())
            except Exception:  # a dead reader would leave every request waiting forever
                logger.exception("api server: could not handle a message from the backend")

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, tuple):  # a step's outputs
            self.last_output_s = asyncio.get_running_loop().time()
            for output in message:
                done = output.finish_reason is not None
                route = self._routes.pop(output.rid, None) if done else self._routes.get(output.rid)
                if route is not None:  # None: aborted by us, the client is gone
                    route.put_nowait(output)
        else:  # a StatsReply or FlushCacheReply: nothing else is sent to api_in
            if isinstance(message, msg.StatsReply):
                self.last_stats = message
            waiter = self._waiters.pop(message.request_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(message)

    def submit(self, request: msg.TokenizedRequest, queue: asyncio.Queue) -> None:
        """Start one sequence; its outputs arrive on `queue`. The route exists only once the send
        succeeded, so a failed send leaves nothing behind."""
        if self._closed_message is not None:
            raise BackendUnavailable(self._closed_message)
        self._to_scheduler.put(request)
        self._routes[request.rid] = queue

    def abort_all(self, error: str | None = None) -> None:
        """Shutdown: end every open request now so no handler waits on a scheduler that is about
        to stop, and refuse new ones. Without `error` they end as aborted (a drain that ran out
        of time); with it, BackendUnavailable(error) goes on each one's queue (the backend
        died, BACKEND_STOPPED)."""
        self._closed_message = error or SHUTTING_DOWN
        for rid, queue in list(self._routes.items()):
            self.abort(rid)
            ended = ReqOutput(rid, (), FinishReason.ABORT)
            queue.put_nowait(ended if error is None else BackendUnavailable(error))

    def abort(self, rid: str) -> None:
        if self._routes.pop(rid, None) is not None:
            self._to_scheduler.put(msg.AbortRequest(rid))

    async def flush_cache(self, timeout_s: float) -> msg.FlushCacheReply:
        """Ask the scheduler to empty its prefix cache; BackendUnavailable if it does not answer
        in time (a long step may be running). On the request socket: after every request sent
        before."""
        return await self._ask(self._to_scheduler, msg.FlushCacheRequest, timeout_s, True)

    async def stats(self, timeout_s: float, required: bool = False) -> msg.StatsReply | None:
        """Ask the scheduler for its stats; None if it does not answer in time (BackendUnavailable
        if `required`)."""
        return await self._ask(self._to_scheduler_ctl, msg.StatsRequest, timeout_s, required)

    async def _ask(
        self,
        queue: msg.MessageQueue,
        request: Callable[[int], object],
        timeout_s: float,
        required: bool,
    ) -> Any:
        """Send request(id) and wait for the reply carrying that id (see _dispatch)."""
        request_id = next(self._request_ids)
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = waiter
        queue.put(request(request_id))
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        except asyncio.TimeoutError:
            if required:
                raise BackendUnavailable(SCHEDULER_SILENT) from None
            return None
        finally:
            self._waiters.pop(request_id, None)

    @property
    def num_active_requests(self) -> int:
        return len(self._routes)

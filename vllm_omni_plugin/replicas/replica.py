r"""Replicas as the head sees them: in-process (local) or behind the task channel (remote).

Both run :class:`~.task.StageTask`\ s and keep the counters ``/metrics``
reports. A replica is *attached* while the head can send it work: a local
one while its engine lives, a remote one while the coordinator lists it ``UP``.
Status: ``up``; ``starting`` (a local engine being restarted, see
:mod:`.supervisor`); ``error`` (dead or missing heartbeats; may come back);
``down`` (closed or given up).
"""

from __future__ import annotations

import asyncio
import os
from contextlib import aclosing

import zmq
import zmq.asyncio

from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.payload_store import PayloadStore
from vllm_omni_plugin.wire.codec import FrameRejected, RejectLog

from .protocol import (
    Channel,
    TaskAbort,
    TaskDone,
    TaskFailed,
    TaskGrow,
    TaskProgress,
    TaskRows,
    TaskSubmit,
    ToHead,
    ToReplica,
    pack_tensors,
    unpack_tensors,
)
from .task import (
    ReplicaLost,
    RowsSink,
    StageRun,
    StageTask,
    TaskAborted,
    TaskError,
    run_on_engine,
)

logger = init_logger(__name__)


class Replica:
    """Common state: identity, status and per-replica request counters."""

    location = "local"

    def __init__(self, stage_id: int, replica_id: int, address: str) -> None:
        self.stage_id = stage_id
        self.replica_id = replica_id
        self.address = address
        self.status = "up"  # "up" | "starting" | "error" | "down"
        self.requests_total = 0
        self.running: set[str] = set()
        #: +1 each time a local replica's engine is replaced by a restart
        self.generation = 0
        #: ``time.monotonic()`` when a replica being restarted is expected up, else None
        self.restart_eta: float | None = None
        #: times a local replica's engine was killed as stalled (:mod:`.liveness`)
        self.stalls = 0

    @property
    def name(self) -> str:
        """How logs and errors name the replica: ``stage S replica R (local|remote ADDRESS)``."""
        return f"stage {self.stage_id} replica {self.replica_id} ({self.location} {self.address})"

    @property
    def attached(self) -> bool:
        """Whether the head can send it work now (status ``up``)."""
        return self.status == "up"

    @property
    def incarnation(self) -> tuple[int, int]:
        """``(replica_id, generation)``: a restarted replica is a new incarnation."""
        return self.replica_id, self.generation

    @property
    def recovering(self) -> bool:
        """Not attached now but expected back without anyone's action."""
        return self.status == "starting"

    async def run(self, task: StageTask, on_rows: RowsSink | None = None) -> StageRun:
        """Run ``task``. ``on_rows`` receives its output payload chunks as the engine
        publishes them (see :func:`~.task.run_on_engine`) where the replica can tell
        (local replicas); a remote replica hands over the whole payload at the end.

        Raises:
            TaskError: the task failed on a healthy replica.
            TaskAborted: :meth:`abort` was called for it.
            ReplicaLost: the replica died or left meanwhile.
        """
        raise NotImplementedError

    async def abort(self, request_id: str) -> None:
        """Stop the task of ``request_id`` if it runs here; its :meth:`run` then raises
        :class:`~.task.TaskAborted`."""
        raise NotImplementedError

    def lost(self, reason: str) -> None:
        """Mark the replica gone: running tasks end with :class:`ReplicaLost`."""
        self.status = "error"

    def close(self) -> None:
        """Detach: no task reaches it after this (quick; on the head's thread)."""
        self.status = "down"

    def release(self) -> None:
        """Free what :meth:`close` left running, which may block for seconds (a local
        engine's processes); thread-safe, called once after :meth:`close`. Nothing by
        default."""


class LocalReplica(Replica):
    """A stage engine (``AsyncLLM``, own EngineCore process) in the head process."""

    def __init__(self, stage_id: int, replica_id: int, engine, payload_dir: str) -> None:
        super().__init__(stage_id, replica_id, f"in-process:{os.getpid()}")
        self.engine = engine
        self.store = PayloadStore(payload_dir)
        self.supervisor = None  # a LocalReplicaSupervisor once supervised
        self._aborted: set[str] = set()
        #: request id -> future set by :meth:`lost`: the engine died under the task
        self._lost: dict[str, asyncio.Future] = {}

    @property
    def queue_length(self) -> int:
        """The number of tasks running on this replica now."""
        return len(self.running)

    def replace_engine(self, engine) -> None:
        """Swap in a restarted engine: a new incarnation, attached."""
        self.engine = engine
        self.generation += 1
        self.restart_eta = None
        self.status = "up"

    async def run(self, task: StageTask, on_rows: RowsSink | None = None) -> StageRun:
        """Run ``task`` on the in-process engine; also raises :class:`~.task.ReplicaLost` when
        the engine dies under it (signalled by :meth:`lost`, or seen here first, which tells
        the supervisor)."""
        self.requests_total += 1
        self.running.add(task.request_id)
        engine = self.engine
        produced = False

        def on_progress(_num_tokens: int) -> None:
            nonlocal produced
            produced = True

        # The engine's death is signalled here by the supervisor (see lost()):
        # a request vLLM never answers once its client was shut down must not
        # wait forever.
        lost = asyncio.get_running_loop().create_future()
        self._lost[task.request_id] = lost
        runner = asyncio.ensure_future(run_on_engine(
            engine, self.store, task, on_progress=on_progress,
            aborted=lambda: task.request_id in self._aborted, on_rows=on_rows))
        try:
            await asyncio.wait({runner, lost}, return_when=asyncio.FIRST_COMPLETED)
            if not runner.done():
                raise ReplicaLost(lost.result(), produced)
            result = runner.result()
        except ReplicaLost:
            if engine is self.engine:  # maybe before the supervisor's watcher saw it
                if self.supervisor is not None:
                    self.supervisor.engine_died(engine)
                elif self.status == "up":
                    self.lost("its engine core died")
            raise
        except TaskError:
            if task.request_id in self._aborted:
                raise TaskAborted(task.request_id) from None
            raise
        finally:
            if not runner.done():
                runner.cancel()
                runner.add_done_callback(_consume)
            self._lost.pop(task.request_id, None)
            self.running.discard(task.request_id)
            aborted = task.request_id in self._aborted
            self._aborted.discard(task.request_id)
        if aborted:
            raise TaskAborted(task.request_id)
        return result

    def lost(self, reason: str) -> None:
        """Also ends every running task's :meth:`run` with :class:`~.task.ReplicaLost`
        (``reason``)."""
        super().lost(reason)
        for future in list(self._lost.values()):
            if not future.done():
                future.set_result(reason)

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id`` on the engine when it runs here; its :meth:`run` then raises
        :class:`~.task.TaskAborted`."""
        if request_id in self.running:
            self._aborted.add(request_id)
            await self.engine.abort(request_id)

    def close(self) -> None:
        """Stop supervising; the payload directory belongs to the orchestrator."""
        if self.supervisor is not None:
            self.supervisor.close()
        super().close()

    def release(self) -> None:
        """Shut the engine down (its EngineCore and workers)."""
        try:
            self.engine.shutdown()
        except Exception:
            logger.exception("%s: shutdown failed", self.name)


def _consume(task: asyncio.Task) -> None:
    """Retrieve a cancelled runner's outcome (its engine is gone; nothing to report)."""
    if not task.cancelled():
        task.exception()


class _Pending:
    __slots__ = ("future", "produced", "rows")

    def __init__(self, future: asyncio.Future, rows: RowsSink | None = None) -> None:
        self.future = future
        self.produced = False
        self.rows = rows  # gets the replica's TaskRows


class RemoteReplica(Replica):
    """A headless replica, reached over its task channel (one DEALER socket).

    Args:
        address: The replica's task endpoint, ``tcp://host:port``.
        cluster_token: As :class:`~.protocol.Channel`.
    """

    location = "remote"

    def __init__(self, stage_id: int, replica_id: int, address: str,
                 cluster_token: str | None = None) -> None:
        super().__init__(stage_id, replica_id, address)
        from .protocol import MAX_TASK_FRAME_BYTES

        self.reported_queue_length = 0  # last value the coordinator published
        self.rejected_frames = 0
        self._reject_log = RejectLog(logger, f"{self.name}: dropped a task-channel frame")
        self._channel = Channel(ToHead, cluster_token)
        self._pending: dict[str, _Pending] = {}
        self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_TASK_FRAME_BYTES + 4096)
        self._socket.connect(address)
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    @property
    def recovering(self) -> bool:
        """Missing heartbeats (``error``): it is listed ``UP`` again once they resume."""
        return self.status == "error"

    @property
    def queue_length(self) -> int:
        """The replica's load: its last heartbeat's queue length, or this head's
        tasks in flight there when higher (heartbeats lag)."""
        return max(self.reported_queue_length, len(self.running))

    async def run(self, task: StageTask, on_rows: RowsSink | None = None) -> StageRun:
        """Send ``task`` as a :class:`~.protocol.TaskSubmit` (a growing input then follows as
        :class:`~.protocol.TaskGrow` frames) and wait for its :class:`~.protocol.TaskDone`;
        a cancelled caller aborts the task on the replica. Raises :class:`~.task.ReplicaLost`
        at once when the replica is not attached."""
        if not self.attached:
            raise ReplicaLost(f"{self.name} is not attached", produced_output=False)
        self.requests_total += 1
        pending = _Pending(asyncio.get_running_loop().create_future(), on_rows)
        self._pending[task.request_id] = pending
        self.running.add(task.request_id)
        feeder = None
        try:
            blob = await asyncio.to_thread(pack_tensors, task.payload)
            submit = TaskSubmit(request_id=task.request_id,
                                prompt_token_ids=list(task.prompt_token_ids),
                                sampling=dict(task.sampling), payload=blob,
                                publish=task.publish,
                                rows=on_rows is not None and task.publish,
                                ready=task.ready if task.growth is not None else None,
                                cache_salt=task.cache_salt)
            await self._socket.send_multipart(self._channel.frames(ToReplica(msg=submit)))
            if task.growth is not None:
                feeder = asyncio.ensure_future(self._feed(task, pending))
            done: TaskDone = await pending.future
            payload = await asyncio.to_thread(unpack_tensors, done.payload)
            return StageRun(list(done.prompt_token_ids), list(done.output_token_ids), payload,
                            done.finish_reason, done.prefill_engine)
        except asyncio.CancelledError:
            # the request's caller went away (a client that disconnected): the replica
            # stops the task as on an abort
            await self._send_abort(task.request_id)  # (a finished task ignores it)
            raise
        finally:
            if feeder is not None:
                feeder.cancel()
            self._pending.pop(task.request_id, None)
            self.running.discard(task.request_id)

    async def _feed(self, task: StageTask, pending: _Pending) -> None:
        """Send the rest of ``task``'s growing input as :class:`TaskGrow` frames as it
        comes; a failure to produce it (the input processor's) fails the task and stops
        it on the replica."""
        try:
            async with aclosing(task.growth) as growth:
                async for more in growth:
                    blob = await asyncio.to_thread(pack_tensors, more.payload)
                    grow = TaskGrow(request_id=task.request_id, payload=blob, ready=more.ready)
                    await self._socket.send_multipart(self._channel.frames(
                        ToReplica(msg=grow)))
        except Exception as exc:
            # the abort goes out first: failing the future wakes run(), which cancels
            # this feeder (a send still under way would be lost)
            if not pending.future.done():
                await self._send_abort(task.request_id)
            if not pending.future.done():  # (lost meanwhile: failed already)
                pending.future.set_exception(exc)

    async def abort(self, request_id: str) -> None:
        """Fail the pending task of ``request_id`` with :class:`~.task.TaskAborted` and tell the
        replica to stop it; a no-op when no such task is pending here."""
        pending = self._pending.get(request_id)
        if pending is None:
            return
        if not pending.future.done():
            pending.future.set_exception(TaskAborted(request_id))
        await self._send_abort(request_id)

    async def _send_abort(self, request_id: str) -> None:
        """Tell the replica to stop ``request_id`` (a :class:`TaskAbort`), if attached."""
        if self.attached:
            await self._socket.send_multipart(
                self._channel.frames(ToReplica(msg=TaskAbort(request_id=request_id))))

    async def _read_loop(self) -> None:
        while True:
            frames = await self._socket.recv_multipart(copy=True)
            try:
                msg = self._channel.decode(frames)
            except FrameRejected as rej:
                self.rejected_frames += 1
                self._reject_log.note(rej)
                continue
            pending = self._pending.get(msg.request_id)
            if pending is None or pending.future.done():
                continue  # finished, aborted or failed over meanwhile
            if isinstance(msg, TaskProgress):
                pending.produced = True
            elif isinstance(msg, TaskRows):
                if pending.rows is not None:
                    try:
                        pending.rows.add([unpack_tensors(msg.payload)])
                    except ValueError as exc:  # the task fails; the replica stops it
                        await self._send_abort(msg.request_id)
                        if not pending.future.done():  # (lost meanwhile: failed already)
                            pending.future.set_exception(TaskError(
                                f"{self.name}: rows of {msg.request_id}: {exc}"))
            elif isinstance(msg, TaskDone):
                pending.future.set_result(msg)
            elif isinstance(msg, TaskFailed):
                pending.future.set_exception(TaskError(msg.error, msg.status))

    def lost(self, reason: str) -> None:
        """Also fails every pending task with :class:`~.task.ReplicaLost` naming ``reason``."""
        super().lost(reason)
        for request_id, pending in list(self._pending.items()):
            if not pending.future.done():
                pending.future.set_exception(ReplicaLost(
                    f"{self.name} {reason} while running {request_id}", pending.produced))

    def reattach(self) -> None:
        """Attach it again (status ``up``): the coordinator lists it ``UP`` once more."""
        self.status = "up"

    def close(self) -> None:
        """Also fails its pending tasks (when attached), stops reading its task channel and
        closes the socket."""
        if self.status == "up":
            self.lost("was detached")
        super().close()
        self._reader.cancel()
        self._socket.close(linger=0)

"""Headless stage replicas: ``vllm serve MODEL --stage-configs-path YAML --headless --stage-id N``.

One process registers ``--omni-dp-size-local`` replicas of stage ``N`` with the
head's master (ids and task ports come from there), starts one vLLM engine per
replica (``AsyncLLM``, its own EngineCore process), binds each replica's task
endpoint (ROUTER) on the registered address only, and reports liveness and
queue length to the head's coordinator. It runs until SIGINT/SIGTERM, or
until a replica's engine dies or stalls (answers no liveness probe within the stall
timeout, :mod:`.liveness`: its processes are then killed); the replica then reports
``ERROR`` and the process exits non-zero so a supervisor can restart it.
"""

from __future__ import annotations

import asyncio
import os
import signal

import zmq
import zmq.asyncio

from vllm_omni_plugin.coordinator import OmniCoordClientForStage, ReplicaStatus
from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.payload_store import PayloadStore
from vllm_omni_plugin.wire.codec import FrameRejected, RejectLog
from vllm_omni_plugin.wire.sockets import bind

from .liveness import StallWatch, kill_engine, stall_timeout_of
from .protocol import (
    KV_BOOTSTRAP_ENDPOINT,
    MAX_TASK_FRAME_BYTES,
    TASK_ENDPOINT,
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
from .task import InputGrowth, ReplicaLost, StageTask, TaskAborted, TaskError, run_on_engine

logger = init_logger(__name__)


def task_socket(address: str) -> zmq.asyncio.Socket:
    """A ROUTER socket bound to ``address`` (``tcp://host:port``) for a replica's task
    endpoint.

    Raises:
        zmq.ZMQError: ``address`` cannot be bound (e.g. another process holds the port).
    """
    sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_TASK_FRAME_BYTES + 4096)
    try:
        bind(sock, address)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock


class ReplicaServer:
    """Serves one replica's task endpoint on top of its stage engine.

    Args:
        stage_id, replica_id: Identity (from the master).
        engine: The replica's ``AsyncLLM``.
        payload_dir: The replica's payload store directory (its engine's).
        address: Task endpoint, ``tcp://host:port``.
        coordinator: The head coordinator's ROUTER address.
        heartbeat_interval: Seconds between heartbeats.
        stall_timeout: Seconds the engine may leave a liveness probe unanswered before
            it counts as stalled; 0: not probed.
        socket: The task endpoint already bound to ``address`` (:func:`task_socket`);
            None: bound here.
    """

    def __init__(self, stage_id: int, replica_id: int, engine, payload_dir: str,
                 address: str, coordinator: str, heartbeat_interval: float,
                 stall_timeout: float = 0.0, socket: zmq.asyncio.Socket | None = None) -> None:
        self.stage_id, self.replica_id, self.engine = stage_id, replica_id, engine
        self.stall_timeout = stall_timeout
        self.address = address
        self.store = PayloadStore(payload_dir)
        self.channel = Channel(ToReplica)
        self.tasks: dict[str, asyncio.Task] = {}
        self.aborted: set[str] = set()
        #: the TaskGrow frames of running tasks whose input grows (None: no more)
        self._growth: dict[str, asyncio.Queue] = {}
        self._sending: set[asyncio.Task] = set()
        self.rejected_frames = 0
        self._reject_log = RejectLog(
            logger, f"stage {stage_id} replica {replica_id} dropped a task-channel frame")
        self.socket = socket if socket is not None else task_socket(address)
        self.coord = OmniCoordClientForStage(
            coordinator, address, address, stage_id,
            heartbeat_interval=heartbeat_interval,
            queue_length_provider=lambda: len(self.tasks))
        logger.info("stage %d replica %d serving on %s", stage_id, replica_id, address)

    async def serve(self) -> None:
        """Receive tasks until the engine dies or stalls (raises ``ReplicaLost``) or
        cancelled."""
        self._dead: asyncio.Future = asyncio.get_running_loop().create_future()
        receiver = asyncio.ensure_future(self._receive())
        watch = None
        if self.stall_timeout > 0:
            watch = StallWatch(self.engine, self.stall_timeout,
                               f"stage {self.stage_id} replica {self.replica_id}",
                               self._stalled, busy=lambda: len(self.tasks))
            watch.start()
        try:
            await asyncio.wait([receiver, self._dead], return_when=asyncio.FIRST_COMPLETED)
            if self._dead.done():
                raise self._dead.exception()
        finally:
            receiver.cancel()
            if watch is not None:
                watch.stop()

    def _stalled(self, reason: str) -> None:
        kill_engine(self.engine)
        self._engine_lost(ReplicaLost(reason, produced_output=False))

    def _engine_lost(self, exc: ReplicaLost) -> None:
        """Say ERROR at once (the head detaches this replica and fails over) and end
        :meth:`serve`."""
        self.coord.update_info(status=ReplicaStatus.ERROR)
        if not self._dead.done():
            self._dead.set_exception(exc)

    async def _receive(self) -> None:
        while True:
            identity, *frames = await self.socket.recv_multipart()
            try:
                msg = self.channel.decode(frames)
            except FrameRejected as rej:
                self.rejected_frames += 1
                self._reject_log.note(rej)
                continue
            if isinstance(msg, TaskSubmit):
                if msg.request_id not in self.tasks:
                    if msg.ready is not None:
                        self._growth[msg.request_id] = asyncio.Queue()
                    self.tasks[msg.request_id] = asyncio.ensure_future(self._run(identity, msg))
            elif isinstance(msg, TaskGrow):
                if (queue := self._growth.get(msg.request_id)) is not None:
                    queue.put_nowait(msg)
            elif isinstance(msg, TaskAbort) and msg.request_id in self.tasks:
                self.aborted.add(msg.request_id)
                if (queue := self._growth.get(msg.request_id)) is not None:
                    queue.put_nowait(None)  # no more input: a paused request must not wait
                await self.engine.abort(msg.request_id)

    async def _reply(self, identity: bytes, msg) -> None:
        await self.socket.send_multipart([identity, *self.channel.frames(ToHead(msg=msg))])

    async def _run(self, identity: bytes, submit: TaskSubmit) -> None:
        rid = submit.request_id
        loop = asyncio.get_running_loop()
        rows_sent: list[asyncio.Task] = []  # TaskRows go out before TaskDone

        def send(msg) -> asyncio.Task:
            sending = loop.create_task(self._reply(identity, msg))
            self._sending.add(sending)  # asyncio keeps only weak references to tasks
            sending.add_done_callback(self._sending.discard)
            return sending

        def progress(num_tokens: int) -> None:
            send(TaskProgress(rid, num_tokens))

        try:
            try:
                payload = await asyncio.to_thread(unpack_tensors, submit.payload)
            except ValueError as exc:
                raise TaskError(str(exc), status=400) from exc
            queue = self._growth.get(rid)
            task = StageTask(rid, list(submit.prompt_token_ids), dict(submit.sampling), payload,
                             publish=submit.publish, ready=submit.ready,
                             growth=None if queue is None else _input_growth(queue),
                             cache_salt=submit.cache_salt)
            on_rows = _RowsSender(lambda blob: rows_sent.append(send(TaskRows(rid, blob)))) \
                if submit.rows else None
            run = await run_on_engine(self.engine, self.store, task, progress,
                                      aborted=lambda: rid in self.aborted,
                                      host=self.address.split("://", 1)[-1].rsplit(":", 1)[0],
                                      on_rows=on_rows)
            blob = await asyncio.to_thread(pack_tensors, run.payload)
            await asyncio.gather(*rows_sent)
            await self._reply(identity, TaskDone(rid, run.prompt_token_ids,
                                                 run.output_token_ids, blob,
                                                 run.finish_reason, run.prefill_engine))
        except TaskAborted:
            pass  # the head stopped waiting when it sent the abort
        except TaskError as exc:
            await self._reply(identity, TaskFailed(rid, str(exc), exc.status))
        except ReplicaLost as exc:
            self._engine_lost(exc)
        except Exception as exc:  # keep serving other tasks
            logger.exception("stage %d replica %d: task %s failed",
                             self.stage_id, self.replica_id, rid)
            await self._reply(identity, TaskFailed(rid, f"{type(exc).__name__}: {exc}"))
        finally:
            self.tasks.pop(rid, None)
            self.aborted.discard(rid)
            self._growth.pop(rid, None)

    def close(self) -> None:
        """Report DOWN, close the endpoint, shut the engine down."""
        self.coord.close()
        self.socket.close(linger=0)
        try:
            self.engine.shutdown()
        finally:
            self.store.close()


async def _input_growth(queue: asyncio.Queue):
    """The rest of a task's growing input from its :class:`TaskGrow` frames
    (``replicas.task.StageTask.growth``).

    Raises:
        TaskError: a frame's payload is not a safetensors blob (400).
    """
    while (msg := await queue.get()) is not None:
        try:
            payload = await asyncio.to_thread(unpack_tensors, msg.payload)
        except ValueError as exc:
            raise TaskError(str(exc), status=400) from exc
        yield InputGrowth(payload, msg.ready)
        if msg.ready is None:
            return


class _RowsSender:
    """A ``replicas.task.RowsSink`` that hands each payload chunk of a running task, as a
    safetensors blob, to ``send`` (which sends it to the head as :class:`TaskRows`)."""

    wanted = 0  # every chunk goes to the head as soon as it is read

    def __init__(self, send) -> None:
        self._send = send

    def add(self, chunks: list[dict]) -> None:
        for chunk in chunks:
            self._send(pack_tensors(chunk))


def run_headless_replicas(args) -> None:
    """Entry of ``vllm serve --headless --stage-id N`` in omni mode (blocks).

    Raises:
        SystemExit: bad flags, the master cannot be reached, or a replica's
            engine died (exit status 1).
    """
    import uvloop

    from vllm_omni_plugin.config.cli import headless_plan
    from vllm_omni_plugin.coordinator import OmniMasterClient
    from vllm_omni_plugin.master.messages import MasterError, tcp_address

    plan = headless_plan(args)
    master_address = tcp_address(plan.master_host, plan.master_port)
    master = OmniMasterClient(master_address, timeout=5.0, retries=5)
    try:
        try:
            assignments = master.register(plan.stage.stage_id, plan.replica_host,
                                          plan.num_replicas)
        except MasterError as exc:
            raise SystemExit(
                f"stage {plan.stage.stage_id}: registration with the omni master at "
                f"{master_address} failed ({exc}); start the head first and check "
                "--omni-master-address/--omni-master-port and the cluster token") from exc
        info = master.cluster_info
        try:
            uvloop.run(_serve(plan, assignments, info))
        finally:
            master.deregister(plan.stage.stage_id, [a.replica_id for a in assignments])
    finally:
        master.close()


async def _serve(plan, assignments, info: dict) -> None:
    from vllm_omni_plugin.payload_store import default_run_dir, remove_stale_run_dirs

    from .cluster import INFO_COORDINATOR, INFO_HEARTBEAT_TIMEOUT
    from .engines import start_stage_engine

    timeout = float(info.get(INFO_HEARTBEAT_TIMEOUT, "30.0"))
    run_dir = default_run_dir()
    remove_stale_run_dirs(os.path.dirname(run_dir))
    servers: list[ReplicaServer] = []
    # the head's heartbeat timeout (a prefill engine's KV hold time derives from it)
    cluster = plan.settings.cluster.model_copy(update={"heartbeat_timeout": timeout})
    if plan.stage.is_prefill:
        from vllm_omni_plugin.kv_transfer import advertise_host

        advertise_host(plan.replica_host, plan.stage.stage_id)

    def start(assignment):
        payload_dir = os.path.join(run_dir, f"r{assignment.replica_id}")
        settings = plan.settings.model_copy(update={"payload_dir": payload_dir,
                                                    "cluster": cluster})
        engine = start_stage_engine(plan.stage, plan.base_args, settings,
                                    bootstrap_port=assignment.ports.get(KV_BOOTSTRAP_ENDPOINT)
                                    ).engine
        return assignment, engine, payload_dir

    # Each task endpoint is bound before its engine starts (a minute or more): the master
    # handed out ports it found free, which another process on this host could take
    # meanwhile (a second head allocates from the same range).
    sockets: dict[int, zmq.asyncio.Socket] = {}
    for a in assignments:
        try:
            sockets[a.replica_id] = task_socket(a.endpoint(TASK_ENDPOINT))
            logger.info("stage %d replica %d: task endpoint %s bound", a.stage_id,
                        a.replica_id, a.endpoint(TASK_ENDPOINT))
        except zmq.ZMQError as exc:
            for sock in sockets.values():
                sock.close(linger=0)
            raise SystemExit(
                f"stage {a.stage_id} replica {a.replica_id}: cannot bind its task endpoint "
                f"{a.endpoint(TASK_ENDPOINT)} that the omni master assigned ({exc})") from exc
    started = await asyncio.gather(*(asyncio.to_thread(start, a) for a in assignments),
                                   return_exceptions=True)
    errors = [s for s in started if isinstance(s, BaseException)]
    for s in started:
        if not isinstance(s, BaseException):
            a, engine, payload_dir = s
            if errors:
                engine.shutdown()
                continue
            servers.append(ReplicaServer(
                a.stage_id, a.replica_id, engine, payload_dir, a.endpoint(TASK_ENDPOINT),
                info[INFO_COORDINATOR], heartbeat_interval=max(0.1, timeout / 6.0),
                stall_timeout=stall_timeout_of(plan.stage, plan.settings),
                socket=sockets.pop(a.replica_id)))
    if errors:
        for sock in sockets.values():
            sock.close(linger=0)
        raise SystemExit(str(errors[0]))
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    serving = [asyncio.ensure_future(s.serve()) for s in servers]
    stopper = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait([*serving, stopper], return_when=asyncio.FIRST_COMPLETED)
        for fut in done:
            if fut is not stopper and fut.exception() is not None:
                raise SystemExit(f"stage {plan.stage.stage_id}: {fut.exception()}")
        logger.info("stage %d: shutting down %d replica(s)", plan.stage.stage_id, len(servers))
    finally:
        for fut in [*serving, stopper]:
            fut.cancel()
        for server in servers:
            server.close()

"""The head's handle on a headless replica (``RemoteReplica``) over a real ZMQ task
channel; the headless side is a bare ROUTER socket scripted by the test, or a real
``ReplicaServer`` on a scripted engine that publishes into a real payload store (real
engines are in ``plugin_tests/e2e/test_replicas_serve.py``)."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from plugin_tests.unit.test_run_on_engine import STEPS, FrameEngine
from vllm_omni_plugin.payload_store import PayloadStore
from vllm_omni_plugin.replicas.protocol import Channel, TaskAbort, TaskSubmit, ToReplica
from vllm_omni_plugin.replicas.replica import RemoteReplica
from vllm_omni_plugin.replicas.server import ReplicaServer
from vllm_omni_plugin.replicas.task import StageTask

WAIT_S = 10


async def _received(router, channel: Channel):
    frames = await asyncio.wait_for(router.recv_multipart(), WAIT_S)
    return channel.decode(frames[1:])  # drop the DEALER's identity


def test_cancelled_task_is_aborted_on_the_replica():
    """A caller that goes away (a client disconnecting mid-request cancels the
    orchestrator's await) stops the task on the headless replica too."""
    async def main():
        router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        replica = RemoteReplica(1, 0, f"tcp://127.0.0.1:{port}", cluster_token="")
        channel = Channel(ToReplica, "")
        try:
            run = asyncio.ensure_future(replica.run(StageTask(
                request_id="r-1", prompt_token_ids=[1, 2], sampling={"max_tokens": 2})))
            submit = await _received(router, channel)
            assert isinstance(submit, TaskSubmit) and not submit.rows  # no one reads rows
            run.cancel()
            abort = await _received(router, channel)
            assert isinstance(abort, TaskAbort) and abort.request_id == "r-1"
            assert run.cancelled() and replica.running == set()
        finally:
            replica.close()
            router.close(linger=0)

    asyncio.run(main())


class _Engine(FrameEngine):
    def shutdown(self) -> None:
        pass


class _Sink:
    """Records the rows delivered and whether the run had ended at each delivery."""

    wanted = 0

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.run: asyncio.Future | None = None
        self.after_end = False

    def add(self, chunks):
        self.after_end |= self.run.done()
        self.rows.extend(int(r) for c in chunks for r in c["codes"][:, 0])


def test_rows_published_while_a_task_runs_reach_the_head_before_its_result(tmp_path):
    """A headless replica sends a task's rows as its engine publishes them (TaskRows),
    in order and before TaskDone, when the head reads them (a streamed stage's input):
    with rows only in TaskDone, streaming from a headless talker would start at its
    end."""
    async def main():
        store = PayloadStore(str(tmp_path / "run"))
        server = ReplicaServer(1, 0, _Engine(store), str(tmp_path / "run"),
                               "tcp://127.0.0.1:*", "tcp://127.0.0.1:9", 0)
        address = server.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        serving = asyncio.ensure_future(server.serve())
        replica = RemoteReplica(1, 0, address)
        sink = _Sink()
        try:
            task = StageTask(request_id="r-1", prompt_token_ids=[1],
                             sampling={"max_tokens": STEPS})
            run = asyncio.ensure_future(replica.run(task, on_rows=sink))
            sink.run = run
            result = await asyncio.wait_for(run, WAIT_S)
            assert sink.rows == list(range(STEPS - 1)) and not sink.after_end
            assert result.payload["codes"][:, 0].tolist() == sink.rows
            assert store.keys() == []
        finally:
            serving.cancel()
            replica.close()
            server.close()

    asyncio.run(main())

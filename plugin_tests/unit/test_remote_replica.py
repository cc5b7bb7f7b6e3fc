"""The head's handle on a headless replica (``RemoteReplica``) over a real ZMQ task
channel; the headless side is a bare ROUTER socket scripted by the test (a real
``ReplicaServer`` with engines is in ``plugin_tests/e2e/test_replicas_serve.py``)."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from vllm_omni_plugin.replicas.protocol import Channel, TaskAbort, TaskSubmit, ToReplica
from vllm_omni_plugin.replicas.replica import RemoteReplica
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
            assert isinstance(await _received(router, channel), TaskSubmit)
            run.cancel()
            abort = await _received(router, channel)
            assert isinstance(abort, TaskAbort) and abort.request_id == "r-1"
            assert run.cancelled() and replica.running == set()
        finally:
            replica.close()
            router.close(linger=0)

    asyncio.run(main())

"""The head's handle on a headless replica (``RemoteReplica``) over a real ZMQ task
channel; the headless side is a bare ROUTER socket scripted by the test, or a real
``ReplicaServer`` on a scripted engine that publishes into a real payload store (real
engines are in ``plugin_tests/e2e/test_replicas_serve.py``)."""

from __future__ import annotations

import asyncio

import pytest
import torch
import zmq
import zmq.asyncio

from plugin_tests.unit.test_run_on_engine import STEPS, FrameEngine, SessionEngine, growing_task
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


class _ServedReplica:
    """A real ``ReplicaServer`` on ``engine`` (its store under ``tmp_path``) and the
    head's ``RemoteReplica`` connected to it over a real task channel."""

    def __init__(self, tmp_path, engine_class) -> None:
        self.store = PayloadStore(str(tmp_path / "run"))
        self.engine = engine_class(self.store)
        self.engine.shutdown = lambda: None
        self.server = ReplicaServer(1, 0, self.engine, str(tmp_path / "run"),
                                    "tcp://127.0.0.1:*", "tcp://127.0.0.1:9", 0)
        self._serving = asyncio.ensure_future(self.server.serve())
        address = self.server.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.replica = RemoteReplica(1, 0, address)

    def close(self) -> None:
        self._serving.cancel()
        self.replica.close()
        self.server.close()


def test_rows_published_while_a_task_runs_reach_the_head_before_its_result(tmp_path):
    """A headless replica sends a task's rows as its engine publishes them (TaskRows),
    in order and before TaskDone, when the head reads them (a streamed stage's input):
    with rows only in TaskDone, streaming from a headless talker would start at its
    end."""
    async def main():
        served = _ServedReplica(tmp_path, FrameEngine)
        sink = _Sink()
        try:
            task = StageTask(request_id="r-1", prompt_token_ids=[1],
                             sampling={"max_tokens": STEPS})
            run = asyncio.ensure_future(served.replica.run(task, on_rows=sink))
            sink.run = run
            result = await asyncio.wait_for(run, WAIT_S)
            assert sink.rows == list(range(STEPS - 1)) and not sink.after_end
            assert result.payload["codes"][:, 0].tolist() == sink.rows
            assert served.store.keys() == []
        finally:
            served.close()

    asyncio.run(main())


class _PromptRecordingEngine(FrameEngine):
    """:class:`FrameEngine` that keeps the prompts it was given."""

    def __init__(self, store: PayloadStore) -> None:
        super().__init__(store)
        self.prompts: list[dict] = []

    def generate(self, prompt, params, request_id):
        self.prompts.append(dict(prompt))
        return super().generate(prompt, params, request_id)


@pytest.mark.parametrize("salt", ["tenant-a", None])
def test_the_cache_salt_reaches_the_headless_replicas_engine(tmp_path, salt):
    """A task's ``cache_salt`` (the client's, on a PD prefill stage's task) travels in
    TaskSubmit and is the engine prompt's, whose prefix cache it partitions; a task
    without one gives a prompt without one."""
    async def main():
        served = _ServedReplica(tmp_path, _PromptRecordingEngine)
        try:
            task = StageTask(request_id="r-1", prompt_token_ids=[5, 6],
                             sampling={"max_tokens": STEPS}, cache_salt=salt)
            await asyncio.wait_for(served.replica.run(task), WAIT_S)
            [prompt] = served.engine.prompts
            assert prompt["prompt_token_ids"] == [5, 6]
            assert prompt.get("cache_salt") == salt and ("cache_salt" in prompt) == bool(salt)
        finally:
            served.close()

    asyncio.run(main())


def test_a_growing_input_feeds_one_request_on_a_headless_replica(tmp_path):
    """A task whose input grows (a talker fed while the thinker runs) runs on a headless
    replica as one resumable request fed chunk by chunk (TaskGrow frames), as on a local
    one (``test_run_on_engine``): not after the whole input."""
    async def main():
        served = _ServedReplica(tmp_path, SessionEngine)
        try:
            run = await asyncio.wait_for(served.replica.run(growing_task([3, None])), WAIT_S)
            assert served.engine.chunks == [
                ([1, 2], 1, [0]), ([100], 2, [0, 10]), ([102], 3, [0, 10, 11])]
            assert run.output_token_ids == list(range(100, 106))
            assert served.store.keys() == [] and served.server._growth == {}
        finally:
            served.close()

    asyncio.run(main())


class _AbortableSessionEngine(SessionEngine):
    def __init__(self, store) -> None:
        super().__init__(store)
        self.aborted: list[str] = []

    async def abort(self, request_id):
        self.aborted.append(request_id)


def test_a_growing_input_that_fails_fails_the_task_and_stops_it_on_the_replica(tmp_path):
    """The input processor failing on the entry stage's newer output (the growth raises)
    fails the task with that error, and the replica's engine is told to abort it."""
    from vllm_omni_plugin.replicas.task import InputGrowth

    class ProcessorBroke(Exception):
        pass

    async def growth():
        yield InputGrowth({"rows": torch.tensor([[10]])}, 3)
        raise ProcessorBroke("stage 1 (talker): input processor 'x': broke")

    async def main():
        served = _ServedReplica(tmp_path, _AbortableSessionEngine)
        try:
            task = StageTask(request_id="r-3", prompt_token_ids=[1, 2],
                             sampling={"max_tokens": 6}, payload={"rows": torch.tensor([[0]])},
                             ready=1, growth=growth())
            with pytest.raises(ProcessorBroke, match="input processor"):
                await asyncio.wait_for(served.replica.run(task), WAIT_S)
            # told once or twice: on the TaskAbort frame, and again if the task's next
            # output comes before that abort ends it (vLLM ignores the second)
            assert await _eventually(lambda: served.engine.aborted), "engine never aborted"
            assert set(served.engine.aborted) == {"r-3"}
            assert await _eventually(lambda: served.server.tasks == {})
            assert served.server._growth == {}
        finally:
            served.close()

    asyncio.run(main())


class _StallingFrameEngine(FrameEngine):
    """Publishes its first row, then waits until it is aborted."""

    def __init__(self, store) -> None:
        super().__init__(store)
        self.aborted: list[str] = []
        self._abort = asyncio.Event()

    async def generate(self, prompt, params, request_id):
        steps = 0
        async for out in super().generate(prompt, params, request_id):
            yield out
            steps += 1
            if steps == 2:
                await self._abort.wait()

    async def abort(self, request_id):
        self.aborted.append(request_id)
        self._abort.set()


def test_corrupt_rows_fail_the_task_and_stop_it_on_the_replica(tmp_path, monkeypatch):
    """Rows that do not decode on the head (a TaskRows blob that is not safetensors: the
    server's packing is replaced, a fault a real replica cannot be made to produce) fail
    the task naming the replica, and the replica's engine is told to abort it."""
    from vllm_omni_plugin.replicas import server as server_module
    from vllm_omni_plugin.replicas.task import TaskError

    monkeypatch.setattr(server_module, "pack_tensors", lambda payload: b"not safetensors")

    async def main():
        served = _ServedReplica(tmp_path, _StallingFrameEngine)
        try:
            task = StageTask(request_id="r-4", prompt_token_ids=[1],
                             sampling={"max_tokens": STEPS})
            with pytest.raises(TaskError, match="rows of r-4"):
                await asyncio.wait_for(served.replica.run(task, on_rows=_Sink()), WAIT_S)
            assert await _eventually(lambda: served.engine.aborted), "engine never aborted"
            assert set(served.engine.aborted) == {"r-4"}
            assert await _eventually(lambda: served.server.tasks == {})
        finally:
            served.close()

    asyncio.run(main())


async def _eventually(predicate, timeout: float = WAIT_S) -> bool:
    """Whether ``predicate()`` holds within ``timeout`` seconds (polled on the loop)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True

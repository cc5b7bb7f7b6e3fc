"""Wire types between the head and a remote stage replica (the task channel).

The head opens one ZMQ DEALER per remote replica; the replica binds one ROUTER
on the port the master assigned it (endpoint ``"task"``). Messages are tagged
``msgspec`` structs in msgpack, carry the control plane's ``protocol_version``,
are decoded with a size bound, and are HMAC-signed when a cluster token is set
(same scheme as the coordinator, :mod:`vllm_omni_plugin.wire.auth`).
Never pickle.

Head -> replica: :class:`TaskSubmit`, :class:`TaskGrow` (more of the input of a task
submitted with ``ready``: a stage fed while the entry stage runs), :class:`TaskAbort`.
Replica -> head: :class:`TaskProgress` (the replica's engine produced output
for the task: from then on the task cannot be resubmitted elsewhere),
:class:`TaskRows` (rows the engine published while the task runs, for a task
submitted with ``rows``: a streamed stage reads them), :class:`TaskDone`,
:class:`TaskFailed`.

Tensors travel as one safetensors blob (``payload``), so a replica on another
host needs no shared file system.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from vllm_omni_plugin.coordinator.messages import PROTOCOL_VERSION
from vllm_omni_plugin.wire import auth, envelope
from vllm_omni_plugin.wire.codec import BoundedDecoder, encode

#: Names of the endpoints the master assigns each remote replica a port for: its task
#: channel, and the bootstrap server of a prefill stage's engine (vLLM's Mooncake
#: connector; other stages leave that port unused).
TASK_ENDPOINT = "task"
KV_BOOTSTRAP_ENDPOINT = "kv_bootstrap"

#: Largest accepted task-channel frame, in bytes. Input payloads (e.g. the
#: thinker's hidden states for the talker) are the bulk: a 4096-token prompt of
#: 2048-dim fp32 rows in two layers is 64 MiB.
MAX_TASK_FRAME_BYTES = 512 * 1024 * 1024

_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
_Tokens = Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=2**31)]],
                    msgspec.Meta(max_length=1 << 22)]


class TaskSubmit(msgspec.Struct, tag="task_submit", tag_field="type"):
    """Run one request on the replica's stage engine.

    Attributes:
        request_id: The stage sub-request id (unique per head).
        prompt_token_ids: Stage prompt.
        sampling: ``vllm.SamplingParams`` keyword arguments (JSON-like values).
        payload: Input tensors as a safetensors blob (``b""``: none).
        publish: Whether the engine publishes output tensors.
        rows: Send the output rows the engine publishes while the task runs
            (:class:`TaskRows`), before :class:`TaskDone`.
        ready: For an input that is not complete yet, the output tokens it lets the
            stage generate in all; the rest comes as :class:`TaskGrow`. None: the
            payload is the whole input.
        cache_salt: vLLM's ``cache_salt`` of the prompt (None: none).
    """

    request_id: _Id
    prompt_token_ids: _Tokens
    sampling: dict[str, Any]
    payload: bytes = b""
    publish: bool = True
    rows: bool = False
    ready: Annotated[int, msgspec.Meta(ge=0)] | None = None
    cache_salt: Annotated[str, msgspec.Meta(max_length=4096)] | None = None
    protocol_version: int = PROTOCOL_VERSION


class TaskGrow(msgspec.Struct, tag="task_grow", tag_field="type"):
    """More of the input of a task submitted with ``ready``, in order: rows appended to its
    input payload (a safetensors blob), after which the stage may have generated
    ``ready`` output tokens in all (None: the input is complete; the last one)."""

    request_id: _Id
    payload: bytes = b""
    ready: Annotated[int, msgspec.Meta(ge=0)] | None = None
    protocol_version: int = PROTOCOL_VERSION


class TaskAbort(msgspec.Struct, tag="task_abort", tag_field="type"):
    """Stop the task ``request_id`` on the replica (ignored when it does not run there); no
    reply follows."""
    request_id: _Id
    protocol_version: int = PROTOCOL_VERSION


class TaskProgress(msgspec.Struct, tag="task_progress", tag_field="type"):
    """The engine produced ``num_tokens`` output tokens so far."""

    request_id: _Id
    num_tokens: int
    protocol_version: int = PROTOCOL_VERSION


class TaskRows(msgspec.Struct, tag="task_rows", tag_field="type"):
    """The output rows the engine published for the task since the previous
    :class:`TaskRows`, in order (a safetensors blob of ``{name: [rows, ...]}``); all of
    them together begin the payload :class:`TaskDone` carries."""

    request_id: _Id
    payload: bytes
    protocol_version: int = PROTOCOL_VERSION


class TaskDone(msgspec.Struct, tag="task_done", tag_field="type"):
    """``finish_reason`` and ``prefill_engine``: see ``replicas.task.StageRun``."""

    request_id: _Id
    prompt_token_ids: _Tokens
    output_token_ids: _Tokens
    payload: bytes = b""
    finish_reason: str | None = None
    prefill_engine: dict[str, str] | None = None
    protocol_version: int = PROTOCOL_VERSION


class TaskFailed(msgspec.Struct, tag="task_failed", tag_field="type"):
    """``status``: HTTP status for the API layer (400 bad input, 500 otherwise)."""

    request_id: _Id
    error: str
    status: int = 500
    protocol_version: int = PROTOCOL_VERSION


class ToReplica(msgspec.Struct, tag="to_replica", tag_field="type"):
    """The envelope of every head -> replica frame: one :class:`TaskSubmit`,
    :class:`TaskGrow` or :class:`TaskAbort`."""
    msg: TaskSubmit | TaskGrow | TaskAbort
    protocol_version: int = PROTOCOL_VERSION


class ToHead(msgspec.Struct, tag="to_head", tag_field="type"):
    """The envelope of every replica -> head frame: one :class:`TaskProgress`,
    :class:`TaskRows`, :class:`TaskDone` or :class:`TaskFailed`."""
    msg: TaskProgress | TaskRows | TaskDone | TaskFailed
    protocol_version: int = PROTOCOL_VERSION


def pack_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    """Tensors -> safetensors blob (``b""`` for an empty dict). Any shape, any dtype
    safetensors stores (bool, uint8, int64, float32, bfloat16, ...), on any device (copied
    to the CPU)."""
    if not tensors:
        return b""
    return st_save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})


def unpack_tensors(blob: bytes) -> dict[str, torch.Tensor]:
    """Inverse of :func:`pack_tensors`: CPU tensors in the shapes and dtypes packed.

    Raises:
        ValueError: a corrupt blob.
    """
    if not blob:
        return {}
    try:
        return dict(st_load(bytes(blob)))
    except Exception as exc:
        raise ValueError(f"corrupt tensor payload: {exc}") from exc


class Channel:
    """Frame encoding for one side of the task channel.

    Args:
        incoming: :class:`ToReplica` (replica side) or :class:`ToHead` (head side).
        cluster_token: ``None`` reads ``VLLM_OMNI_PLUGIN_CLUSTER_TOKEN``; ``""`` disables.
    """

    def __init__(self, incoming: type[ToReplica] | type[ToHead],
                 cluster_token: str | None = None) -> None:
        self._key = auth.resolve_key(cluster_token)
        self._decoder = BoundedDecoder(incoming, MAX_TASK_FRAME_BYTES)

    def frames(self, msg: msgspec.Struct) -> list[bytes]:
        """The frames that carry ``msg`` (plus its signature when signing)."""
        return envelope.seal(self._key, encode(msg))

    def decode(self, frames: list[bytes]):
        """Decode a message's frames.

        Raises:
            FrameRejected: bad envelope, oversize, bad signature, malformed,
                wrong version or type, or invalid fields.
        """
        return envelope.unseal(self._key, frames, self._decoder).msg

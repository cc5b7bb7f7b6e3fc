"""Inter-stage payload store: tensors that cross stages, keyed by request.

A stage's worker publishes per-request tensors (e.g. the thinker's hidden
states, the talker's codec codes) under an *output key*; the orchestrator
reads them, runs the stage input processor and publishes the next stage's
inputs under that stage's *input key*, which its worker reads when the request
is scheduled. Keys travel to the workers in
``SamplingParams.extra_args[extra_args.PAYLOAD]``, an upstream vLLM field, so no
vLLM class is patched or rebound (see docs/design/tensors-across-stages.md).

Storage: one directory per key under a run directory shared by the processes
of one host (``/dev/shm`` when present). Each :meth:`PayloadStore.append`
writes one safetensors chunk atomically (write + rename); :meth:`get`
concatenates the chunks in order along dim 0. safetensors never unpickles.
A producer publishing a chunk of many keys at once (a stage engine's step)
writes one file for all of them and links it into each key's directory
(:meth:`PayloadStore.append_many`): every key's rows of a tensor name (of one dtype
and trailing shape) are joined into one tensor, and the file's metadata says which
rows are whose. A file per key and step cost
about 0.1 ms each, and a tensor per key and name about 15 us each, which a decode
step of many requests adds up.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import uuid
from collections import OrderedDict

import torch
from safetensors.torch import load, save_file

from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)

_KEY_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_ERROR_FILE = "error.json"


#: name prefix of a key's directory while it is being deleted (not a key)
_DELETED = ".deleted."
#: name prefix of a file of several keys' chunks while it is being linked (not a key)
_STAGING = ".staging."
#: keys whose next chunk number a producer remembers (the others list their directory)
_SEQ_CACHE = 4096
#: metadata entry of a file of several keys' chunks: JSON ``{key: {name: [tensor in the
#: file, begin, end]}}``
_ROWS_META = "vllm_omni_plugin.rows"


class PayloadError(RuntimeError):
    """The producing worker recorded a failure for this key instead of tensors."""


def _read_chunk(path: str, key: str) -> dict[str, torch.Tensor]:
    """``key``'s tensors in the chunk file ``path``: all of them, or, in a file of
    several keys' chunks (:meth:`PayloadStore.append_many`), its rows of each.

    The file is read whole and parsed by ``safetensors.torch.load``: reading a file
    with metadata through ``safe_open`` (``load_file`` too) kept 80-170 bytes a read for
    good (safetensors 0.8; seen here, like its issue #369), which a server reading some
    30 chunks a request accumulates. The rows' owners are in the header's
    ``__metadata__`` (the safetensors format: a little-endian u64 header size, then the
    JSON header)."""
    with open(path, "rb") as f:
        data = f.read()
    tensors = load(data)
    size = int.from_bytes(data[:8], "little")
    rows = (json.loads(data[8:8 + size]).get("__metadata__") or {}).get(_ROWS_META)
    if rows is None:
        return tensors
    return {name: tensors[stored][begin:end].clone()
            for name, (stored, begin, end) in json.loads(rows).get(key, {}).items()}


class GrowingPayload:
    """A payload whose tensors grow along dim 0 as its chunks arrive (joined as
    :meth:`PayloadStore.get` joins them), at a cost per chunk of its own rows: each
    tensor lives in a buffer with room to grow (its capacity doubles when full), and
    :meth:`tensors` gives views of the rows so far, which later chunks leave as they are.
    Concatenating the whole payload again for every chunk cost O(rows) per chunk,
    O(rows²) per request.

    Raises:
        ValueError: from :meth:`extend`, a chunk's tensor whose dtype or trailing shape
            differs from the earlier chunks' (names the tensor).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._rows: dict[str, int] = {}

    def extend(self, chunks: list[dict[str, torch.Tensor]]) -> None:
        """Append each chunk's tensors, in order: ``{name: [rows, ...]}``, any dtype and at
        least one dim; a name's chunks share their dtype and trailing shape.

        Raises:
            ValueError: a tensor whose dtype or trailing shape differs from the earlier
                chunks' of its name.
        """
        for chunk in chunks:
            for name, tensor in chunk.items():
                self._append(name, tensor)

    def _append(self, name: str, tensor: torch.Tensor) -> None:
        buffer, rows = self._buffers.get(name), self._rows.get(name, 0)
        end = rows + tensor.shape[0]
        if buffer is not None and (buffer.dtype != tensor.dtype
                                   or buffer.shape[1:] != tensor.shape[1:]):
            raise ValueError(f"payload tensor {name!r}: a chunk of {tensor.dtype} "
                             f"{tuple(tensor.shape)} after rows of {buffer.dtype} "
                             f"{tuple(buffer.shape[1:])}")
        if buffer is None or end > buffer.shape[0]:
            grown = tensor.new_empty((max(2 * end, 16), *tensor.shape[1:]))
            if rows:
                grown[:rows] = buffer[:rows]
            self._buffers[name] = buffer = grown
        buffer[rows:end] = tensor
        self._rows[name] = end

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor's rows so far (views): ``[rows so far, ...]``, in its chunks' dtype."""
        return {name: buffer[:self._rows[name]] for name, buffer in self._buffers.items()}


_RUN_DIR_PREFIX = "vllm-omni-plugin-"
_RUN_DIR_RE = re.compile(rf"^{_RUN_DIR_PREFIX}(\d+)-[0-9a-f]{{8}}$")


def _run_dir_base() -> str:
    from vllm_omni_plugin import envs

    return envs.payload_dir() or (
        "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())


def default_run_dir() -> str:
    """Path of a fresh per-run directory under ``VLLM_OMNI_PLUGIN_PAYLOAD_DIR``,
    else ``/dev/shm``, else the temp dir, named after this process
    (``vllm-omni-plugin-<pid>-<8 hex>``). Not created here: :class:`PayloadStore`
    creates it when a stage first uses it, so parsing arguments leaves nothing behind."""
    return os.path.join(_run_dir_base(),
                        f"{_RUN_DIR_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def check_room(directory: str, need: int, what: str) -> int:
    """Bytes free where ``directory`` lives; ``need`` of them must be.

    Raises:
        OSError: (``ENOSPC``) fewer than ``need`` bytes are free; the message names the
            directory, ``what`` needs the room, and the fixes: room in ``/dev/shm``
            (Docker gives 64 MB: ``--shm-size``, or ``--ipc=host``), another directory
            (``VLLM_OMNI_PLUGIN_PAYLOAD_DIR``), or a shorter ``--max-model-len``.
    """
    import errno

    from vllm_omni_plugin import envs

    free = shutil.disk_usage(directory).free
    if free < need:
        mib = 1 << 20
        raise OSError(errno.ENOSPC, (
            f"payload store {directory}: {free / mib:.0f} MiB free, but {what} takes about "
            f"{need / mib:.0f} MiB there. Give it room: in a container, a larger /dev/shm "
            "(docker run --shm-size=16g, or --ipc=host; Docker's default is 64 MB), or set "
            f"{envs.PAYLOAD_DIR} to a directory with room; or lower --max-model-len"))
    return free


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_run_dirs(base: str | None = None) -> list[str]:
    """Remove run directories (see :func:`default_run_dir`) under ``base``
    (default: where this process would create its own) whose owner process no
    longer exists, e.g. after a ``kill -9``. A directory whose pid is alive,
    even if reused by another program, is kept.

    Returns:
        The paths removed.
    """
    base = base or _run_dir_base()
    try:
        names = os.listdir(base)
    except OSError:
        return []
    removed = []
    for name in names:
        match = _RUN_DIR_RE.match(name)
        if match and not _process_exists(int(match.group(1))):
            path = os.path.join(base, name)
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.exists(path):
                removed.append(path)
    if removed:
        logger.info("removed %d payload directories of processes that no longer exist",
                    len(removed))
    return removed


def is_payload_key(key: object) -> bool:
    """True for a valid key: a string of 1-200 characters from ``[A-Za-z0-9._-]``."""
    return isinstance(key, str) and _KEY_RE.match(key) is not None


def safe_key(text: str) -> str:
    """Map an arbitrary request id to a valid payload key."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:200]


class PayloadStore:
    """Chunked tensor store in a directory shared by the stage processes.

    Args:
        root: run directory (created if missing).

    Raises:
        ValueError: for a key that is not ``[A-Za-z0-9._-]{1,200}``.
    """

    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)
        #: key -> number of its next chunk, for the keys this producer appended to lately
        self._next: OrderedDict[str, int] = OrderedDict()

    def _dir(self, key: str) -> str:
        if not is_payload_key(key):
            raise ValueError(f"invalid payload key {key!r}")
        return os.path.join(self.root, key)

    def create(self, key: str) -> None:
        """Open ``key`` for producers. The consumer creates and deletes keys;
        producers only write into keys that exist, so a late write for a
        request whose consumer has gone (aborted, failed) is dropped."""
        path = self._dir(key)
        try:
            os.mkdir(path)  # one system call: every request creates a key
        except FileExistsError:
            pass
        except FileNotFoundError:  # the store's folder was removed meanwhile
            os.makedirs(path, exist_ok=True)

    def append(self, key: str, tensors: dict[str, torch.Tensor]) -> bool:
        """Publish one more chunk of ``key`` (tensors concatenated on dim 0 by get).

        Args:
            key: the payload key.
            tensors: ``{name: [rows, ...]}`` of any dtype safetensors stores (bool, uint8,
                int64, float32, bfloat16, ...), on any device (copied to the CPU).

        Returns:
            False (nothing written) when ``key`` was never created or is deleted.
        """
        d = self._dir(key)
        if not os.path.isdir(d):
            self._next.pop(key, None)
            return False
        seq = self._seq(key, d)
        tmp = os.path.join(d, f".{seq:08d}.{uuid.uuid4().hex}.tmp")
        try:
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp)
            os.rename(tmp, os.path.join(d, f"{seq:08d}.st"))
        except Exception:
            self._next.pop(key, None)
            if os.path.isdir(d):
                raise
            return False  # deleted meanwhile by the consumer
        self._advance(key, seq)
        return True

    def append_many(self, chunks: dict[str, dict[str, torch.Tensor]]) -> set[str]:
        """Publish one more chunk of each key of ``chunks`` (as :meth:`append` does for
        one), all in one file linked into each key's directory.

        Args:
            chunks: ``{key: {name: [rows, ...]}}``, any dtype and device (as for
                :meth:`append`).

        Returns:
            The keys written (not those never created or deleted).
        """
        live = {key: self._dir(key) for key in chunks}
        live = {key: d for key, d in live.items() if os.path.isdir(d)}
        if len(live) <= 1:
            return {key for key in live if self.append(key, chunks[key])}
        # one file tensor per name, dtype and trailing shape (e.g. images of different
        # sizes are several), holding the rows of every key that has such a tensor
        stored: dict[tuple, str] = {}
        parts: dict[str, list[torch.Tensor]] = {}
        ends: dict[str, int] = {}  # file tensor -> its rows so far
        rows: dict[str, dict[str, list]] = {}  # key -> name -> [file tensor, begin, end]
        for key in live:
            for name, tensor in chunks[key].items():
                kind = (name, tensor.dtype, tuple(tensor.shape[1:]))
                if kind not in stored:
                    stored[kind] = name if name not in parts else f"{name}.{len(stored)}"
                target = stored[kind]
                begin = ends.get(target, 0)
                ends[target] = begin + tensor.shape[0]
                parts.setdefault(target, []).append(tensor.detach().cpu())
                rows.setdefault(key, {})[name] = [target, begin, ends[target]]
        joined = {name: torch.cat(ts).contiguous() for name, ts in parts.items()}
        staging = os.path.join(self.root, f"{_STAGING}{uuid.uuid4().hex}")
        save_file(joined, staging, metadata={_ROWS_META: json.dumps(rows)})
        written = set()
        try:
            for key, d in live.items():
                seq = self._seq(key, d)
                try:
                    os.link(staging, os.path.join(d, f"{seq:08d}.st"))
                except FileNotFoundError:  # deleted meanwhile by the consumer
                    self._next.pop(key, None)
                    continue
                self._advance(key, seq)
                written.add(key)
        finally:
            os.unlink(staging)
        return written

    def _seq(self, key: str, d: str) -> int:
        """The number of ``key``'s next chunk (``d``: its directory)."""
        seq = self._next.get(key)
        return len([n for n in os.listdir(d) if n.endswith(".st")]) if seq is None else seq

    def _advance(self, key: str, seq: int) -> None:
        self._next[key] = seq + 1
        self._next.move_to_end(key)
        if len(self._next) > _SEQ_CACHE:
            self._next.popitem(last=False)

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        """Create ``key`` holding a single chunk (replacing any previous content):
        ``tensors`` as for :meth:`append` (any shape and dtype, rows on dim 0)."""
        self.delete(key)
        self.create(key)
        self.append(key, tensors)

    def chunks(self, key: str, first: int = 0) -> list[dict[str, torch.Tensor]]:
        """The chunks of ``key`` appended so far, from the ``first``-th (0-based, in
        append order) on; ``[]`` for a key that does not exist. A consumer may read while
        the producer still appends: each chunk appears whole, in order. Each chunk is
        ``{name: tensor}`` on the CPU, in the shape and dtype it was appended with."""
        d = self._dir(key)
        try:
            names = sorted(n for n in os.listdir(d) if n.endswith(".st"))
        except FileNotFoundError:
            return []
        return [_read_chunk(os.path.join(d, n), key) for n in names[first:]]

    def keys(self) -> list[str]:
        """The keys that exist now (created and not yet deleted)."""
        try:
            return sorted(n for n in os.listdir(self.root)
                          if not n.startswith((_DELETED, _STAGING)))
        except FileNotFoundError:
            return []

    def error(self, key: str) -> str | None:
        """The failure recorded for ``key`` by :meth:`put_error`, else None."""
        try:
            with open(os.path.join(self._dir(key), _ERROR_FILE)) as f:
                return str(json.load(f).get("error", "unknown error"))
        except FileNotFoundError:
            return None

    def put_error(self, key: str, message: str) -> None:
        """Record that producing ``key`` failed; :meth:`get` then raises
        :class:`PayloadError`. Dropped when ``key`` does not exist (see :meth:`create`)."""
        d = self._dir(key)
        if not os.path.isdir(d):
            return
        tmp = os.path.join(d, f".error.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "w") as f:
                json.dump({"error": message[:4000]}, f)
            os.rename(tmp, os.path.join(d, _ERROR_FILE))
        except FileNotFoundError:
            pass

    def get(self, key: str) -> dict[str, torch.Tensor]:
        """All chunks of ``key``, each tensor concatenated along dim 0: ``{name: [rows of all
        chunks, ...]}`` on the CPU, in the dtype it was appended with.

        Raises:
            PayloadError: the producer recorded a failure (see :meth:`put_error`).
        """
        error = self.error(key)
        if error is not None:
            raise PayloadError(error)
        merged: dict[str, list[torch.Tensor]] = {}
        for chunk in self.chunks(key):
            for name, t in chunk.items():
                merged.setdefault(name, []).append(t)
        return {k: torch.cat(v, dim=0) for k, v in merged.items()}

    def delete(self, key: str) -> None:
        """Remove ``key``, also while a producer still appends to it: the key's directory
        is first renamed away, so a chunk being written lands in the renamed directory
        (and is removed with it) or fails (and is dropped). A key nothing was written to
        (a text request's error slot, mostly) goes in one system call."""
        self._next.pop(key, None)
        try:
            os.rmdir(self._dir(key))  # empty: no producer is writing into it
            return
        except FileNotFoundError:
            return
        except OSError:
            pass  # not empty: renamed away first, as below
        gone = os.path.join(self.root, f"{_DELETED}{uuid.uuid4().hex}")
        try:
            os.rename(self._dir(key), gone)
        except FileNotFoundError:
            return
        shutil.rmtree(gone, ignore_errors=True)

    def close(self) -> None:
        """Remove the whole run directory."""
        shutil.rmtree(self.root, ignore_errors=True)

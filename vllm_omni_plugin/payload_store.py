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
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import uuid

import torch
from safetensors.torch import load_file, save_file

from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)

_KEY_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_ERROR_FILE = "error.json"


#: name prefix of a key's directory while it is being deleted (not a key)
_DELETED = ".deleted."


class PayloadError(RuntimeError):
    """The producing worker recorded a failure for this key instead of tensors."""


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

    def _dir(self, key: str) -> str:
        if not is_payload_key(key):
            raise ValueError(f"invalid payload key {key!r}")
        return os.path.join(self.root, key)

    def create(self, key: str) -> None:
        """Open ``key`` for producers. The consumer creates and deletes keys;
        producers only write into keys that exist, so a late write for a
        request whose consumer has gone (aborted, failed) is dropped."""
        os.makedirs(self._dir(key), exist_ok=True)

    def append(self, key: str, tensors: dict[str, torch.Tensor]) -> bool:
        """Publish one more chunk of ``key`` (tensors concatenated on dim 0 by get).

        Returns:
            False (nothing written) when ``key`` was never created or is deleted.
        """
        d = self._dir(key)
        if not os.path.isdir(d):
            return False
        seq = len([n for n in os.listdir(d) if n.endswith(".st")])
        tmp = os.path.join(d, f".{seq:08d}.{uuid.uuid4().hex}.tmp")
        try:
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp)
            os.rename(tmp, os.path.join(d, f"{seq:08d}.st"))
        except Exception:
            if os.path.isdir(d):
                raise
            return False  # deleted meanwhile by the consumer
        return True

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        """Create ``key`` holding a single chunk (replacing any previous content)."""
        self.delete(key)
        self.create(key)
        self.append(key, tensors)

    def chunks(self, key: str, first: int = 0) -> list[dict[str, torch.Tensor]]:
        """The chunks of ``key`` appended so far, from the ``first``-th (0-based, in
        append order) on; ``[]`` for a key that does not exist. A consumer may read while
        the producer still appends: each chunk appears whole, in order."""
        d = self._dir(key)
        try:
            names = sorted(n for n in os.listdir(d) if n.endswith(".st"))
        except FileNotFoundError:
            return []
        return [load_file(os.path.join(d, n)) for n in names[first:]]

    def keys(self) -> list[str]:
        """The keys that exist now (created and not yet deleted)."""
        try:
            return sorted(n for n in os.listdir(self.root) if not n.startswith(_DELETED))
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
        """All chunks of ``key``, each tensor concatenated along dim 0.

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
        (and is removed with it) or fails (and is dropped)."""
        gone = os.path.join(self.root, f"{_DELETED}{uuid.uuid4().hex}")
        try:
            os.rename(self._dir(key), gone)
        except FileNotFoundError:
            return
        shutil.rmtree(gone, ignore_errors=True)

    def close(self) -> None:
        """Remove the whole run directory."""
        shutil.rmtree(self.root, ignore_errors=True)

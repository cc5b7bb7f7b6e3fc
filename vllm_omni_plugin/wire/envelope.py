"""The envelope every control-plane message travels in: the payload, then, under a
cluster token, its HMAC-SHA256 signature (:mod:`.auth`) as a second ZMQ part. One
writer and one reader for the coordinator, the omni master and the task channel."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from vllm_omni_plugin.wire import auth
from vllm_omni_plugin.wire.codec import BoundedDecoder, FrameRejected, RejectReason

T = TypeVar("T")


def seal(key: bytes | None, payload: bytes) -> list[bytes]:
    """The parts that carry ``payload``: ``[payload]``, or ``[payload, signature]``
    when ``key`` is set."""
    return [payload] if key is None else [payload, auth.sign(key, payload)]


def verified(key: bytes | None, parts: Sequence) -> bool:
    """True when ``parts`` (``[payload]`` or ``[payload, signature]``, bytes or buffers)
    need no signature (``key`` None) or carry the right one."""
    return key is None or auth.verify(key, parts[0], parts[1] if len(parts) == 2 else None)


def unseal(key: bytes | None, parts: Sequence, decoder: BoundedDecoder[T]) -> T:
    """The message ``parts`` carry (a ROUTER's identity part already removed).

    Raises:
        FrameRejected: not one or two parts (``bad_envelope``), a payload over the
            decoder's bound (``oversize``), a missing or wrong signature under ``key``
            (``bad_token``), or what ``decoder`` rejects.
    """
    if len(parts) not in (1, 2):
        raise FrameRejected(RejectReason.BAD_ENVELOPE, f"{len(parts)} message parts")
    decoder.check_size(parts[0])
    if not verified(key, parts):
        raise FrameRejected(RejectReason.BAD_TOKEN, "missing or wrong signature")
    return decoder.decode(parts[0])

"""Bounded encode/decode of control-plane frames, with a reason for every reject.

Decoding a frame goes, cheapest check first:

1. size: ``len(frame) > max_bytes`` → ``oversize`` (nothing is parsed);
2. signature (when a cluster token is set; done by the socket owner, see
   :mod:`.auth`) → ``bad_token``;
3. header: the frame must be a msgpack map with ``"type"`` (str) and
   ``"protocol_version"`` (int) → else ``malformed``;
4. ``protocol_version == PROTOCOL_VERSION`` → else ``bad_version``;
5. ``type`` is one this socket accepts → else ``unknown_type``;
6. full typed decode with field constraints → else ``invalid``.

:meth:`BoundedDecoder.try_decode` is the fast path for the common case, a
valid frame: the size check, then *one* typed decode into a variant of the
message type in which the ``type`` key and ``protocol_version`` are required
(so a frame without them still fails, as step 3 demands), then the version
check. It returns ``None`` on any failure, and the caller then runs
:meth:`BoundedDecoder.decode` to learn the reject reason, so reasons and
counters are the same either way. A frame the fast path accepts passes steps
1 and 3-6 with the same field values.

Nothing here uses pickle; a malformed frame raises :class:`FrameRejected`,
never anything else.
"""

from __future__ import annotations

import logging
import threading
import time
from enum import Enum
from typing import Generic, Literal, TypeVar

import msgspec

from . import PROTOCOL_VERSION

T = TypeVar("T", bound=msgspec.Struct)


class RejectReason(str, Enum):
    """Why a received frame was dropped (the ``rejected.<value>`` stats keys)."""

    #: Wrong number of ZMQ message parts.
    BAD_ENVELOPE = "bad_envelope"
    #: Larger than the socket's maximum frame size.
    OVERSIZE = "oversize"
    #: Missing or wrong HMAC signature while a cluster token is configured.
    BAD_TOKEN = "bad_token"
    #: Not msgpack, or not a map with ``type`` and ``protocol_version``.
    MALFORMED = "malformed"
    #: ``protocol_version`` differs from :data:`PROTOCOL_VERSION`.
    BAD_VERSION = "bad_version"
    #: ``type`` is not a message this socket accepts.
    UNKNOWN_TYPE = "unknown_type"
    #: Known type but a field is missing, mistyped or out of range.
    INVALID = "invalid"


class FrameRejected(Exception):
    """A frame failed a check; ``reason`` says which, ``detail`` is for logs."""

    def __init__(self, reason: RejectReason, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail


class _Header(msgspec.Struct):
    """The two keys every frame must have; other keys are ignored here."""

    type: str
    protocol_version: int


_HEADER_DECODER = msgspec.msgpack.Decoder(_Header)


class BoundedDecoder(Generic[T]):
    """Decode frames of one tagged message type with a size bound.

    Args:
        msg_type: The tagged ``msgspec.Struct`` this socket accepts.
        max_bytes: Largest accepted frame, in bytes.
    """

    def __init__(self, msg_type: type[T], max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self._tag = msg_type.__struct_config__.tag
        if not isinstance(self._tag, str):
            raise TypeError(f"{msg_type.__name__} must be a tagged msgspec.Struct")
        self._decoder = msgspec.msgpack.Decoder(msg_type)
        self._fast_decoder = msgspec.msgpack.Decoder(_wire_variant(msg_type))

    def check_size(self, frame: bytes | memoryview) -> None:
        """Raise :class:`FrameRejected` (``oversize``) if ``frame`` is too large."""
        if len(frame) > self.max_bytes:
            raise FrameRejected(
                RejectReason.OVERSIZE, f"{len(frame)} bytes > limit {self.max_bytes}"
            )

    def try_decode(self, frame: bytes | memoryview) -> T | None:
        """Decode a valid current-version frame with one parse; ``None`` otherwise.

        The returned message is an instance of a private subclass of the
        message type with the same fields plus the tag field (see
        :func:`_wire_variant`): attribute access and ``isinstance`` behave as
        for :meth:`decode`'s result, but msgspec's ``==`` compares types, so it
        is not equal to the message :meth:`decode` returns. ``None`` says
        nothing about why: call :meth:`decode` for the reject reason. Never
        raises.
        """
        if len(frame) > self.max_bytes:
            return None
        try:
            msg = self._fast_decoder.decode(frame)
        except Exception:  # anything: the careful path classifies it
            return None
        if msg.protocol_version != PROTOCOL_VERSION:
            return None
        return msg

    def decode(self, frame: bytes | memoryview) -> T:
        """Decode one frame.

        Raises:
            FrameRejected: with the first failed check's reason (see module doc).
        """
        self.check_size(frame)
        try:
            header = _HEADER_DECODER.decode(frame)
        except Exception as e:  # DecodeError/ValidationError, but also e.g.
            # UnicodeDecodeError on invalid UTF-8 in a str: untrusted bytes may
            # raise anything, and anything means "rejected".
            raise FrameRejected(RejectReason.MALFORMED, repr(e)) from None
        if header.protocol_version != PROTOCOL_VERSION:
            raise FrameRejected(
                RejectReason.BAD_VERSION,
                f"protocol_version {header.protocol_version} != {PROTOCOL_VERSION}",
            )
        if header.type != self._tag:
            raise FrameRejected(RejectReason.UNKNOWN_TYPE, f"type {header.type[:64]!r}")
        try:
            return self._decoder.decode(frame)
        except Exception as e:  # see above
            raise FrameRejected(RejectReason.INVALID, repr(e)) from None


def _wire_variant(msg_type: type[T]) -> type[T]:
    """A subclass of ``msg_type`` that decodes only what the careful path accepts.

    Decoding ``msg_type`` itself is more lenient than the header check: msgspec
    treats the tag of a tagged struct decoded on its own as optional, and
    ``protocol_version`` has a default. The variant is untagged and instead
    has two required fields: the tag field as ``Literal[tag]`` and
    ``protocol_version``; every other field keeps its type and constraints.
    """
    config = msg_type.__struct_config__
    tag, tag_field = config.tag, config.tag_field
    if not isinstance(tag, str) or not tag_field:
        raise TypeError(f"{msg_type.__name__} must be a tagged msgspec.Struct")
    fields = {f.name: f for f in msgspec.structs.fields(msg_type)}
    if "protocol_version" not in fields:
        raise TypeError(f"{msg_type.__name__} has no protocol_version field")
    return msgspec.defstruct(
        f"_Wire{msg_type.__name__}",
        [(tag_field, Literal[tag]), ("protocol_version", fields["protocol_version"].type)],
        bases=(msg_type,),
        tag=False,
        kw_only=True,
        module=__name__,
    )


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack-encode a wire message."""
    return msgspec.msgpack.encode(msg)


#: Default minimum seconds between two log lines about the same reject reason.
REJECT_LOG_INTERVAL_S = 30.0


class RejectLog:
    """Rate-limited warnings about dropped frames, one clock per reject reason.

    The first reject of a reason is logged, further ones of that reason are
    only counted (by the caller) until ``interval`` seconds have passed, so a
    flood of hostile frames cannot flood the log. Thread-safe.

    Args:
        logger: Where to log.
        what: Who dropped the frames, e.g. ``"OmniCoordinator dropped a frame"``.
        interval: Seconds between two lines for the same reason.
    """

    def __init__(self, logger: logging.Logger, what: str,
                 interval: float = REJECT_LOG_INTERVAL_S) -> None:
        self._logger, self._what, self._interval = logger, what, interval
        self._last: dict[RejectReason, float] = {}
        self._lock = threading.Lock()

    def note(self, rej: FrameRejected) -> None:
        """Log ``rej`` unless its reason was logged within the interval."""
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(rej.reason, float("-inf")) < self._interval:
                return
            self._last[rej.reason] = now
        self._logger.warning("%s (%s); further ones for %.0fs only counted", self._what, rej,
                             self._interval)


def reject_stat_keys() -> dict[str, int]:
    """Zeroed ``rejected.<reason>`` counters, one per :class:`RejectReason`."""
    return {f"rejected.{r.value}": 0 for r in RejectReason}

"""``GET /v1/realtime`` (WebSocket): the route's entry. It accepts a connection, refuses
one over ``--omni-realtime-max-sessions`` (an ``error`` event, then close code 1013),
meters each with vLLM's WebSocket metrics (:mod:`.metrics`) and runs its session
(:class:`.connection.RealtimeConnection`) to its end.

The omni middleware routes the path here after vLLM's own checks (the API key) passed.
"""

from __future__ import annotations

from vllm_omni_plugin.compat.internals import websocket_metrics_middleware
from vllm_omni_plugin.config.settings import OmniSettings, RealtimeSettings
from vllm_omni_plugin.entrypoints.asgi import vllm_config
from vllm_omni_plugin.entrypoints.media_input import MediaLimits
from vllm_omni_plugin.entrypoints.realtime.connection import RealtimeConnection
from vllm_omni_plugin.entrypoints.realtime.protocol import (
    CLOSE_TRY_AGAIN_LATER,
    RealtimeError,
    encode,
    error_event,
)
from vllm_omni_plugin.entrypoints.realtime.serving import RealtimeChat
from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.processors import Voices

logger = init_logger(__name__)

REALTIME_PATH = "/v1/realtime"


class RealtimeEndpoint:
    """``/v1/realtime`` of one API server: counts its open sessions, and meters each
    connection with vLLM's WebSocket metrics."""

    def __init__(self) -> None:
        self.open = 0
        self._metered = websocket_metrics_middleware()

    async def serve(self, scope, receive, send, voices: Voices | None,
                    media_limits: MediaLimits) -> None:
        """Run one WebSocket connection's session to its end. ``voices`` and
        ``media_limits``: the served model's, as the middleware read them."""

        async def connection(scope, receive, send) -> None:
            await self._connection(scope, receive, send, voices, media_limits)

        if self._metered is None:
            return await connection(scope, receive, send)
        await self._metered(connection)(scope, receive, send)

    async def _connection(self, scope, receive, send, voices: Voices | None,
                          media_limits: MediaLimits) -> None:
        from starlette.websockets import WebSocket

        settings = OmniSettings.from_vllm_config(vllm_config(scope))
        limits = settings.realtime if settings is not None else RealtimeSettings()
        ws = WebSocket(scope, receive, send)
        await ws.accept()
        if self.open >= limits.max_sessions:
            logger.warning("realtime session refused: %d sessions are open "
                           "(--omni-realtime-max-sessions)", self.open)
            await ws.send_text(encode(error_event(RealtimeError(
                None, f"the server has {self.open} realtime sessions open, its limit "
                "(--omni-realtime-max-sessions); try again later",
                code="session_limit_reached"))))
            await ws.close(CLOSE_TRY_AGAIN_LATER)
            return
        self.open += 1
        try:
            chat = RealtimeChat(scope.get("app"), media_limits)
            await RealtimeConnection(ws, chat, limits, voices).run()
        finally:
            self.open -= 1

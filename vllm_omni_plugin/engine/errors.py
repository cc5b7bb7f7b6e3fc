"""The error a stage raises for one request, and how a failed request is answered."""

from __future__ import annotations

from vllm_omni_plugin.engine.omni_request import OmniRequest, StageResult
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)


class StageError(RuntimeError):
    """A stage failed for one request. ``stage_id``/``stage_name`` name it;
    ``status`` is the HTTP status the API layer answers with (400 when the
    request itself was at fault, e.g. an unknown voice, 503 when the stage has
    no replica, else 500); ``retry_after`` seconds go with a 503."""

    def __init__(self, stage_id: int, stage_name: str, message: str, status: int = 500,
                 retry_after: float | None = None):
        super().__init__(f"stage {stage_id} ({stage_name}): {message}")
        self.detail = message
        self.stage_id = stage_id
        self.stage_name = stage_name
        self.status = status
        self.retry_after = retry_after


def record_failure(request: OmniRequest, request_id: str, exc: StageError) -> None:
    """Log a failed request and hand its error to the API layer."""
    logger.error("request %s failed: %s", request_id, exc)
    request.result = StageResult.failure(str(exc), exc.status, exc.retry_after)

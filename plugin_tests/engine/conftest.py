"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest

from plugin_tests.engine.pipeline_reference import AUDIO_SECONDS, IMAGE_SIZE, HFReference


@pytest.fixture(scope="module")
def hf_reference(tiny_qwen3_omni, tmp_path_factory) -> HFReference:
    """HF's reference for every run here (they serve the script's same prompts), and
    the media the default run serves: ``OUT_DIR/media`` of that run (an image and an
    audio clip)."""
    from plugin_tests import media

    folder = tmp_path_factory.mktemp("pipeline") / "media"
    folder.mkdir()
    (folder / "image.png").write_bytes(media.png_bytes(*IMAGE_SIZE))
    (folder / "audio.wav").write_bytes(media.wav_bytes(AUDIO_SECONDS))
    return HFReference(tiny_qwen3_omni, folder)

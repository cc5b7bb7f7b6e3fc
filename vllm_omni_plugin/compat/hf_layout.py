"""Checkpoint key layout of HF's Qwen3-Omni thinker module.

Why: transformers 5.21 moved ``Qwen3OmniMoeThinkerForConditionalGeneration``'s
``audio_tower``, ``visual`` and text ``model`` under ``.model``
(``Qwen3OmniMoeThinkerModel`` with ``audio_tower``/``visual``/``language_model``).
Checkpoints keep the old names; HF's own loader renames them
(transformers/conversion_mapping.py, ``Qwen2_5OmniThinkerForConditionalGeneration``),
but the stage models read safetensors directly. vLLM 0.30 does not cap
transformers (``transformers>=5.10.4``), so it resolves the new layout; vLLM
0.31 (<5.18) and 0.32 (<5.20) keep the old one.
Remove when: the lowest supported transformers is >= 5.21 (then rename always),
or when checkpoints are loaded through HF's conversion mapping.
"""

from __future__ import annotations

import re

_NEW_NAMES = (
    (re.compile(r"^audio_tower\."), "model.audio_tower."),
    (re.compile(r"^visual\."), "model.visual."),
    (re.compile(r"^model\.(?!language_model\.|visual\.|audio_tower\.)"), "model.language_model."),
)


def thinker_state_dict(state: dict, thinker) -> dict:
    """``state`` (checkpoint names, ``thinker.`` prefix removed) renamed to the
    layout of ``thinker``; unchanged for the pre-5.21 layout."""
    if not hasattr(getattr(thinker, "model", None), "language_model"):
        return state
    renamed = {}
    for key, value in state.items():
        for pattern, target in _NEW_NAMES:
            if pattern.match(key):
                key = pattern.sub(target, key, count=1)
                break
        renamed[key] = value
    return renamed

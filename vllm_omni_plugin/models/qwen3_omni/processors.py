"""Qwen3-Omni's stage input processors (registered as the plugin's built-ins).

Processors run in the API server process and never touch model weights: they
select and arrange upstream tensors; the consuming stage's model does the
projections on its own weights. ``request_extras`` carries the request's
``extra_args`` plus ``hf_config`` (the served checkpoint's HF config).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni_plugin import extra_args as xargs
from vllm_omni_plugin.models.qwen3_omni.talker_inputs import (
    ASSISTANT_PREFIX_LEN,
    ASSISTANT_ROWS,
    resolve_speaker,
    voices,
)
from vllm_omni_plugin.processors.hookspecs import StageInput, UpstreamOutput, hookimpl


def user_positions(config, prompt_ids: list[int]) -> list[int]:
    """Prompt positions whose chat turn (the token after the previous
    ``<|im_start|>``) is ``user``, as HF ``generate`` selects them."""
    positions, role = [], None
    for i, tok in enumerate(prompt_ids):
        if tok == config.im_start_token_id:
            role = prompt_ids[i + 1] if i + 1 < len(prompt_ids) else None
        if role == config.user_token_id and role is not None:
            positions.append(i)
    return positions


def thinker2talker(upstream: list[UpstreamOutput], stage, extras: dict[str, Any]) -> StageInput:
    """Thinker hidden states -> talker request.

    Payload out: ``sequence_ids`` ``[T_seq]`` int64 (prompt + generated),
    ``thinker_embed``/``thinker_hidden`` ``[T_seq - 1, H]``,
    ``thinker_positions`` ``[P, 3]`` int64 (the prompt's M-RoPE positions),
    ``tts_embed`` ``[3, H]``, ``speaker_id``/``prompt_len`` ``[1]`` int64. The
    prompt is ``len(user positions) + 9`` placeholder ids (``codec_pad_id``).

    A finished reply too short to speak (one token: ``max_tokens`` 1, or an end of turn
    right away; see :data:`.talker_inputs.ASSISTANT_ROWS`) leaves the talker nothing to
    do: its output is 0 frames (``codes`` ``[0, num_code_groups]`` int64).

    Raises:
        ValueError: missing thinker payload, no assistant turn, unknown voice.
    """
    (thinker,) = upstream
    config = extras["hf_config"]
    for name in ("embed", "hidden", "positions", "tts_embed"):
        if name not in thinker.payload:
            raise ValueError(f"thinker payload lacks {name!r}; was the thinker asked to publish?")
    prompt = thinker.prompt_token_ids
    starts = [i for i, (a, b) in enumerate(zip(prompt, prompt[1:], strict=False))
              if a == config.im_start_token_id and b == config.assistant_token_id]
    if not starts:
        raise ValueError("the prompt has no '<|im_start|>assistant' turn to speak")
    talker_config = config.talker_config
    speaker = resolve_speaker(talker_config, extras.get(xargs.SPEAKER))
    generated, ready = thinker.output_token_ids, None
    fed_rows = len(prompt) + len(generated) - 1 - starts[-1]  # rows of the assistant turn
    if thinker.finished and fed_rows < ASSISTANT_ROWS:
        return StageInput.nothing_to_do(
            {"codes": torch.zeros((0, talker_config.num_code_groups), dtype=torch.long)},
            f"the thinker's reply of {len(generated)} token(s) is too short to speak")
    if not thinker.finished:
        # HF's talker prompt ends with the row of generated token 0, and feeding frame s
        # adds the row of generated token s + 1. With n generated tokens fed (rows of the
        # thinker), frames 0 .. n - 2 can be fed: code 0 of frames 0 .. n - 1 sampled.
        # The engine may have published rows of tokens the head has not seen yet.
        fed = min(thinker.payload["embed"].shape[0] - len(prompt), len(generated) - 1)
        generated, ready = generated[:fed + 1], max(fed, 0)
    sequence = prompt + generated
    length = len(user_positions(config, prompt)) + ASSISTANT_PREFIX_LEN
    return StageInput(
        prompt_token_ids=[talker_config.codec_pad_id] * length,
        payload={
            "sequence_ids": torch.tensor(sequence, dtype=torch.long),
            "thinker_embed": thinker.payload["embed"],
            "thinker_hidden": thinker.payload["hidden"],
            "thinker_positions": thinker.payload["positions"][:len(prompt)],
            "tts_embed": thinker.payload["tts_embed"],
            "speaker_id": torch.tensor([speaker], dtype=torch.long),
            "prompt_len": torch.tensor([len(prompt)], dtype=torch.long),
        },
        sampling_overrides={"stop_token_ids": [talker_config.codec_eos_token_id]},
        ready=ready,
    )


def talker2code2wav(upstream: list[UpstreamOutput], stage, extras: dict[str, Any]) -> StageInput:
    """Talker codes -> code2wav request.

    The prompt carries the codes (:func:`.code2wav.code2wav_prompt_ids`: ``16 T`` ids,
    frame-major, codebook ``q`` offset by ``q * codebook_size``). For one chunk of a
    streamed request the input payload says how many leading frames are left context
    (``left_context`` ``[1]`` int64) and where the chunk sits in its stream (``stream``
    ``[3]`` int64, :data:`.code2wav.STREAM_INPUT`); otherwise code2wav takes no input
    payload. When the talker produced no frames (its first code 0 was ``codec_eos``, or
    it had nothing to speak), code2wav has nothing to do: its output is 0 samples
    (``waveform`` ``[0]`` float32, ``sample_rate`` ``[1]`` int64 Hz).

    Raises:
        ValueError: a chunk of a stream without frames, or codes code2wav cannot decode.
    """
    from vllm_omni_plugin.models.qwen3_omni.code2wav import (
        LEFT_CONTEXT_INPUT,
        STREAM_INPUT,
        code2wav_prompt_ids,
        sample_rate,
        stream_key,
    )

    (talker,) = upstream
    codes = talker.payload.get("codes")
    frames = 0 if codes is None else codes.shape[0] - talker.context_rows
    if frames <= 0 and talker.chunk is None:
        return StageInput.nothing_to_do(
            {"waveform": torch.zeros(0, dtype=torch.float32),
             "sample_rate": torch.tensor([sample_rate(extras["hf_config"])])},
            "the talker produced no codec frames")
    if frames <= 0:
        raise ValueError("a chunk of the talker's stream holds no codec frames")
    payload = {}
    if talker.context_rows:
        payload[LEFT_CONTEXT_INPUT] = torch.tensor([talker.context_rows], dtype=torch.long)
    if talker.chunk is not None:
        chunk = talker.chunk
        payload[STREAM_INPUT] = torch.tensor(
            [stream_key(chunk.stream_id), chunk.first_row, int(chunk.last)], dtype=torch.long)
    return StageInput(prompt_token_ids=code2wav_prompt_ids(codes, extras["hf_config"]),
                      payload=payload)


@hookimpl
def omni_register_stage_input_processors():
    """Qwen3-Omni's stage input processors: ``thinker2talker`` (:func:`thinker2talker`)
    and ``talker2code2wav`` (:func:`talker2code2wav`)."""
    return {"thinker2talker": thinker2talker, "talker2code2wav": talker2code2wav}


@hookimpl
def omni_list_voices(hf_config):
    """The talker's voices (:func:`.talker_inputs.voices` of ``talker_config``), or None
    for a checkpoint without one."""
    return voices(getattr(hf_config, "talker_config", None))

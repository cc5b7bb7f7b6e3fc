"""Qwen3-Omni's stage input processors (registered as the plugin's built-ins).

Processors run in the API server process and never touch model weights: they
select and arrange upstream tensors; the consuming stage's model does the
projections on its own weights. The ``StageRequest`` gives the served checkpoint's HF
config and the voice asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_omni_plugin.models.qwen3_omni.talker_inputs import (
    ASSISTANT_PREFIX_LEN,
    ASSISTANT_ROWS,
    resolve_speaker,
    voices,
)
from vllm_omni_plugin.payload_store import GrowingPayload
from vllm_omni_plugin.processors.hookspecs import (
    StageInput,
    StageRequest,
    UpstreamOutput,
    hookimpl,
)


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


@dataclass
class _TalkerFeed:
    """What :func:`thinker2talker` derives from a thinker output's prompt, kept in the
    output's ``state`` while the output grows, so that a call on more of it costs the
    generated tokens, not the prompt (walking a long user turn in Python on every
    thinker token cost O(prompt) per token).

    Attributes:
        prompt_len: the thinker prompt's tokens (``P``).
        assistant_start: position of the prompt's last ``<|im_start|>assistant`` pair.
        talker_prompt: the talker prompt's placeholder ids (``codec_pad_id``, one per user
            position and per row of the assistant prefix; the same list at every call).
        sequence: ``sequence_ids`` (``[P + generated so far]`` int64) in a buffer that
            doubles when full; ``ids`` of them written.
    """

    prompt_len: int
    assistant_start: int
    talker_prompt: list[int]
    sequence: GrowingPayload = field(default_factory=GrowingPayload)
    ids: int = 0

    @classmethod
    def of(cls, config, prompt: list[int]) -> _TalkerFeed:
        """The feed of a thinker prompt (its ids).

        Raises:
            ValueError: the prompt has no ``<|im_start|>assistant`` turn.
        """
        starts = [i for i, (a, b) in enumerate(zip(prompt, prompt[1:], strict=False))
                  if a == config.im_start_token_id and b == config.assistant_token_id]
        if not starts:
            raise ValueError("the prompt has no '<|im_start|>assistant' turn to speak")
        length = len(user_positions(config, prompt)) + ASSISTANT_PREFIX_LEN
        feed = cls(prompt_len=len(prompt), assistant_start=starts[-1],
                   talker_prompt=[config.talker_config.codec_pad_id] * length)
        feed._append(prompt)
        return feed

    def _append(self, ids: list[int]) -> None:
        self.sequence.extend([{"ids": torch.tensor(ids, dtype=torch.long)}])
        self.ids += len(ids)

    def sequence_ids(self, generated: list[int], count: int) -> torch.Tensor:
        """``[P + count]`` int64: the prompt and ``generated[:count]`` (a view; the rows
        of views handed out before stay as they were)."""
        if self.prompt_len + count > self.ids:
            self._append(generated[self.ids - self.prompt_len:count])
        return self.sequence.tensors()["ids"][:self.prompt_len + count]


#: ``UpstreamOutput.state`` key of :func:`thinker2talker`'s :class:`_TalkerFeed`.
_FEED = "thinker2talker"


def thinker2talker(upstream: list[UpstreamOutput], stage, request: StageRequest) -> StageInput:
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
    config = request.hf_config
    for name in ("embed", "hidden", "positions", "tts_embed"):
        if name not in thinker.payload:
            raise ValueError(f"thinker payload lacks {name!r}; was the thinker asked to publish?")
    prompt = thinker.prompt_token_ids
    feed = thinker.state.get(_FEED)
    if feed is None or feed.prompt_len != len(prompt):
        feed = _TalkerFeed.of(config, prompt)
        if not thinker.finished:  # more calls on this output follow
            thinker.state[_FEED] = feed
    talker_config = config.talker_config
    speaker = resolve_speaker(talker_config, request.voice)
    generated, ready = thinker.output_token_ids, None
    count = len(generated)  # generated tokens in sequence_ids
    fed_rows = len(prompt) + count - 1 - feed.assistant_start  # rows of the assistant turn
    if thinker.finished and fed_rows < ASSISTANT_ROWS:
        return StageInput.nothing_to_do(
            {"codes": torch.zeros((0, talker_config.num_code_groups), dtype=torch.long)},
            f"the thinker's reply of {count} token(s) is too short to speak")
    if not thinker.finished:
        # HF's talker prompt ends with the row of generated token 0, and feeding frame s
        # adds the row of generated token s + 1. With n generated tokens fed (rows of the
        # thinker), frames 0 .. n - 2 can be fed: code 0 of frames 0 .. n - 1 sampled.
        # The engine may have published rows of tokens the head has not seen yet.
        fed = min(thinker.payload["embed"].shape[0] - len(prompt), count - 1)
        # the tokens generated[:fed + 1] holds (Python's slice rules: a range slices alike)
        count, ready = len(range(count)[:fed + 1]), max(fed, 0)
    return StageInput(
        prompt_token_ids=feed.talker_prompt,
        payload={
            "sequence_ids": feed.sequence_ids(generated, count),
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


def talker2code2wav(upstream: list[UpstreamOutput], stage, request: StageRequest) -> StageInput:
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
             "sample_rate": torch.tensor([sample_rate(request.hf_config)])},
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
    return StageInput(prompt_token_ids=code2wav_prompt_ids(codes, request.hf_config),
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

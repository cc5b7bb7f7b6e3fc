"""Qwen3-Omni's processors. ``thinker2talker`` on a thinker output that is still growing
(the talker fed while the thinker runs): how many talker tokens the rows so far allow. The
talker built from such inputs equals HF's in ``engine/test_pipeline_engine.py``.
``talker2code2wav`` on one chunk of a streamed request: what code2wav is told of it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_omni_plugin.models.qwen3_omni.code2wav import stream_key
from vllm_omni_plugin.models.qwen3_omni.processors import talker2code2wav, thinker2talker
from vllm_omni_plugin.processors.hookspecs import StageRequest, StreamChunk, UpstreamOutput

IM_START, ASSISTANT, USER = 1, 2, 3
#: ``<|im_start|>user x <|im_start|>assistant \\n``: 6 prompt ids
PROMPT = [IM_START, USER, 9, IM_START, ASSISTANT, 4]
CONFIG = SimpleNamespace(
    im_start_token_id=IM_START, assistant_token_id=ASSISTANT, user_token_id=USER,
    talker_config=SimpleNamespace(codec_pad_id=0, codec_eos_token_id=5, num_code_groups=2,
                                  speaker_id={"ethan": 7}),
    code2wav_config=SimpleNamespace(num_quantizers=2, codebook_size=8,
                                    output_sample_rate=16000))
REQUEST = StageRequest(CONFIG)


def _thinker(rows: int, tokens: int, finished: bool = False) -> UpstreamOutput:
    """The thinker's output with ``rows`` published rows and ``tokens`` generated ids."""
    payload = {name: torch.zeros(rows, 2) for name in ("embed", "hidden")}
    payload.update(positions=torch.zeros(rows, 3, dtype=torch.long), tts_embed=torch.zeros(3, 2))
    return UpstreamOutput(stage_id=0, prompt_token_ids=PROMPT,
                          output_token_ids=list(range(50, 50 + tokens)), payload=payload,
                          finished=finished)


def _ready(rows: int, tokens: int) -> tuple[int | None, int]:
    stage_input = thinker2talker([_thinker(rows, tokens)], None, REQUEST)
    return stage_input.ready, len(stage_input.payload["sequence_ids"])


def test_a_growing_thinker_output_allows_one_talker_token_per_fed_generated_token():
    p = len(PROMPT)
    # the first generated token not fed yet: HF's talker prompt cannot be built
    assert _ready(rows=p, tokens=1)[0] == 0
    # n generated tokens fed: code 0 of frames 0 .. n - 1; the sequence ends with the
    # first token not fed
    assert _ready(rows=p + 1, tokens=2) == (1, p + 2)
    assert _ready(rows=p + 4, tokens=5) == (4, p + 5)


def test_rows_published_ahead_of_the_tokens_seen_count_only_as_far_as_the_tokens():
    p = len(PROMPT)
    assert _ready(rows=p + 4, tokens=3) == (2, p + 3)


def test_a_finished_thinker_output_is_the_whole_input():
    p = len(PROMPT)
    stage_input = thinker2talker([_thinker(p + 4, 5, finished=True)], None,
                                 REQUEST)
    assert stage_input.ready is None and len(stage_input.payload["sequence_ids"]) == p + 5
    # the prompt stays as it was for the growing input
    assert stage_input.prompt_token_ids == thinker2talker(
        [_thinker(p + 1, 2)], None, REQUEST).prompt_token_ids


def test_a_finished_reply_too_short_to_speak_leaves_the_talker_nothing_to_do():
    """One generated token: HF's talker prompt needs the row of generated token 0, which
    only a second token's step feeds (the talker's prompt build raised, a 500)."""
    p = len(PROMPT)
    stage_input = thinker2talker([_thinker(p, 1, finished=True)], None, REQUEST)
    assert stage_input.output is not None and "1 token(s)" in stage_input.reason
    assert stage_input.output["codes"].shape == (0, 2)
    assert stage_input.output["codes"].dtype == torch.long
    # two tokens are enough; a reply still growing waits instead
    assert thinker2talker([_thinker(p + 1, 2, finished=True)], None,
                          REQUEST).output is None
    assert thinker2talker([_thinker(p, 1)], None, REQUEST).output is None


def test_a_talker_without_frames_leaves_code2wav_nothing_to_do():
    empty = UpstreamOutput(stage_id=1, prompt_token_ids=[], output_token_ids=[],
                           payload={"codes": torch.zeros(0, 2, dtype=torch.long)})
    stage_input = talker2code2wav([empty], None, REQUEST)
    assert stage_input.output["waveform"].shape == (0,)
    assert stage_input.output["waveform"].dtype == torch.float32
    assert stage_input.output["sample_rate"].tolist() == [16000]
    # nothing published at all (code 0 of the first frame was codec_eos) is the same
    empty.payload = {}
    assert talker2code2wav([empty], None, REQUEST).output is not None


def _code2wav_input(chunk: StreamChunk | None, context: int):
    codes = torch.tensor([[1, 2], [3, 4], [5, 6]])
    talker = UpstreamOutput(stage_id=1, prompt_token_ids=[], output_token_ids=[],
                            payload={"codes": codes}, context_rows=context, chunk=chunk)
    return talker2code2wav([talker], None, REQUEST)


def test_a_chunk_tells_code2wav_its_context_and_place_in_the_stream():
    stage_input = _code2wav_input(StreamChunk("req-1-s2", first_row=7, last=True), context=1)
    assert stage_input.prompt_token_ids == [1, 8 + 2, 3, 8 + 4, 5, 8 + 6]
    assert stage_input.payload["left_context"].tolist() == [1]
    assert stage_input.payload["stream"].tolist() == [stream_key("req-1-s2"), 7, 1]
    # the key is stable and tells streams apart
    assert stream_key("req-1-s2") == stream_key("req-1-s2") != stream_key("req-2-s2")
    assert 0 <= stream_key("req-1-s2") < 2 ** 63
    # the first chunk has no context; a request not streamed has no input payload
    first = _code2wav_input(StreamChunk("req-1-s2", first_row=0, last=False), context=0)
    assert set(first.payload) == {"stream"} and first.payload["stream"].tolist()[1:] == [0, 0]
    assert _code2wav_input(None, context=0).payload == {}


class _ReadCounted(list):
    """A prompt's id list that counts the ids read from it (iteration and indexing)."""

    reads = 0

    def __iter__(self):
        for item in super().__iter__():
            self.reads += 1
            yield item

    def __getitem__(self, index):
        item = super().__getitem__(index)
        self.reads += len(item) if isinstance(index, slice) else 1
        return item


def test_each_growth_of_a_long_prompt_costs_only_the_tokens_it_added(tmp_path):
    """The API server feeds the talker while the thinker runs: its input stream
    (``engine.streaming.InputStream``, on a real payload store) and ``thinker2talker`` are
    called once per thinker token. After the first call neither reads the prompt's ids
    again (each call walked the whole prompt in Python and rebuilt its ``sequence_ids``:
    O(prompt) per token, ~12,000 ids read per call here), and each call's input equals
    the one a call without the kept state makes on the same output."""
    import asyncio
    import dataclasses

    from vllm_omni_plugin.engine.streaming import InputStream
    from vllm_omni_plugin.payload_store import PayloadStore

    prompt = _ReadCounted([IM_START, USER, *[9] * 4000, IM_START, ASSISTANT, 4])
    p = len(prompt)
    store, key = PayloadStore(str(tmp_path)), "thinker.out"
    store.create(key)

    def rows(n: int, first: float) -> dict:
        values = torch.arange(first, first + n, dtype=torch.float32)[:, None].expand(n, 2)
        return {"embed": values, "hidden": -values,
                "positions": torch.zeros(n, 3, dtype=torch.long)}

    async def feed() -> list[int]:
        stream, tokens, reads, first = InputStream(store, key, stage_id=0), [], [], None
        store.append(key, {**rows(p, 0), "tts_embed": torch.ones(3, 2)})
        for token in range(50, 58):
            tokens.append(token)
            if len(tokens) > 1:  # the step feeding a token publishes its row
                store.append(key, rows(1, p + len(tokens) - 2))
            stream.update(prompt, tokens)
            out = await stream.next()
            first = first or out
            # one prompt list and one state for the stream, not a copy per call
            assert out.prompt_token_ids is first.prompt_token_ids and out.state is first.state
            out = dataclasses.replace(out, prompt_token_ids=prompt)  # reads counted
            before = prompt.reads
            got = thinker2talker([out], None, REQUEST)
            reads.append(prompt.reads - before)
            fresh = UpstreamOutput(stage_id=0, prompt_token_ids=list(prompt),
                                   output_token_ids=list(tokens), payload=out.payload,
                                   finished=False)
            _assert_same_input(got, thinker2talker([fresh], None, REQUEST))
        stream.finish(UpstreamOutput(stage_id=0, prompt_token_ids=prompt,
                                     output_token_ids=list(tokens), payload=out.payload))
        out = await stream.next()
        assert out.finished and out.state is first.state
        before = prompt.reads
        got = thinker2talker([out], None, REQUEST)
        reads.append(prompt.reads - before)
        assert got.ready is None and len(got.payload["sequence_ids"]) == p + 8
        _assert_same_input(got, thinker2talker(
            [UpstreamOutput(stage_id=0, prompt_token_ids=list(prompt),
                            output_token_ids=list(tokens), payload=out.payload)], None, REQUEST))
        return reads

    reads = asyncio.run(feed())
    assert reads[0] > 0 and reads[1:] == [0] * 8, reads


def _assert_same_input(got, expected) -> None:
    assert got.prompt_token_ids == expected.prompt_token_ids
    assert got.ready == expected.ready
    assert got.payload.keys() == expected.payload.keys()
    for name, tensor in expected.payload.items():
        assert torch.equal(got.payload[name], tensor), name

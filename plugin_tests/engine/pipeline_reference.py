"""What the Qwen3-Omni pipeline engine tests share (test_pipeline_engine.py: the shipped
pipeline; test_pipeline_pd_engine.py: the PD pipeline with a tight talker): the engine
script's runner and pipeline YAMLs, HF's reference on the tiny checkpoint, and the parity
assertion. The :func:`hf_reference` fixture is in this folder's conftest.py."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
import yaml

from plugin_tests.conftest import PYTHON, QWEN3_OMNI_YAML
from plugin_tests.helpers import process_group, script_report

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "omni_pipeline.py")
TALKER_FRAMES = 24
#: the talker's max_tokens counts code-0 tokens like HF's talker_max_new_tokens: N -> N - 1 frames
TALKER_MAX_TOKENS = TALKER_FRAMES + 1
#: Seconds: bound on one run of the engine script (every scenario of the run)
ENGINE_TIMEOUT_S = 900


def pipeline_yaml(root, talker_max_tokens, talker_engine_args=None, source=QWEN3_OMNI_YAML) -> str:
    with open(source) as f:
        pipeline = yaml.safe_load(f)
    talker = pipeline["stages"][1]
    talker["default_sampling_params"]["max_tokens"] = talker_max_tokens
    talker["engine_args"].update(talker_engine_args or {})
    path = root / (f"pipeline-{talker_max_tokens}-{len(talker_engine_args or ())}-"
                   f"{os.path.basename(source)}")
    path.write_text(yaml.safe_dump(pipeline))
    return str(path)


def run_script(ckpt, yaml_path, out_dir, scenarios, env=None, options=()) -> tuple[dict, str]:
    """``(report, output)``: the script's report and its stdout and stderr (also in
    ``OUT_DIR/pipeline.{out,err}``), run with ``env`` (default: this process's) and the
    script's ``options`` (``--dtype``...). Fails the test with the output's tail when the
    script failed.

    HF's reference is computed after the run, not beside it: the streamed scenario's
    talker then starts after as many thinker tokens as it always did. Computed meanwhile,
    it made the talker start one token later now and then (the head's event loop
    starved of CPU), and the streamed talker then spoke one frame more than HF (seen on
    vLLM 0.30; the streamed feed's race, not this test's to hide)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **(os.environ if env is None else env)}
    out_path, err_path = out_dir / "pipeline.out", out_dir / "pipeline.err"
    with open(out_path, "w") as out, open(err_path, "w") as err, \
            process_group([PYTHON, SCRIPT, *options, ckpt, yaml_path, str(out_dir), *scenarios],
                          stdout=out, stderr=err, text=True, env=env) as proc:
        proc.wait(timeout=ENGINE_TIMEOUT_S)
    stdout, stderr = out_path.read_text(), err_path.read_text()
    return script_report(SCRIPT, proc.returncode, stdout, stderr), stdout + stderr


#: HF ``generate``'s ``talker_repetition_penalty`` default, the shipped YAML's talker
#: ``repetition_penalty``: applied to the code-0 ids the talker generated before
TALKER_REPETITION_PENALTY = 1.05
#: float32 waveforms: HF's code2wav and the stage's (vLLM's linear layers, SDPA) differ by
#: rounding only; observed max |diff| about 1e-7 on the tiny checkpoint.
WAVEFORM_ATOL = 1e-5


class HFSpeech(NamedTuple):
    """What :func:`hf_speak` returns."""

    sequences: object  #: torch.LongTensor [1, prompt + generated]: HF's thinker output
    codes: np.ndarray  #: int64 [T, 16]: the talker's codes, frame-major
    waveform: np.ndarray  #: float32 [samples] at 24 kHz
    #: ``code_logits[g][t]``: code ``g``'s logits (float32, unprocessed) at frame ``t``
    #: (code 0: the talker's codec head, one more than frames when it chose codec EOS;
    #: codes 1-15: the code predictor's heads)
    code_logits: list
    #: ``thinker_logits[i]``: the thinker's logits (float32) for its ``i``-th token
    thinker_logits: list


def hf_speak(model, eos, force: tuple | None = None, **inputs) -> HFSpeech:
    """HF ``generate`` (greedy, speaker Ethan: HF's default, which a served request without a
    voice also uses) on ``inputs`` moved to the model's device, with the logits of every
    choice it made.

    ``force=(tokens, codes)``: teacher-forced along a served answer (its thinker
    ``tokens`` and ``codes`` [T, 16]): each choice is the served one whatever HF's logits
    (recorded as computed) say, and the talker ends with codec EOS after T frames
    (below :data:`TALKER_FRAMES`); HF's code2wav then decodes the served codes."""
    import torch

    recorded = {}
    heads = [model.talker.codec_head, *model.talker.code_predictor.lm_head]
    logits: list[list] = [[] for _ in heads]
    thinker_logits: list = []
    original = model.code2wav.chunked_decode

    def record(codes, *args, **kwargs):
        recorded["codes"] = codes.clone()
        return original(codes, *args, **kwargs)

    def keep(into, choices=None):
        """A forward hook keeping a head's logits at the last position into ``into``,
        and with ``choices`` (index -> token or None) making that token the only one."""
        def hook(module, args, output):
            into.append(output[0, -1].float().cpu())
            choice = choices(len(into) - 1) if choices is not None else None
            if choice is not None:
                output = torch.full_like(output, float("-inf"))
                output[..., choice] = 0
                return output
        return hook

    choices = [None] * (len(heads) + 1)
    if force is not None:
        tokens, codes = force
        codec_eos = model.config.talker_config.codec_eos_token_id
        # a talker stopped at TALKER_FRAMES frames made one more (never fed) code-0 choice
        end = codec_eos if len(codes) < TALKER_FRAMES else None
        choices[0] = lambda t: int(codes[t, 0]) if t < len(codes) else end
        for group in range(1, len(heads)):
            choices[group] = (lambda t, g=group: int(codes[t, g]) if t < len(codes) else None)
        choices[-1] = lambda i: int(tokens[i]) if i < len(tokens) else None
    model.code2wav.chunked_decode = record
    hooks = [head.register_forward_hook(keep(logits[group], choices[group]))
             for group, head in enumerate(heads)]
    hooks.append(model.thinker.lm_head.register_forward_hook(keep(thinker_logits, choices[-1])))
    inputs = {name: value.to(model.device) if isinstance(value, torch.Tensor) else value
              for name, value in inputs.items()}
    try:
        with torch.no_grad():
            sequences, wav = model.generate(
                **inputs, speaker="Ethan", return_audio=True, thinker_max_new_tokens=12,
                thinker_do_sample=False, thinker_eos_token_id=eos,
                talker_max_new_tokens=TALKER_MAX_TOKENS, talker_do_sample=False,
                talker_repetition_penalty=TALKER_REPETITION_PENALTY)
    finally:
        for hook in hooks:
            hook.remove()
        del model.code2wav.chunked_decode  # back to the class's method
    return HFSpeech(sequences.cpu(), recorded["codes"][0].T.cpu().numpy(),
                    wav.reshape(-1).float().cpu().numpy(), logits, thinker_logits)


def hf_model(ckpt, dtype: str = "float32", device: str = "cpu"):
    """``(model, eos token id)``: HF's Qwen3-Omni from ``ckpt`` in ``dtype`` (a torch
    dtype's name) on ``device``."""
    import torch
    from transformers import GenerationConfig, Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        ckpt, dtype=getattr(torch, dtype)).to(device).eval()
    return model, GenerationConfig.from_pretrained(ckpt).eos_token_id


#: 96 x 64 pixels: a 6 x 4 patch grid, 6 tokens after the 2 x 2 merge (not square, so the
#: M-RoPE height and width rows differ)
IMAGE_SIZE = (96, 64)
AUDIO_SECONDS = 1.5


def _stored(path: str, compute):
    """``compute()``'s value, kept in the pickle file ``path``: read from it when it
    exists, else computed and written there (atomically: concurrent test workers may
    compute the same value; the last one's file stays)."""
    import pickle
    import tempfile

    if os.path.isfile(path):
        with open(path, "rb") as f:
            return pickle.load(f)
    value = compute()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, staging = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        pickle.dump(value, f)
    os.replace(staging, path)
    return value


class HFReference:
    """HF ``generate`` (greedy) on the tiny checkpoint, each part computed on first use
    from one loaded model and kept on disk next to the checkpoint
    (``<ckpt>.hf-reference/``), keyed by what it depends on: the checkpoint's files,
    torch's and transformers' versions, this module's source, and the prompt ids or
    media bytes served, and the dtype and device HF runs in (default: float32 on the CPU).
    Every engine module and CI row after the first reads it (computing it took 5-7 s a
    module on a 2-core host)."""

    def __init__(self, ckpt: str, media_dir, dtype: str = "float32", device: str = "cpu") -> None:
        self.ckpt, self.media_dir, self.dtype, self.device = ckpt, media_dir, dtype, device

    @functools.cached_property
    def _model(self):
        return hf_model(self.ckpt, self.dtype, self.device)

    @functools.cached_property
    def _basis(self):
        """SHA-256 over what every part depends on (the checkpoint's files, torch's and
        transformers' versions, this module's source), hashed once per instance."""
        import hashlib
        from importlib.metadata import version

        from plugin_tests.conftest import file_hashes

        digest = hashlib.sha256()
        for name, value in sorted(file_hashes(self.ckpt).items()):
            digest.update(f"{name}={value}".encode())
        for dist in ("torch", "transformers"):
            digest.update(f"{dist}=={version(dist)}".encode())
        digest.update(f"{self.dtype} on {self.device}".encode())
        with open(__file__, "rb") as f:
            digest.update(f.read())
        return digest

    def _store(self, part: str, inputs: bytes) -> str:
        """Where the reference ``part`` computed from ``inputs`` is kept."""
        digest = self._basis.copy()
        digest.update(inputs)
        return os.path.join(f"{self.ckpt}.hf-reference", f"{part}-{digest.hexdigest()[:16]}.pkl")

    @functools.cached_property
    def prompt_ids(self) -> list[list[int]]:
        """The script's prompts (``omni_pipeline.PROMPTS`` through the chat template)."""
        from transformers import AutoTokenizer

        from plugin_tests.engine.scripts.omni_pipeline import chat_prompt_ids

        return chat_prompt_ids(AutoTokenizer.from_pretrained(self.ckpt))

    @functools.cached_property
    def text(self) -> list[tuple]:
        """Per prompt of :attr:`prompt_ids`: (thinker tokens, codes [T, 16], waveform)."""
        import json

        def compute():
            import torch

            model, eos = self._model
            out = []
            for prompt in self.prompt_ids:
                speech = hf_speak(model, eos, input_ids=torch.tensor([prompt]))
                out.append((speech.sequences[0, len(prompt):].tolist(), speech.codes,
                            speech.waveform))
            return out

        return _stored(self._store("text", json.dumps(self.prompt_ids).encode()), compute)

    @functools.cached_property
    def media(self) -> dict:
        """:func:`hf_media_reference` on the files in :attr:`media_dir`."""
        from plugin_tests.engine.scripts.omni_pipeline import MEDIA_TEXT

        inputs = MEDIA_TEXT.encode() + b"".join(
            f.name.encode() + f.read_bytes() for f in sorted(self.media_dir.iterdir()))
        return _stored(self._store("media", inputs),
                       lambda: hf_media_reference(self.ckpt, self.media_dir, *self._model))


def hf_media_inputs(ckpt, media_dir: Path, kind: str) -> dict:
    """HF's processor on the engine script's ``kind`` (``image``/``audio``) file in
    ``media_dir`` and its ``MEDIA_TEXT``: the model's inputs (``input_ids``, pixel or
    audio features, ...), torch tensors."""
    import soundfile as sf
    from PIL import Image
    from transformers import AutoProcessor

    from plugin_tests.engine.scripts.omni_pipeline import MEDIA_TEXT

    processor = AutoProcessor.from_pretrained(ckpt)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": kind, kind: "-"},
                                      {"type": "text", "text": MEDIA_TEXT}]}],
        add_generation_prompt=True, tokenize=False)
    if kind == "image":
        media = {"images": [Image.open(media_dir / "image.png").convert("RGB")]}
    else:
        media = {"audio": [sf.read(media_dir / "audio.wav", dtype="float32")[0]]}
    return dict(processor(text=[text], return_tensors="pt", **media))


def hf_media_reference(ckpt, media_dir, model, eos):
    """HF (``model``, ``eos``: see :func:`_hf_model`) on the same files through HF's own
    processor: ``{kind: (prompt ids, thinker tokens, codes [T, 16] or None, waveform or
    None, frames before the first near-tie)}``.
    HF's talker cannot take an audio-input prompt (its ``get_rope_index`` reads an
    ``audio_config`` the talker config lacks, transformers 5.19), so audio gets the
    thinker's tokens only."""
    import torch

    out = {}
    for kind in ("image", "audio"):
        inputs = hf_media_inputs(ckpt, media_dir, kind)
        prompt = inputs["input_ids"][0].tolist()
        if kind == "image":
            speech = hf_speak(model, eos, **inputs)
            out[kind] = (prompt, speech.sequences[0, len(prompt):].tolist(), speech.codes,
                         speech.waveform, first_near_tie(speech.code_logits, speech.codes,
                                                         model))
        else:
            with torch.no_grad():
                sequences = model.thinker.generate(**inputs, max_new_tokens=12,
                                                   do_sample=False, eos_token_id=eos)
            out[kind] = (prompt, sequences[0, len(prompt):].tolist(), None, None, 0)
    return out


class NearTie(NamedTuple):
    """Top-two logit gaps (HF's) under which a greedy choice may flip between vLLM's
    kernels and HF's, for one dtype: the most by which a served choice may trail HF's
    own (:func:`agreement`)."""

    thinker: float  #: the thinker's tokens
    code0: float  #: code 0 (the talker's codec head)
    residual: float  #: codes 1-15 (the code predictor's heads)


#: Per dtype the served model runs in. float32: a code-0 flip was observed at a gap of
#: 1.6e-4; the code predictor's gaps are an order of magnitude smaller on the tiny
#: checkpoint (top-two gaps around 1e-3; a flip at 1.3e-6, none at 2.9e-4). bfloat16: a
#: logit of the tiny checkpoint (|x| < 2) is a multiple of bfloat16's step there, 2^-8
#: or 2^-7; vLLM's CPU build and HF differed by at most one step for the thinker
#: (3.9e-3) and code 0 and two for codes 1-15 (7.8e-3; AVX-512 BF16, vLLM 0.32):
#: 3e-2 leaves room for about four.
NEAR_TIES = {
    "float32": NearTie(thinker=1e-3, code0=1e-3, residual=1e-4),
    "bfloat16": NearTie(thinker=3e-2, code0=3e-2, residual=3e-2),
}


def _gap(values) -> float:
    top = values.topk(2).values
    return float(top[0] - top[1])


def first_near_tie(logits, codes, model) -> int:
    """The first frame one of whose 16 codes HF (in float32) chose by a gap under
    :data:`NEAR_TIES`'s, else the frame count; ``logits`` as :class:`HFSpeech` holds
    them."""
    from vllm_omni_plugin.models.qwen3_omni.talker_inputs import talker_logits_mask

    ties, mask = NEAR_TIES["float32"], talker_logits_mask(model.config)
    for frame in range(codes.shape[0]):
        if _gap(logits[0][frame].masked_fill(mask, float("-inf"))) < ties.code0:
            return frame
        if any(_gap(per_frame[frame]) < ties.residual for per_frame in logits[1:]):
            return frame
    return codes.shape[0]


def text_reference(report, hf_reference) -> list[tuple]:
    """HF's reference for the prompts the run served (the same as HF's)."""
    assert report["prompt_ids"] == hf_reference.prompt_ids
    return hf_reference.text


def assert_served_equal_hf(report, served, reference):
    """Every request alone and in the concurrent batch: thinker tokens and all 16
    codebooks equal HF's, waveform within WAVEFORM_ATOL; concurrent equal to solo."""
    assert report["sample_rate"] == 24000
    n = len(reference)
    for kind, count in (("solo", n), ("concurrent", len(report["thinker_tokens"]) - 2 * n)):
        for i in range(count):
            tokens, hf_codes, hf_wav = reference[i % n]
            assert report["thinker_tokens"][f"{kind}_{i}"] == tokens, (kind, i)
            codes, wav = served[f"{kind}_codes_{i}"], served[f"{kind}_waveform_{i}"]
            assert codes.shape == hf_codes.shape and hf_codes.shape[1] == 16, (kind, i)
            diff = np.argwhere(codes != hf_codes)
            assert diff.size == 0, f"{kind} {i}: first differing (frame, group) {diff[:5]}"
            assert wav.shape == hf_wav.shape, (kind, i)
            err = float(np.abs(wav - hf_wav).max())
            assert err <= WAVEFORM_ATOL, (kind, i, err)
            if kind == "solo":  # the same request without audio output: the same text
                assert report["thinker_tokens"][f"text_{i}"] == tokens, i
            if kind == "concurrent":
                np.testing.assert_array_equal(codes, served[f"solo_codes_{i % n}"])
                np.testing.assert_allclose(wav, served[f"solo_waveform_{i % n}"],
                                           rtol=0, atol=WAVEFORM_ATOL)


class Agreement(NamedTuple):
    """How a served answer compares with HF teacher-forced along it (:func:`agreement`)."""

    #: greedy choices compared: thinker tokens, code 0 (and the talker's end, where it
    #: ended before TALKER_FRAMES), codes 1-15
    choices: int
    exact: int  #: of them, those that were HF's own (its top logit)
    #: per kind of choice (``thinker``, ``code0``, ``residual``): the largest gap between
    #: HF's top logit and its logit of the served choice
    worst: dict
    waveform_err: float  #: max |served - HF's decode of the served codes|
    problem: str  #: what is out of tolerance; empty when nothing is


def _penalized(values, previous, penalty: float):
    """``values`` after HF's repetition penalty over the ids ``previous`` (HF's
    ``RepetitionPenaltyLogitsProcessor``: a logit below 0 times ``penalty``, else over)."""
    import torch

    values = values.clone()
    if len(previous):
        ids = torch.as_tensor(sorted(set(int(i) for i in previous)))
        picked = values[ids]
        values[ids] = torch.where(picked < 0, picked * penalty, picked / penalty)
    return values


def agreement(tokens, codes, waveform, forced: HFSpeech, model, dtype: str,
              waveform_atol: float, ties: NearTie | None = None) -> Agreement:
    """Compare a served answer (thinker ``tokens``, ``codes`` [T, 16], ``waveform``) with
    HF teacher-forced along it (``forced``: :func:`hf_speak` with ``force=(tokens,
    codes)``, on ``model`` in ``dtype``). Every greedy choice the pipeline made must be
    HF's, or trail HF's top logit (after HF's code-0 mask and repetition penalty) by
    less than ``ties``' gap (default :data:`NEAR_TIES`'s for ``dtype``): a near-tie that
    rounding may flip. The waveform must be HF's decode of the same codes within
    ``waveform_atol``."""
    from vllm_omni_plugin.models.qwen3_omni.talker_inputs import talker_logits_mask

    ties, mask = ties or NEAR_TIES[dtype], talker_logits_mask(model.config)
    codec_eos = model.config.talker_config.codec_eos_token_id
    gaps = {"thinker": [], "code0": [], "residual": []}
    # lengths may differ: a problem of its own below
    for values, token in zip(forced.thinker_logits, tokens, strict=False):
        gaps["thinker"].append(float(values.max() - values[token]))
    # the talker's end (codec EOS) is a choice where it stopped before TALKER_FRAMES
    ends = len(codes) < TALKER_FRAMES
    for t, values in enumerate(forced.code_logits[0][:len(codes) + ends]):
        values = _penalized(values.masked_fill(mask, float("-inf")), codes[:t, 0],
                            TALKER_REPETITION_PENALTY)
        served = int(codes[t, 0]) if t < len(codes) else codec_eos
        gaps["code0"].append(float(values.max() - values[served]))
    for group, per_frame in enumerate(forced.code_logits[1:], start=1):
        for t, values in enumerate(per_frame):
            gaps["residual"].append(float(values.max() - values[int(codes[t, group])]))
    problems = []
    if len(forced.thinker_logits) != len(tokens):
        problems.append(f"HF forced along {len(tokens)} thinker tokens made "
                        f"{len(forced.thinker_logits)} choices")
    if forced.codes.shape != codes.shape or (forced.codes != codes).any():
        problems.append(f"HF forced along codes {codes.shape} decoded {forced.codes.shape}")
    for kind, values in gaps.items():
        tolerance = getattr(ties, kind)
        if over := [(i, round(gap, 5)) for i, gap in enumerate(values) if gap > tolerance]:
            problems.append(f"{kind} choices trail HF's by more than {tolerance:g} "
                            f"(index, gap): {over[:3]}")
    err = float("inf")
    if waveform.shape == forced.waveform.shape:
        err = float(np.abs(waveform - forced.waveform).max()) if waveform.size else 0.0
    if err > waveform_atol:
        problems.append(f"waveform differs from HF's decode by {err:.2e} "
                        f"(shapes {waveform.shape}, {forced.waveform.shape})")
    every = [gap for values in gaps.values() for gap in values]
    return Agreement(len(every), sum(gap <= 0 for gap in every),
                     {kind: max(values, default=0.0) for kind, values in gaps.items()}, err,
                     "; ".join(problems))

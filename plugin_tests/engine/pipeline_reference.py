"""What the Qwen3-Omni pipeline engine tests share (test_pipeline_engine.py: the shipped
pipeline; test_pipeline_pd_engine.py: the PD pipeline with a tight talker): the engine
script's runner and pipeline YAMLs, HF's reference on the tiny checkpoint, and the parity
assertion. The :func:`hf_reference` fixture is in this folder's conftest.py."""

from __future__ import annotations

import functools
import os

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


def run_script(ckpt, yaml_path, out_dir, scenarios, env=None) -> tuple[dict, str]:
    """``(report, output)``: the script's report and its stdout and stderr (also in
    ``OUT_DIR/pipeline.{out,err}``), run with ``env`` (default: this process's). Fails
    the test with the output's tail when the script failed.

    HF's reference is computed after the run, not beside it: the streamed scenario's
    talker then starts after as many thinker tokens as it always did. Computed meanwhile,
    it made the talker start one token later now and then (the head's event loop
    starved of CPU), and the streamed talker then spoke one frame more than HF (seen on
    vLLM 0.30; the streamed feed's race, not this test's to hide)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **(os.environ if env is None else env)}
    out_path, err_path = out_dir / "pipeline.out", out_dir / "pipeline.err"
    with open(out_path, "w") as out, open(err_path, "w") as err, \
            process_group([PYTHON, SCRIPT, ckpt, yaml_path, str(out_dir), *scenarios],
                          stdout=out, stderr=err, text=True, env=env) as proc:
        proc.wait(timeout=ENGINE_TIMEOUT_S)
    stdout, stderr = out_path.read_text(), err_path.read_text()
    return script_report(SCRIPT, proc.returncode, stdout, stderr), stdout + stderr


#: float32 waveforms: HF's code2wav and the stage's (vLLM's linear layers, SDPA) differ by
#: rounding only; observed max |diff| about 1e-7 on the tiny checkpoint.
WAVEFORM_ATOL = 1e-5


def hf_speak(model, eos, **inputs):
    """HF ``generate`` (greedy, speaker Ethan: HF's default, which a served request without a
    voice also uses): ``(sequences, codes [T, 16], waveform, logits)``; ``logits[g]`` holds
    code ``g``'s logits per frame (code 0: the talker's codec head; codes 1-15: the code
    predictor's heads)."""
    import torch

    recorded = {}
    heads = [model.talker.codec_head, *model.talker.code_predictor.lm_head]
    logits: list[list] = [[] for _ in heads]
    original = model.code2wav.chunked_decode

    def record(codes, *args, **kwargs):
        recorded["codes"] = codes.clone()
        return original(codes, *args, **kwargs)

    model.code2wav.chunked_decode = record
    hooks = [head.register_forward_hook(
        lambda module, args, output, group=group: logits[group].append(output[0, -1].clone()))
        for group, head in enumerate(heads)]
    try:
        with torch.no_grad():
            sequences, wav = model.generate(
                **inputs, speaker="Ethan", return_audio=True, thinker_max_new_tokens=12,
                thinker_do_sample=False, thinker_eos_token_id=eos,
                talker_max_new_tokens=TALKER_MAX_TOKENS, talker_do_sample=False)
    finally:
        for hook in hooks:
            hook.remove()
        del model.code2wav.chunked_decode  # back to the class's method
    return sequences, recorded["codes"][0].T.numpy(), wav.reshape(-1).numpy(), logits


def hf_model(ckpt):
    """``(model, eos token id)``: HF's Qwen3-Omni in float32 from ``ckpt``."""
    import torch
    from transformers import GenerationConfig, Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        ckpt, dtype=torch.float32).eval()
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
    media bytes served. Every engine module and CI row after the first reads it
    (computing it took 5-7 s a module on a 2-core host)."""

    def __init__(self, ckpt: str, media_dir) -> None:
        self.ckpt, self.media_dir = ckpt, media_dir

    @functools.cached_property
    def _model(self):
        return hf_model(self.ckpt)

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
                sequences, codes, wav, _ = hf_speak(model, eos,
                                                    input_ids=torch.tensor([prompt]))
                out.append((sequences[0, len(prompt):].tolist(), codes, wav))
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


def hf_media_reference(ckpt, media_dir, model, eos):
    """HF (``model``, ``eos``: see :func:`_hf_model`) on the same files through HF's own
    processor: ``{kind: (prompt ids, thinker tokens, codes [T, 16] or None, waveform or
    None, frames before the first near-tie)}``.
    HF's talker cannot take an audio-input prompt (its ``get_rope_index`` reads an
    ``audio_config`` the talker config lacks, transformers 5.19), so audio gets the
    thinker's tokens only."""
    import soundfile as sf
    import torch
    from PIL import Image
    from transformers import AutoProcessor

    from plugin_tests.engine.scripts.omni_pipeline import MEDIA_TEXT

    processor = AutoProcessor.from_pretrained(ckpt)
    out = {}
    for kind in ("image", "audio"):
        text = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": kind, kind: "-"},
                                          {"type": "text", "text": MEDIA_TEXT}]}],
            add_generation_prompt=True, tokenize=False)
        if kind == "image":
            media = {"images": [Image.open(media_dir / "image.png").convert("RGB")]}
        else:
            media = {"audio": [sf.read(media_dir / "audio.wav", dtype="float32")[0]]}
        inputs = processor(text=[text], return_tensors="pt", **media)
        prompt = inputs["input_ids"][0].tolist()
        if kind == "image":
            sequences, codes, wav, logits = hf_speak(model, eos, **inputs)
            out[kind] = (prompt, sequences[0, len(prompt):].tolist(), codes, wav,
                         first_near_tie(logits, codes, model))
        else:
            with torch.no_grad():
                sequences = model.thinker.generate(**inputs, max_new_tokens=12,
                                                   do_sample=False, eos_token_id=eos)
            out[kind] = (prompt, sequences[0, len(prompt):].tolist(), None, None, 0)
    return out


#: A code-0 choice whose two best logits (HF's) are closer than this may flip under float32
#: rounding differences between vLLM's kernels and HF's (observed: a flip at 1.6e-4).
NEAR_TIE = 1e-3
#: The same for codes 1-15, the code predictor's: its logits are an order of magnitude
#: closer together on the tiny checkpoint (top-two gaps around 1e-3; observed: a flip at
#: 1.3e-6, none at 2.9e-4).
NEAR_TIE_RESIDUAL = 1e-4


def first_near_tie(logits, codes, model) -> int:
    """The first frame one of whose 16 codes HF chose by less than :data:`NEAR_TIE`
    (code 0) or :data:`NEAR_TIE_RESIDUAL` (codes 1-15), else the frame count; ``logits``
    as :func:`hf_speak` returns them."""
    from vllm_omni_plugin.models.qwen3_omni.talker_inputs import talker_logits_mask

    mask = talker_logits_mask(model.config)
    for frame in range(codes.shape[0]):
        for group, per_frame in enumerate(logits):
            values = per_frame[frame] if group else per_frame[frame].masked_fill(
                mask, float("-inf"))
            top = values.topk(2).values
            if float(top[0] - top[1]) < (NEAR_TIE_RESIDUAL if group else NEAR_TIE):
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



"""The tiny Qwen3-Omni and BAGEL pipelines under vLLM's GPU defaults, checked against HF
transformers on the same device (Qwen3-Omni) and against the same pipeline on the CPU
in float32 (BAGEL): what a maintainer with a GPU and PyPI's ``vllm`` runs
(``bash scripts/gpu_check.sh``; docs/contributing/gpu_check.md), and, with ``--cpu``,
its dry run on vLLM's CPU build (CI runs it: ``plugin_tests/engine/test_gpu_check.py``).

Each Qwen3-Omni case is one run of the engine script
``plugin_tests/engine/scripts/omni_pipeline.py`` (the shipped
``stage_configs/qwen3_omni_moe.yaml``, three EngineCores, the tiny
checkpoint; the talker at :data:`~plugin_tests.engine.pipeline_reference.TALKER_FRAMES`
frames) with nothing set that vLLM's defaults decide. Cases (:data:`CASES`):

* ``fp32``: float32;
* ``bf16``: bfloat16, what GPU users run (on vLLM's CPU build only where the CPU has
  AVX-512 BF16 or AMX);
* ``tp2``: float32, the thinker on tensor parallelism 2 (two GPUs; on the CPU build, two
  cores, one a rank);
* ``bagel``: float32, the tiny BAGEL pipeline (``stage_configs/bagel.yaml``: the AR
  stage, then the DiT with CFG; ``scripts/bagel_pipeline.py``) drawing a 64 px and a
  512 px image (a copy of the tiny checkpoint with ``max_latent_size`` 32), compared with
  what the same pipeline drew on vLLM's CPU build in float32 (recorded in
  :data:`BAGEL_REFERENCE` by ``--cpu --cases bagel --record-bagel``; the dry run
  compares with it too, so CI keeps it current).

Every Qwen3-Omni answer of the scenarios served (``parity``: the requests alone and 8 at
once; ``streamed``: the same, streamed; ``media``: an image and an audio clip as input)
is compared with HF transformers teacher-forced along it on the same device and dtype
(:func:`~plugin_tests.engine.pipeline_reference.agreement`): each greedy choice the
pipeline made (thinker tokens, the talker's code 0 and its end, codes 1-15) must be HF's
own or trail HF's top logit by less than the dtype's near-tie gap (``NEAR_TIES``), and
the waveform must be HF's decode of the same codes. HF's talker takes no audio prompt,
so the audio request's thinker tokens alone are compared; media prompt ids must equal
HF's processor's; the image answer's talker codes are held to a wider near-tie gap in
float32 (:func:`media_near_ties`). The ``prefix`` scenario's spoken answers (a text, an
audio and a second audio turn, each after a long system message) are compared with
themselves: served again, reading the thinker's prefix cache (at least one block), their
thinker tokens and codes must be the cold run's, the waveform within the dtype's
rounding (:func:`prefix_problems`).

Each case must also report the modes expected (:data:`EXPECTED_MODES`, checked by
:func:`mode_problems`): on a GPU every stage on vLLM's V2 model runner with async
scheduling on, the stages that are not eager (the thinker) on FULL_AND_PIECEWISE CUDA
graphs; on vLLM's CPU build (``--cpu``), the CPU build's modes: its V1 ``CPUModelRunner``,
no graphs, async scheduling off. ``--expect-modes`` picks the other expectation (a CPU
run judged by the GPU's fails).

Exit status 0 when every case ran, compared at least one answer, agreed and reported the
modes expected; a case that cannot run here (``tp2`` on one GPU) is reported SKIPPED and
fails the check unless ``--allow-skip``.

    python -m plugin_tests.gpu_check                      # every case on the GPU
    python -m plugin_tests.gpu_check --cpu --cases bf16   # vLLM's CPU build
    python -m plugin_tests.gpu_check --released DIR --plan qwen3_omni_moe_1xh200
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
BAGEL_SCRIPT = HERE / "engine" / "scripts" / "bagel_pipeline.py"
#: what the BAGEL pipeline drew on vLLM's CPU build in float32 (``--record-bagel``)
BAGEL_REFERENCE = HERE / "fixtures" / "gpu_check" / "bagel_cpu_float32.safetensors"
#: ``max_latent_size`` of the BAGEL case's checkpoint: 32 latent tokens of 16 px, 512 px
BAGEL_LATENT_SIDE = 32
#: recorded images are kept pooled to at most this many pixels a side (mean of each
#: block), to keep the fixture small
BAGEL_POOLED_SIDE = 64


class Case(NamedTuple):
    """One configuration of a pipeline."""

    name: str
    dtype: str
    thinker_tp: int = 1
    pipeline: str = "qwen3_omni"  #: ``qwen3_omni`` or ``bagel``


CASES = (Case("fp32", "float32"), Case("bf16", "bfloat16"), Case("tp2", "float32", 2),
         Case("bagel", "float32", pipeline="bagel"))

#: the engine script's scenarios a Qwen3-Omni case can serve and compare
SCENARIOS = ("parity", "streamed", "media", "prefix")

#: Max |served - HF's decode of the same codes| of a waveform, per dtype and device.
#: float32 on the CPU: rounding only (7.5e-8 observed, TP 2). On a GPU, cuDNN's
#: convolutions may use TF32 (torch's default, in HF's code2wav and the stage's alike):
#: float32's bound there is that of TF32's 10-bit mantissa. bfloat16: 9.8e-4 observed on
#: vLLM's CPU build (AVX-512 BF16, vLLM 0.32).
WAVEFORM_ATOL = {("float32", "cpu"): 1e-5, ("float32", "cuda"): 1e-3,
                 ("bfloat16", "cpu"): 1e-2, ("bfloat16", "cuda"): 1e-2}


class BagelTolerance(NamedTuple):
    """How far the BAGEL case's images may be from the CPU's float32 record."""

    latent: float  #: max |served - recorded| / max |recorded| of the final latent
    pixels: float  #: mean |served - recorded| of the (pooled) pixels, in uint8 levels


#: per device. The CPU: the same kernels as the record, up to the record's float16
#: rounding (2^-11 relative) and vector widths. A GPU: TF32 convolutions and matmuls
#: (10-bit mantissa) over a few denoising steps; the bound the DiT engine test holds
#: bfloat16 against float32 to (test_bagel_dit_engine.py).
BAGEL_TOLERANCE = {"cpu": BagelTolerance(latent=2e-3, pixels=0.5),
                   "cuda": BagelTolerance(latent=5e-2, pixels=3.0)}

def media_near_ties(dtype: str):
    """The near-tie gaps an image-input answer's choices are held to: the text answers'
    (``NEAR_TIES``), except the talker's codes in float32 at 5e-3. vLLM's Qwen3-Omni
    vision tower and HF's differ by more than float32 rounding: on vLLM's CPU build
    (0.32, TP 1 and TP 2) one talker code choice of the image answer (of 385) trailed
    HF's by 1.4e-3 while every choice of the text answers was HF's own; the same with
    HF's slow and fast image processors (equal pixels), so not the preprocessing. Not
    root-caused. A broken image path is a divergence, not one near-tie: with plain
    talker positions the codes differed from HF's from frame 6 on
    (test_pipeline_engine.py)."""
    from plugin_tests.engine.pipeline_reference import NEAR_TIES

    ties = NEAR_TIES[dtype]
    return ties._replace(code0=max(ties.code0, 5e-3), residual=max(ties.residual, 5e-3))


#: the engine script's answers: (report key of their thinker tokens, the .npz of their
#: codes and waveforms)
_SERVED = (("thinker_tokens", "served.npz"), ("streamed_thinker_tokens", "streamed.npz"))


class Modes(NamedTuple):
    """The modes a stage engine must report (``omni_pipeline.engine_settings``)."""

    runner: str  #: the model runner's kind (:func:`runner_kind`)
    async_scheduling: bool
    #: the CUDA graph mode of a stage that is not eager (``enforce_eager: true`` in the
    #: pipeline YAML); an eager stage has none (``NONE``)
    graphs: str


#: What each kind of host must report. ``gpu``: vLLM's defaults on CUDA (the V2 model
#: runner, async scheduling, FULL_AND_PIECEWISE graphs: vllm/config/vllm.py, vLLM
#: 0.30-0.33). ``cpu``: what vLLM's CPU build turns them into (DESIGN.md §5: its
#: ``CPUModelRunner`` is V1, async scheduling is forced off, no CUDA graphs).
EXPECTED_MODES = {"gpu": Modes("V2", True, "FULL_AND_PIECEWISE"),
                  "cpu": Modes("CPU", False, "NONE")}


def runner_kind(qualname: str) -> str:
    """``V2`` (``vllm.v1.worker.gpu.model_runner``), ``CPU`` (the CPU build's
    ``CPUModelRunner``, a V1 runner) or ``V1`` (any other: ``gpu_model_runner``'s) for a
    model runner's qualified class name."""
    if ".worker.gpu.model_runner." in qualname:
        return "V2"
    if "cpu_model_runner" in qualname:
        return "CPU"
    return "V1"


def mode_problems(settings: dict, expected: Modes, eager: dict) -> list[str]:
    """What the stages reported (``settings``: stage id, int or str -> the engine's
    settings) against ``expected``; ``eager``: stage id (int) -> whether the pipeline
    YAML runs it eagerly. One line per mismatch, none when all hold."""
    problems = []
    for stage, got in sorted(settings.items(), key=lambda item: int(item[0])):
        stage = int(stage)
        kinds = sorted({runner_kind(name) for name in got["model_runner"]})
        if kinds != [expected.runner]:
            problems.append(f"stage {stage} runs the {'/'.join(kinds)} model runner, "
                            f"not {expected.runner}")
        if bool(got["async_scheduling"]) != expected.async_scheduling:
            problems.append(f"stage {stage} has async scheduling "
                            f"{'on' if got['async_scheduling'] else 'off'}, not "
                            f"{'on' if expected.async_scheduling else 'off'}")
        graphs = "NONE" if eager.get(stage, False) else expected.graphs
        mode = str(got["cudagraph_mode"]).removeprefix("CUDAGraphMode.")
        if mode != graphs:
            problems.append(f"stage {stage} has CUDA graphs {mode}, not {graphs}"
                            f"{' (eager in the YAML)' if graphs == 'NONE' else ''}")
    return problems


def pipeline_eager(yaml_path: str) -> dict[int, bool]:
    """Stage id -> whether the pipeline YAML sets ``enforce_eager`` on it."""
    with open(yaml_path) as f:
        pipeline = yaml.safe_load(f)
    return {int(s["stage_id"]): bool(s.get("engine_args", {}).get("enforce_eager", False))
            for s in pipeline["stages"]}


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX-512 BF16 or AMX), where vLLM's
    CPU build runs bfloat16 models at speed."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def skip_reason(case: Case, device: str) -> str | None:
    """Why ``case`` cannot run on this host, or None."""
    if case.thinker_tp > 1:
        if device == "cuda":
            import torch

            if torch.cuda.device_count() < case.thinker_tp:
                return f"needs {case.thinker_tp} GPUs, {torch.cuda.device_count()} visible"
        elif len(os.sched_getaffinity(0)) < case.thinker_tp:
            return f"needs {case.thinker_tp} CPU cores"
    if case.dtype == "bfloat16" and device == "cpu" and not cpu_has_bf16():
        return "this CPU has neither AVX-512 BF16 nor AMX"
    return None


def case_yaml(case: Case, root: Path, device: str) -> str:
    """The shipped pipeline for ``case``: Qwen3-Omni's with the talker at
    TALKER_MAX_TOKENS and the thinker on ``case.thinker_tp`` ranks (on the CPU build
    placed on that many cores); BAGEL's as shipped."""
    from plugin_tests.conftest import QWEN3_OMNI_YAML
    from plugin_tests.engine.pipeline_reference import TALKER_MAX_TOKENS

    if case.pipeline == "bagel":
        from vllm_omni_plugin.config.pipelines import builtin_pipeline

        return builtin_pipeline("bagel")
    with open(QWEN3_OMNI_YAML) as f:
        pipeline = yaml.safe_load(f)
    pipeline["stages"][1]["default_sampling_params"]["max_tokens"] = TALKER_MAX_TOKENS
    if case.thinker_tp > 1:
        thinker = pipeline["stages"][0]
        thinker["engine_args"]["tensor_parallel_size"] = case.thinker_tp
        if device == "cpu":
            cores = sorted(os.sched_getaffinity(0))[:case.thinker_tp]
            thinker["runtime"] = {"devices": ",".join(map(str, cores))}
    path = root / f"{case.name}.yaml"
    path.write_text(yaml.safe_dump(pipeline))
    return str(path)


def _empty_result(settings: dict) -> dict:
    return {"settings": settings, "answers": 0, "agreed": 0, "choices": 0, "exact": 0,
            "media_choices": 0, "media_exact": 0, "worst": {}, "waveform_err": 0.0,
            "prefix": {}, "problems": []}


def _count(result: dict, name: str, got) -> None:
    """Add one compared answer (``got``: an ``Agreement``) to ``result`` (the media
    scenario's also to ``media_choices``, ``media_exact``)."""
    result["answers"] += 1
    result["agreed"] += not got.problem
    result["choices"] += got.choices
    result["exact"] += got.exact
    if name.startswith("media "):
        result["media_choices"] += got.choices
        result["media_exact"] += got.exact
    for kind, gap in got.worst.items():
        result["worst"][kind] = max(result["worst"].get(kind, 0.0), gap)
    result["waveform_err"] = max(result["waveform_err"], got.waveform_err)
    if got.problem:
        result["problems"].append(f"{name}: {got.problem}")


def prefix_problems(report: dict, served, atol: float) -> tuple[dict, list[str]]:
    """The ``prefix`` scenario's answers, warm against cold (``served``: its
    ``prefix.npz``): ``({case: {"cached": tokens, "waveform_err": max |diff|}}, problems)``;
    a problem where the warm answer read less than one KV block from the cache or its
    thinker tokens, codes or waveform (beyond ``atol``) differ from the cold one's."""
    block = report["settings"]["0"]["block_size"]
    seen, problems = {}, []
    for case, runs in report.get("prefix", {}).items():
        cold, warm = runs["cold"], runs["warm"]
        err = float(np.abs(served[f"{case}_warm_waveform"]
                           - served[f"{case}_cold_waveform"]).max())
        seen[case] = {"cached": warm["cached"], "waveform_err": err}
        name = f"prefix {case}"
        if warm["cached"] < block:
            problems.append(f"{name}: read {warm['cached']} tokens from the prefix cache, "
                            f"less than a block ({block})")
        if warm["tokens"] != cold["tokens"]:
            problems.append(f"{name}: thinker tokens differ from the cold run's")
        if not np.array_equal(served[f"{case}_warm_codes"], served[f"{case}_cold_codes"]):
            problems.append(f"{name}: codes differ from the cold run's")
        elif err > atol:
            problems.append(f"{name}: waveform differs from the cold run's by {err:.1e}")
    return seen, problems


def _on(inputs: dict, model) -> dict:
    """``inputs`` on the model's device, floating tensors in its dtype."""
    import torch

    return {name: (value.to(model.device, model.dtype) if value.is_floating_point()
                   else value.to(model.device)) if isinstance(value, torch.Tensor) else value
            for name, value in inputs.items()}


class _ThinkerAgreement(NamedTuple):
    """:class:`~plugin_tests.engine.pipeline_reference.Agreement` of a thinker-only
    answer (no talker: no codes, no waveform)."""

    choices: int
    exact: int
    worst: dict
    waveform_err: float
    problem: str


def thinker_agreement(model, eos, tokens: list[int], inputs: dict, dtype: str):
    """HF's thinker teacher-forced along the served ``tokens`` on ``inputs``: each served
    token must be HF's top choice or trail it by less than the thinker's near-tie gap."""
    import torch

    from plugin_tests.engine.pipeline_reference import NEAR_TIES

    logits = []

    def hook(module, args, output):
        logits.append(output[0, -1].float().cpu())
        i = len(logits) - 1
        if i < len(tokens):
            output = torch.full_like(output, float("-inf"))
            output[..., tokens[i]] = 0
            return output

    handle = model.thinker.lm_head.register_forward_hook(hook)
    try:
        with torch.no_grad():
            model.thinker.generate(**_on(inputs, model), max_new_tokens=len(tokens),
                                   do_sample=False, eos_token_id=eos)
    finally:
        handle.remove()
    gaps = [float(values.max() - values[token])
            for values, token in zip(logits, tokens, strict=False)]
    tie, problems = NEAR_TIES[dtype].thinker, []
    if len(logits) != len(tokens):
        problems.append(f"HF forced along {len(tokens)} thinker tokens made {len(logits)} "
                        "choices")
    if over := [(i, round(gap, 5)) for i, gap in enumerate(gaps) if gap > tie]:
        problems.append(f"thinker choices trail HF's by more than {tie:g} (index, gap): "
                        f"{over[:3]}")
    return _ThinkerAgreement(len(gaps), sum(gap <= 0 for gap in gaps),
                             {"thinker": max(gaps, default=0.0)}, 0.0, "; ".join(problems))


def _write_media(folder: Path) -> None:
    from plugin_tests import media
    from plugin_tests.engine.pipeline_reference import AUDIO_SECONDS, IMAGE_SIZE

    folder.mkdir(exist_ok=True)
    (folder / "image.png").write_bytes(media.png_bytes(*IMAGE_SIZE))
    (folder / "audio.wav").write_bytes(media.wav_bytes(AUDIO_SECONDS))


def check_case(case: Case, ckpt: str, root: Path, device: str, scenarios: list[str]) -> dict:
    """Run the Qwen3-Omni ``case`` and compare every answer with HF's teacher-forced along
    it: ``{"settings": {stage: {...}}, "answers": n, "agreed": n, "choices": n, "exact": n,
    "worst": {kind: gap}, "waveform_err": worst, "problems": [...]}``."""
    import torch

    from plugin_tests.engine.pipeline_reference import (
        agreement,
        hf_media_inputs,
        hf_model,
        hf_speak,
        run_script,
    )

    out = root / case.name
    out.mkdir()
    if "media" in scenarios or "prefix" in scenarios:
        _write_media(out / "media")
    gpu_memory_utilization = "0.25" if device == "cuda" else "0.3"
    yaml_path = case_yaml(case, root, device)
    report, _ = run_script(ckpt, yaml_path, out, scenarios,
                           options=("--dtype", case.dtype, "--gpu-memory-utilization",
                                    gpu_memory_utilization))
    model, eos = hf_model(ckpt, case.dtype, device)
    prompts = report["prompt_ids"]
    atol = WAVEFORM_ATOL[(case.dtype, device)]
    result = _empty_result(report["settings"])
    result["eager"] = pipeline_eager(yaml_path)
    compared = {}  # (prompt, tokens, codes) -> Agreement: identical answers compare once
    for tokens_key, npz in _SERVED:
        if tokens_key not in report:
            continue
        served = np.load(out / npz)
        for name, tokens in report[tokens_key].items():
            kind, i = name.rsplit("_", 1)
            if kind == "text":  # the text-only twin of a solo request: tokens only
                continue
            prompt = prompts[int(i) % len(prompts)]
            codes, wav = served[f"{kind}_codes_{i}"], served[f"{kind}_waveform_{i}"]
            key = (tuple(prompt), tuple(tokens), codes.tobytes())
            if key not in compared:
                forced = hf_speak(model, eos, force=(tokens, codes),
                                  input_ids=torch.tensor([prompt]))
                compared[key] = agreement(tokens, codes, wav, forced, model, case.dtype, atol)
            _count(result, f"{npz.split('.')[0]} {name}", compared[key])
    for kind, got in report.get("media", {}).items():
        inputs = hf_media_inputs(ckpt, out / "media", kind)
        name = f"media {kind}"
        if got["prompt_ids"] != inputs["input_ids"][0].tolist():
            result["answers"] += 1
            result["problems"].append(f"{name}: prompt ids differ from HF's processor's")
            continue
        if kind == "audio":  # HF's talker takes no audio prompt: the thinker's tokens
            _count(result, name, thinker_agreement(model, eos, got["thinker_tokens"],
                                                   inputs, case.dtype))
            continue
        served = np.load(out / "media.npz")
        codes, wav = served[f"{kind}_codes"], served[f"{kind}_waveform"]
        forced = hf_speak(model, eos, force=(got["thinker_tokens"], codes),
                          **_on(inputs, model))
        _count(result, name, agreement(got["thinker_tokens"], codes, wav, forced, model,
                                       case.dtype, atol, media_near_ties(case.dtype)))
    if "prefix" in report:
        result["prefix"], problems = prefix_problems(report, np.load(out / "prefix.npz"), atol)
        result["problems"].extend(problems)
    return result


# -- BAGEL -------------------------------------------------------------------------------
def bagel_checkpoint(root: Path) -> str:
    """The tiny BAGEL checkpoint with ``max_latent_size`` :data:`BAGEL_LATENT_SIDE`
    (images up to 512 px; its fixed latent position table redrawn for that size, every
    other weight the tiny checkpoint's), written under ``root``."""
    import torch
    from safetensors.torch import load_file, save_file

    from plugin_tests.conftest import cached_tiny_checkpoint
    from vllm_omni_plugin.compat.internals import bagel_sincos_pos_embed

    source = Path(cached_tiny_checkpoint("bagel"))
    out = root / f"bagel-latent{BAGEL_LATENT_SIDE}"
    if out.exists():
        return str(out)
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    config["max_latent_size"] = BAGEL_LATENT_SIDE
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weights = load_file(str(out / "ema.safetensors"))
    table = weights["latent_pos_embed.pos_embed"]
    # as the tiny checkpoint draws it (tools/tiny_bagel.py: the fixed table, bf16-rounded)
    weights["latent_pos_embed.pos_embed"] = torch.from_numpy(bagel_sincos_pos_embed(
        table.shape[1], BAGEL_LATENT_SIDE)).to(torch.bfloat16).to(table.dtype).contiguous()
    save_file(weights, str(out / "ema.safetensors"))
    return str(out)


def _pooled(image: np.ndarray) -> np.ndarray:
    """``[H, W, 3]`` uint8 -> float32 means of square blocks, at most
    :data:`BAGEL_POOLED_SIDE` a side."""
    h, w, c = image.shape
    block = max(1, max(h, w) // BAGEL_POOLED_SIDE)
    return image.reshape(h // block, block, w // block, block, c).astype(np.float32).mean(
        axis=(1, 3))


def _bagel_basis(ckpt: str) -> dict[str, str]:
    """What the record depends on: the checkpoint's weight files and the requests."""
    from plugin_tests.conftest import file_hashes
    from plugin_tests.engine.scripts.bagel_pipeline import IMAGES

    hashes = file_hashes(ckpt)
    return {"checkpoint": json.dumps({k: v for k, v in sorted(hashes.items())
                                      if k.endswith((".safetensors", "config.json"))}),
            "images": json.dumps(IMAGES, sort_keys=True)}


def record_bagel(served: dict, ckpt: str, path: Path = BAGEL_REFERENCE) -> None:
    """Write the BAGEL case's images (``served``: the engine script's bagel.npz) as the
    CPU's float32 record: latents (float16) and pooled pixels (float16)."""
    import torch
    from safetensors.torch import save_file

    tensors = {}
    for key in served.files:
        name, what = key.rsplit("_", 1)
        value = served[key] if what == "latent" else _pooled(served[key])
        tensors[f"{name}.{what}"] = torch.from_numpy(np.asarray(value, np.float32)).half()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=_bagel_basis(ckpt))


def bagel_agreement(served, ckpt: str, device: str, path: Path = BAGEL_REFERENCE) -> dict:
    """The BAGEL case's images (``served``: name -> array, the engine script's bagel.npz)
    against the CPU's float32 record at ``path``: ``{"answers", "agreed", "latent_err",
    "pixel_err", "problems"}``."""
    from safetensors import safe_open

    tolerance = BAGEL_TOLERANCE[device]
    out = {"answers": 0, "agreed": 0, "latent_err": 0.0, "pixel_err": 0.0, "problems": []}
    if not path.exists():
        out["problems"].append(f"no record at {path} (--cpu --cases bagel --record-bagel)")
        return out
    with safe_open(str(path), "pt") as f:
        basis, recorded = f.metadata(), {k: f.get_tensor(k).float().numpy() for k in f.keys()}
    if basis != _bagel_basis(ckpt):
        out["problems"].append(f"{path.name} was recorded from another checkpoint or other "
                               "requests: record it again (--cpu --cases bagel --record-bagel)")
        return out
    for name in sorted({key.rsplit(".", 1)[0] for key in recorded}):
        out["answers"] += 1
        if f"{name}_latent" not in served:
            out["problems"].append(f"{name}: not served")
            continue
        want = recorded[f"{name}.latent"]
        got = served[f"{name}_latent"]
        if got.shape != want.shape:
            out["problems"].append(f"{name}: latent {got.shape}, recorded {want.shape}")
            continue
        latent_err = float(np.abs(got - want).max() / np.abs(want).max())
        pixel_err = float(np.abs(_pooled(served[f"{name}_image"])
                                 - recorded[f"{name}.image"]).mean())
        out["latent_err"] = max(out["latent_err"], latent_err)
        out["pixel_err"] = max(out["pixel_err"], pixel_err)
        if latent_err > tolerance.latent or pixel_err > tolerance.pixels:
            out["problems"].append(f"{name}: latent {latent_err:.1e} (max {tolerance.latent:g}"
                                   f"), pixels {pixel_err:.2f} levels (max "
                                   f"{tolerance.pixels:g})")
        else:
            out["agreed"] += 1
    return out


def run_bagel_script(ckpt: str, yaml_path: str, out: Path, dtype: str,
                     gpu_memory_utilization: str) -> dict:
    """The BAGEL engine script's report (output in ``out/pipeline.{out,err}``)."""
    from plugin_tests.conftest import PYTHON
    from plugin_tests.engine.pipeline_reference import ENGINE_TIMEOUT_S
    from plugin_tests.helpers import process_group, script_report

    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ}
    out_path, err_path = out / "pipeline.out", out / "pipeline.err"
    with open(out_path, "w") as stdout, open(err_path, "w") as stderr, \
            process_group([PYTHON, str(BAGEL_SCRIPT), "--dtype", dtype,
                           "--gpu-memory-utilization", gpu_memory_utilization, ckpt,
                           yaml_path, str(out)], stdout=stdout, stderr=stderr, text=True,
                          env=env) as proc:
        proc.wait(timeout=ENGINE_TIMEOUT_S)
    return script_report(BAGEL_SCRIPT, proc.returncode, out_path.read_text(),
                         err_path.read_text())


def check_bagel(case: Case, root: Path, device: str, record: bool = False) -> dict:
    """Run the BAGEL ``case`` and compare its images with the CPU's float32 record
    (``record``: write the record instead, on the CPU in float32 only)."""
    out = root / case.name
    out.mkdir()
    ckpt = bagel_checkpoint(root)
    yaml_path = case_yaml(case, root, device)
    report = run_bagel_script(ckpt, yaml_path, out, case.dtype,
                              "0.25" if device == "cuda" else "0.3")
    served = np.load(out / "bagel.npz")
    if record:
        if device != "cpu" or case.dtype != "float32":
            raise ValueError("the BAGEL record is the CPU's in float32")
        record_bagel(served, ckpt)
        print(f"[gpu_check] recorded {BAGEL_REFERENCE}", file=sys.stderr)
    result = {"settings": report["settings"], "eager": pipeline_eager(yaml_path),
              **bagel_agreement({k: served[k] for k in served.files}, ckpt, device)}
    return result


# -- the report ---------------------------------------------------------------------------
def _short(settings: dict) -> str:
    runner = ", ".join(f"{runner_kind(name)} ({name.rsplit('.', 1)[-1]})"
                       for name in settings["model_runner"])
    mode = settings["cudagraph_mode"].removeprefix("CUDAGraphMode.")
    return (f"{runner}; graphs {mode}; async {'on' if settings['async_scheduling'] else 'off'}; "
            f"TP {settings['tensor_parallel_size']}; {settings['dtype']}")


def case_status(result: dict, expected: Modes) -> tuple[str, list[str]]:
    """``(status, problems)`` of one case's result: ``ok``, ``FAILED``, ``SKIPPED`` or
    ``FAILED to run``. A case that compared no answer failed; so did one whose stages
    reported modes other than ``expected``."""
    if "skipped" in result:
        return "SKIPPED", [result["skipped"]]
    if "error" in result:
        return "FAILED to run", [result["error"].splitlines()[0] if result["error"] else ""]
    problems = mode_problems(result["settings"], expected,
                             {int(k): v for k, v in result.get("eager", {}).items()})
    if result["answers"] == 0:
        problems.append("no answer was compared")
    problems.extend(result["problems"])
    ok = not problems and result["agreed"] == result["answers"]
    return ("ok" if ok else "FAILED"), problems


def exit_status(results: dict, expected: Modes, allow_skip: bool = False) -> int:
    """0 when some case ran and every case is ``ok`` (or SKIPPED, with ``allow_skip``)."""
    statuses = [case_status(result, expected)[0] for result in results.values()]
    ran = [s for s in statuses if s != "SKIPPED"]
    if not ran or any(s not in ("ok", "SKIPPED") for s in statuses):
        return 1
    return 0 if allow_skip or "SKIPPED" not in statuses else 1


def render(results: dict, device: str, expected_name: str, environment: dict) -> str:
    """The one-screen report of :func:`main`'s results."""
    expected = EXPECTED_MODES[expected_name]
    env = ", ".join(f"{k} {v}" for k, v in environment.items())
    lines = [f"gpu_check on {device}: the tiny Qwen3-Omni pipeline vs HF, greedy; the tiny "
             f"BAGEL pipeline vs the CPU in float32",
             f"  {env}",
             f"  modes required ({expected_name}): {expected.runner} model runner, async "
             f"scheduling {'on' if expected.async_scheduling else 'off'}, graphs "
             f"{expected.graphs} (NONE on eager stages)", ""]
    for name, result in results.items():
        status, problems = case_status(result, expected)
        if status in ("SKIPPED", "FAILED to run"):
            lines.append(f"{name:5} {status}: {problems[0]}")
            continue
        if "latent_err" in result:
            lines.append(f"{name:5} {status}: {result['agreed']}/{result['answers']} images "
                         f"agree with the CPU's float32 record; latent "
                         f"{result['latent_err']:.1e}, pixels {result['pixel_err']:.2f} levels")
        else:
            worst = ", ".join(f"{kind} {gap:.1e}" for kind, gap in result["worst"].items())
            lines.append(f"{name:5} {status}: {result['agreed']}/{result['answers']} answers "
                         f"agree with HF; {result['exact']}/{result['choices']} greedy "
                         f"choices HF's own, largest gap to HF's: {worst}; waveform "
                         f"{result['waveform_err']:.1e}")
            if result.get("prefix"):
                lines.append("      prefix cache, warm as cold: " + ", ".join(
                    f"{case} ({seen['cached']} tokens cached, waveform "
                    f"{seen['waveform_err']:.1e})" for case, seen in result["prefix"].items()))
        for stage, settings in sorted(result["settings"].items(), key=lambda i: int(i[0])):
            lines.append(f"      stage {stage}: {_short(settings)}")
        lines.extend(f"      {problem}" for problem in problems[:5])
    return "\n".join(lines)


def environment(device: str) -> dict:
    """What the report's second line says of this host: vLLM, torch, FlashInfer (vLLM's
    ``has_flashinfer()``), the driver and GPUs."""
    from importlib.metadata import version

    import torch

    from vllm_omni_plugin.compat.internals import flashinfer_available
    from vllm_omni_plugin.compat.version import vllm_version

    env = {"vLLM": vllm_version(), "torch": version("torch")}
    if device == "cuda":
        env["CUDA"] = torch.version.cuda
        env["GPUs"] = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
        env["FlashInfer"] = "on" if flashinfer_available() else "off"
    else:
        env["FlashInfer"] = "on" if flashinfer_available() else "off (CPU build)"
    return env


def case_arg(text: str) -> tuple[str, list[str] | None]:
    """``--cases``'s item ``NAME[:SCENARIO,...]``: ``(name, scenarios or None)``.

    Raises:
        argparse.ArgumentTypeError: an unknown case or scenario, or scenarios named for
            the BAGEL case (it serves one image request each at two sizes).
    """
    name, _, listed = text.partition(":")
    cases = {c.name: c for c in CASES}
    if name not in cases:
        raise argparse.ArgumentTypeError(f"unknown case {name!r}: one of {', '.join(cases)}")
    if not listed:
        return name, None
    scenarios = listed.split(",")
    if unknown := [s for s in scenarios if s not in SCENARIOS]:
        raise argparse.ArgumentTypeError(
            f"case {name}: unknown scenario {unknown[0]!r}: one of {', '.join(SCENARIOS)}")
    if cases[name].pipeline != "qwen3_omni":
        raise argparse.ArgumentTypeError(f"case {name} serves no scenarios; name it alone")
    return name, scenarios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true",
                        help="dry run on vLLM's CPU build (HF on the CPU too)")
    parser.add_argument("--cases", nargs="+", type=case_arg, metavar="CASE[:SCENARIO,...]",
                        default=[(c.name, None) for c in CASES],
                        help=f"the cases to run ({', '.join(c.name for c in CASES)}), each "
                             "with its own scenarios after a colon (bf16:media) or those of "
                             "--scenarios")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS),
                        help="the engine script's scenarios each Qwen3-Omni case serves "
                             "unless --cases names its own")
    parser.add_argument("--expect-modes", choices=sorted(EXPECTED_MODES),
                        help="the modes every case must report (default: gpu, or cpu "
                             "with --cpu)")
    parser.add_argument("--allow-skip", action="store_true",
                        help="exit 0 even when a case cannot run here (tp2 on one GPU)")
    parser.add_argument("--record-bagel", action="store_true",
                        help="with --cpu: write the bagel case's images as the CPU's "
                             f"float32 record ({BAGEL_REFERENCE.relative_to(HERE.parent)})")
    parser.add_argument("--released", type=Path, metavar="DIR",
                        help="instead of the cases: serve the released checkpoint in DIR "
                             "on the GPU with --plan, one request, each engine's KV cache "
                             "against the plan")
    parser.add_argument("--plan", help="with --released: the plan (a shipped plan's name or "
                                       "a YAML path; default: the one --stage-configs-path "
                                       "auto serves on these GPUs)")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    parser.add_argument("--out", type=Path,
                        help="keep each case's pipeline YAML, engine logs and answers here "
                             "(default: a temporary directory, removed)")
    args = parser.parse_args(argv)
    if args.record_bagel and not args.cpu:
        parser.error("--record-bagel records the CPU's images: add --cpu")
    if args.released is not None:
        from plugin_tests.gpu_check_released import main as released_main

        return released_main(args, parser)
    from plugin_tests.conftest import cached_tiny_checkpoint

    device = "cpu" if args.cpu else "cuda"
    expected_name = args.expect_modes or ("cpu" if args.cpu else "gpu")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device is visible (torch.cuda.is_available() is False; "
                         "vLLM's CUDA 13 wheels need NVIDIA driver R580 or newer); --cpu "
                         "runs the dry run on vLLM's CPU build")
    results = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        root = args.out or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        wanted = dict(args.cases)
        for case in CASES:
            if case.name not in wanted:
                continue
            if reason := skip_reason(case, device):
                results[case.name] = {"skipped": reason}
                continue
            print(f"[gpu_check] case {case.name} ...", file=sys.stderr, flush=True)
            start = time.monotonic()
            try:
                if case.pipeline == "bagel":
                    results[case.name] = check_bagel(case, root, device, args.record_bagel)
                else:
                    results[case.name] = check_case(case, cached_tiny_checkpoint("qwen3-omni"),
                                                    root, device,
                                                    wanted[case.name] or args.scenarios)
            except BaseException as exc:  # pytest.fail's Failed is a BaseException
                if isinstance(exc, KeyboardInterrupt):
                    raise
                print(f"[gpu_check] case {case.name} failed: {exc}", file=sys.stderr)
                results[case.name] = {"error": str(exc)}
            print(f"[gpu_check] case {case.name}: {time.monotonic() - start:.0f} s",
                  file=sys.stderr, flush=True)
    print(render(results, device, expected_name, environment(device)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return exit_status(results, EXPECTED_MODES[expected_name], args.allow_skip)


if __name__ == "__main__":
    sys.exit(main())

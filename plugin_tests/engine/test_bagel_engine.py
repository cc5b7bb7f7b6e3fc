"""vLLM's own BAGEL class (understanding) and the plugin's AR stage built on it, on the
tiny BAGEL checkpoint, against the official BAGEL code.

The official code's greedy understanding tokens after each reference prompt
(``<|im_start|> prompt <|im_end|>``, then the start token ``<|im_start|>``, as its
``gen_text`` feeds them) are fixtures (``scripts/bagel_reference.sh``; the official code
computes in bfloat16, vLLM here in float32). A child process
(``scripts/bagel_generate.py``, engine cores in that process) runs vLLM's
``BagelForConditionalGeneration`` on its own worker and model runner, then the plugin's
``OmniPluginBagelAR`` on the plugin's worker, which publishes each prompt's keys and
values: the DiT's context, compared with the official code's (its ``NaiveCache`` after
the prompt).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plugin_tests.conftest import BAGEL_REFERENCE
from plugin_tests.helpers import engine_result, engine_script_results

pytestmark = pytest.mark.engine

SCRIPT = Path(__file__).resolve().parent / "scripts" / "bagel_generate.py"
ENGINE_TIMEOUT_S = 600
CASES = ("t2i_cfg_global", "t2i_cfg_text_channel")
#: text to image after planning: its full context holds the system prompt, the prompt and
#: the planning; the planning is greedy after the first two (the image-unconditional
#: context) and the start token
THINK = "t2i_think"
IMAGE_TEXT = "<|im_start|><|vision_start|><|image_pad|><|vision_end|>Describe it.<|im_end|>"
#: bf16 reference vs float32: max |difference| / max |reference| of the keys and values
KV_REL_TOL = 0.02
#: the same for the thinking case's 166 positions: the reference's bf16 RoPE rounding
#: grows with the position (0.5 % of the scale at the first positions, 3.2 % at 160)
KV_REL_TOL_LONG = 0.04
PIPELINE_YAML = """\
model_type: bagel
stages:
  - {stage_id: 0, name: ar, kind: ar, final_output: true, final_output_type: text}
"""


def _reference(case: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(BAGEL_REFERENCE) / f"{case}.safetensors"))


@pytest.fixture(scope="module")
def result(tiny_bagel, tmp_path_factory):
    """``{"engines": each engine's result by name, "store": the AR stage's payload
    store}``."""
    from vllm_omni_plugin.payload_store import PayloadStore

    bos = json.loads((Path(BAGEL_REFERENCE) / "reference.json").read_text())[
        "special_token_ids"]["bos_token_id"]
    prompts = [_reference(c)["text_ids"].tolist() + [bos] for c in CASES]
    think = _reference(THINK)
    prompts.append(think["text_ids"][:think["cfg_img.k.0"].shape[0]].tolist() + [bos])
    logdir = tmp_path_factory.mktemp("bagel")
    (logdir / "pipeline.yaml").write_text(PIPELINE_YAML)
    max_tokens = len(_reference(CASES[0])["understanding_ids"])
    spec = {"model": tiny_bagel, "payload_dir": str(logdir / "payloads"),
            "yaml": str(logdir / "pipeline.yaml"), "engines": [{
                "name": "default",
                "engine_args": {"max_model_len": 256, "limit_mm_per_prompt": {"image": 1}},
                "prompts": prompts, "max_tokens": max_tokens,
                "image_prompts": [{"text": IMAGE_TEXT, "seed": 0},
                                  {"text": IMAGE_TEXT, "seed": 1},
                                  {"text": IMAGE_TEXT, "seed": 0}]},
                {"name": "ar", "stage": "ar", "engine_args": {"max_model_len": 256},
                 "prompts": [_reference(c)["text_ids"].tolist() for c in (*CASES, THINK)],
                 "max_tokens": 1}]}
    # both engines in one process, one after the other, each engine core in it
    engines = engine_script_results(SCRIPT, spec, logdir, name="engines",
                                    timeout=ENGINE_TIMEOUT_S,
                                    env={"VLLM_CPU_KVCACHE_SPACE": "1",
                                         "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    return {"engines": engines, "store": PayloadStore(spec["payload_dir"])}


def test_understanding_tokens_equal_the_official_code(result):
    tokens = engine_result(result["engines"], "default")["token_ids"]
    for case, got in zip(CASES, tokens[:len(CASES)], strict=True):
        assert got == _reference(case)["understanding_ids"].tolist(), case


def test_planning_tokens_equal_the_official_codes(result):
    """``think``: the greedy planning after the system prompt and the prompt is the
    official ``gen_text``'s."""
    got = engine_result(result["engines"], "default")["token_ids"][len(CASES)]
    assert got == _reference(THINK)["reasoning_ids"].tolist()


def test_image_understanding_depends_on_the_image(result, tiny_bagel):
    """Image in, text out through vLLM's SigLIP path: the placeholder becomes one token
    per ViT patch, and the answer depends on the image (the same image gives the same
    logprob, another one another)."""
    served = json.loads((Path(tiny_bagel) / "config.json").read_text())
    patches = served["vit_max_num_patch_per_side"] ** 2
    result = engine_result(result["engines"], "default")
    for with_image, text in zip(result["image_prompt_lens"], result["image_text_lens"],
                                strict=True):
        assert with_image == text - 1 + patches
    first, other, again = result["image_first_logprobs"]
    assert first == again
    assert first != other


def test_ar_stage_publishes_the_official_context(result):
    """The AR stage's rows of a prompt are the official context's keys (after RoPE) and
    values, layer by layer."""
    keys = engine_result(result["engines"], "ar")["keys"]
    for case, key in zip((*CASES, THINK), keys, strict=True):
        rows = result["store"].get(key)
        ref = _reference(case)
        n = ref["text_ids"].shape[0]
        tol = KV_REL_TOL_LONG if case == THINK else KV_REL_TOL
        assert rows["k"].shape[0] == rows["v"].shape[0] == n  # the prompt's positions
        for layer in range(rows["k"].shape[1]):
            for name in ("k", "v"):
                want = ref[f"context.{name}.{layer}"]
                got = rows[name][:, layer]
                assert got.shape == want.shape
                assert float((got - want).abs().max() / want.abs().max()) < tol, \
                    (case, name, layer)

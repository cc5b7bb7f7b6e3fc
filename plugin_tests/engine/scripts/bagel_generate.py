"""Run vLLM's own BAGEL class (``BagelForConditionalGeneration``, understanding) on a
BAGEL checkpoint; print JSON results.

Run as a subprocess by ``plugin_tests/engine/test_bagel_engine.py``. Input: a JSON spec
as ``argv[1]``::

    {"model": "/path/to/checkpoint",
     "payload_dir": DIR, "yaml": PIPELINE_YAML,     # for "stage": "ar"
     "engines": [{"name": "default", "engine_args": {...},
                  "stage": "ar",                 # optional: the plugin's AR stage
                                                 # (OmniPluginBagelAR on OmniWorker),
                                                 # each prompt publishing its rows
                  "prompts": [[id, ...], ...],   # greedy, together in one generate()
                  "max_tokens": 7,
                  "image_prompts": [{"text": "...", "seed": 0}, ...]}]}

``image_prompts``: a text with ``<|image_pad|>`` and a random RGB image (numpy, ``seed``,
the ViT's resolution) for it, one greedy token each. Output: the last stdout line is
``{"engines": {name: {"token_ids": [[...], ...], "image_first_logprobs": [...],
"image_prompt_lens": [...], "image_text_lens": [...], "keys": [...]}}}`` (the logprob of
each image prompt's first token; the prompt's length with the image's tokens, and its
text's; with ``"stage": "ar"`` the payload keys the prompts published under).
"""

from __future__ import annotations

import gc
import sys

from _engines import run_engines


def run_one(spec: dict, engine: dict) -> dict:
    import numpy as np
    from PIL import Image
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    stage_args, keys = {}, []
    params = SamplingParams(temperature=0.0, max_tokens=engine["max_tokens"])
    if engine.get("stage") == "ar":
        from vllm_omni_plugin.config.settings import OmniSettings
        from vllm_omni_plugin.extra_args import PAYLOAD
        from vllm_omni_plugin.payload_store import PayloadStore

        stage_args = {
            "hf_overrides": {"architectures": ["OmniPluginBagelAR"]},
            "worker_cls": "vllm_omni_plugin.worker.omni_worker.OmniWorker",
            "enable_prefix_caching": False,
            "additional_config": OmniSettings(
                stage_configs_path=spec["yaml"], stage_id=0, entry=False,
                payload_dir=spec["payload_dir"]).additional_config()}
        store = PayloadStore(spec["payload_dir"])
        keys = [f"{engine['name']}.p{i}" for i in range(len(engine["prompts"]))]
        for key in keys:
            store.create(key)
        params = [SamplingParams(temperature=0.0, max_tokens=engine["max_tokens"],
                                 extra_args={PAYLOAD: {"out": key}}) for key in keys]
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True,
              **stage_args, **engine.get("engine_args", {}))
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in engine["prompts"]],
                            params, use_tqdm=False)
        side = llm.llm_engine.model_config.hf_config.vit_config.image_size
        images = []
        for item in engine.get("image_prompts", []):
            pixels = np.random.default_rng(item["seed"]).integers(0, 256, (side, side, 3))
            images.append({"prompt": item["text"], "multi_modal_data": {
                "image": Image.fromarray(pixels.astype(np.uint8))}})
        logprobs = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
        image_outs = llm.generate(images, logprobs, use_tqdm=False) if images else []
        tokenizer = llm.get_tokenizer()
        return {"token_ids": [list(o.outputs[0].token_ids) for o in outs],
                "image_first_logprobs": [
                    next(iter(o.outputs[0].logprobs[0].values())).logprob for o in image_outs],
                "image_prompt_lens": [len(o.prompt_token_ids) for o in image_outs],
                "image_text_lens": [len(tokenizer.encode(item["text"]))
                                    for item in engine.get("image_prompts", [])],
                "keys": keys}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


if __name__ == "__main__":
    sys.exit(run_engines(sys.argv, run_one))

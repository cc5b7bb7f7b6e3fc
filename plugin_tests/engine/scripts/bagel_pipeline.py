"""Drive a real OmniEngineClient on a BAGEL pipeline (the AR stage, then the DiT with
CFG: two EngineCores) in one process, draw :data:`IMAGES` as ``POST
/v1/images/generations`` plans them, and report as JSON on the last stdout line.

Usage: python bagel_pipeline.py [--dtype DTYPE] [--gpu-memory-utilization F] CKPT YAML
OUT_DIR

The report holds ``settings`` (per stage, what vLLM chose for its engine:
``omni_pipeline.engine_settings``) and ``images`` (per image of :data:`IMAGES`, its
request); the images' final latents (float32 ``[h*w, p*p*z]``) and pixels (uint8 ``[H,
W, 3]``) are saved to OUT_DIR/bagel.npz as ``{name}_latent`` and ``{name}_image``.
Each image has a negative prompt, so the text-unconditional CFG branch has a context of
its own, shorter than the prompt's: the DiT attends over contexts of different lengths
(masked attention).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

import numpy as np

#: name -> the image request's fields: two sizes (the 512 px one needs a checkpoint with
#: ``max_latent_size`` 32 or more), CFG on (the checkpoint's default scales), few steps
IMAGES = {
    "64px": {"prompt": "A red apple on a table.", "size": (64, 64), "seed": 1,
             "negative_prompt": "blurry", "extra": {"num_inference_steps": 6}},
    "512px": {"prompt": "A lighthouse at dawn over a calm sea.", "size": (512, 512),
              "seed": 2, "negative_prompt": "blurry", "extra": {"num_inference_steps": 6}},
}


async def main(ckpt, yaml_path, out_dir, dtype="float32", gpu_memory_utilization=0.3):
    from omni_pipeline import engine_settings
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    import vllm_omni_plugin
    from vllm_omni_plugin.engine.omni_request import IMAGE, OmniRequest, omni_request_scope
    from vllm_omni_plugin.entrypoints.images import completion_body
    from vllm_omni_plugin.processors import plan_image
    from vllm_omni_plugin.processors.hookspecs import ImageRequest

    vllm_omni_plugin.register()
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # see omni_pipeline.main
    ns = argparse.Namespace(model=ckpt, dtype=dtype, max_model_len=512,
                            gpu_memory_utilization=gpu_memory_utilization,
                            stage_configs_path=yaml_path, middleware=[])
    config = AsyncEngineArgs.from_cli_args(ns).create_engine_config(UsageContext.OPENAI_API_SERVER)
    client = AsyncLLM.from_vllm_config(config)
    report = {"client_class": type(client).__name__, "images": {}}
    served = {}
    try:
        orchestrator = client.orchestrator
        entry = orchestrator.entry.stage_id
        report["settings"] = {entry: await engine_settings(client)}
        for stage_id, pool in sorted(orchestrator.pools.items()):
            if stage_id != entry:
                report["settings"][stage_id] = await engine_settings(
                    next(iter(pool.replicas.values())).engine)
        hf_config = config.model_config.hf_config
        for name, fields in IMAGES.items():
            request = ImageRequest(model=ckpt, **fields)
            plan = plan_image(hf_config, request)
            omni = OmniRequest(modalities=(IMAGE,), options={"image": plan.options},
                               companions=dict(plan.companions))
            body = completion_body(request, plan.prompt)
            with omni_request_scope(omni):
                async for _ in client.generate(
                        {"prompt": body["prompt"]},
                        SamplingParams(max_tokens=body["max_tokens"],
                                       temperature=body["temperature"]), name):
                    pass
            result = omni.result
            assert result is not None and not result.error, (name, result)
            served[f"{name}_latent"] = result.payload["latent"].float().numpy()
            served[f"{name}_image"] = result.payload["image"].numpy()
            report["images"][name] = {**fields, "size": list(fields["size"])}
    finally:
        client.shutdown()
    np.savez(os.path.join(out_dir, "bagel.npz"), **served)
    print(json.dumps(report))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt")
    parser.add_argument("yaml_path")
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    asyncio.run(main(**vars(parser.parse_args())))

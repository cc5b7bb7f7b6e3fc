"""Run the plugin's BAGEL DiT stage (``OmniPluginBagelDiT``) in a real vLLM engine on a
BAGEL checkpoint, with the official-code fixtures' contexts; print JSON results.

Run as a subprocess by ``plugin_tests/engine/test_bagel_dit_engine.py``. Input: a JSON
spec as ``argv[1]``::

    {"model": "/path/to/checkpoint", "payload_dir": DIR, "fixtures": DIR,
     "yaml": "/path/to/pipeline.yaml",
     "engines": [{"name": "default", "engine_args": {...},
                  "batches": [[{"case": "t2i_cfg_global",     # fixture case
                                "guidance": {...},           # Guidance fields over its knobs
                                "seed": 42, "drop": ["text_uncond"]}, ...], ...]}]}

Each request's input payload is :func:`generation_payload` of the case's context (the
full context for ``cond`` and ``img_uncond``, as the official text-to-image flow builds
them; an empty one at RoPE position 0 for ``text_uncond``; a thinking case's recorded
``cfg_text`` and ``cfg_img`` contexts for those two), ``initial_noise(seed)`` and
its guidance; ``drop`` leaves branches out. An editing case's payload is what the
``bagel_ar2dit`` processor sends: its input image resized (``edit_images``), the
instruction's ids, ``edit_noise(seed)`` and the recorded ``cfg_img`` context.
Output: the last stdout line is
``{"engines": {name: {"batches": [{"keys": [...]}, ...], "memory_profile": ...}}}``; the
results are in the payload store under those keys (``key.err`` on failure). With
``"probe": true`` in an engine's spec, ``memory_profile`` is what
``_engines.memory_profile_calls`` returned for the DiT's first layer and the decoder
(the calls the engine's start-up made: the engine core runs in this process), and
``mask_gathers`` and ``cap`` what :func:`mask_gathers` and :func:`cap_probe` returned.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

from _engines import StartupCalls, memory_profile_calls, run_engines

ARCH = "OmniPluginBagelDiT"
STAGE_ID = 1
BASE_ENGINE_ARGS = {
    "worker_cls": "vllm_omni_plugin.worker.omni_worker.OmniWorker",
    "dtype": "float32",
    "enforce_eager": True,
    "enable_prefix_caching": False,
    # a one-token prompt, then one engine step per Euler step (at most 99)
    "max_model_len": 128,
    "seed": 0,
    "gpu_memory_utilization": 0.2,
    "max_num_seqs": 4,  # the shipped pipelines' DiT cap (dit.MAX_IMAGES_PER_STEP)
}


def _payload(fixtures: Path, request: dict, config):
    """``(payload, Euler steps)`` of ``request``."""
    import torch
    from safetensors.torch import load_file

    from vllm_omni_plugin.models.bagel.dit import (
        Guidance,
        edit_noise,
        generation_payload,
        initial_noise,
    )

    meta = json.loads((fixtures / "reference.json").read_text())["cases"][request["case"]]
    record = load_file(str(fixtures / f"{request['case']}.safetensors"))
    layers = sorted(int(k.rsplit(".", 1)[1]) for k in record if k.startswith("context.k."))

    def context(name: str):
        k = torch.stack([record[f"{name}.k.{i}"] for i in layers])
        v = torch.stack([record[f"{name}.v.{i}"] for i in layers])
        return k, v, k.shape[1]

    knobs = {**meta["knobs"], **request.get("guidance", {})}
    knobs["cfg_interval"] = tuple(knobs["cfg_interval"])
    height, width = meta["height"], meta["width"]
    seed = request.get("seed", meta["seed"])
    guidance = Guidance(**knobs)
    if "input_image.0" in record:  # editing
        from PIL import Image

        from vllm_omni_plugin.models.bagel.editing import edit_images

        count = sum(1 for k in record if k.startswith("input_image."))
        resized = [edit_images(Image.fromarray(record[f"input_image.{i}"].numpy()), config)
                   for i in range(count)]
        eps, noise = edit_noise(seed, [vae.shape[:2] for vae, _ in resized], height, width,
                                config)
        edit = {"text_ids": record["text_ids"]}
        for i, (vae, vit) in enumerate(resized):
            edit.update({f"vae.{i}": torch.from_numpy(vae.copy()),
                         f"vit.{i}": torch.from_numpy(vit.copy()), f"eps.{i}": eps[i]})
        return (generation_payload(noise, height, width, guidance,
                                   {"img_uncond": context("cfg_img")}, edit),
                guidance.num_timesteps - 1)
    cond = context("context")
    empty = cond[0][:, :0]
    branches = {"cond": cond, "text_uncond": (empty, empty, 0), "img_uncond": cond}
    if "cfg_text.k.0" in record:  # a thinking case's contexts
        branches.update(text_uncond=context("cfg_text"), img_uncond=context("cfg_img"))
    for name in request.get("drop", []):
        del branches[name]
    noise = initial_noise(seed, height, width, config)
    return (generation_payload(noise, height, width, guidance, branches),
            guidance.num_timesteps - 1)


def mask_gathers(model) -> dict:
    """The operations of one velocity step (three CFG branches, 4 x 4 latent tokens) that
    index by a boolean mask or call ``nonzero``: each waits for the device."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from vllm_omni_plugin.models.bagel.dit import BRANCHES

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
            if "nonzero" in str(func) or any(isinstance(i, torch.Tensor)
                                             and i.dtype == torch.bool for i in indices):
                self.ops[str(func)] = self.ops.get(str(func), 0) + 1
            return func(*args, **(kwargs or {}))

    dit = model.dit
    device, dtype = dit.marker_embeds.device, dit.marker_embeds.dtype
    attn = dit.layers[0].und.self_attn
    context = torch.zeros(len(dit.layers), 5, attn.kv_size // attn.head_dim, attn.head_dim,
                          dtype=dtype, device=device)
    packed = dit.pack([(context, context, 5)] * len(BRANCHES), 16, device)
    x = torch.zeros(16, dit.latent_dim, device=device)
    pos_embed = torch.zeros(16, dit.hidden_size, dtype=dtype, device=device)
    with torch.inference_mode(), Count() as count:
        dit.velocities([x], [1.0], [pos_embed], [len(BRANCHES)], packed)
    return count.ops


def cap_probe(model) -> dict:
    """A step holding one image more than the engine's ``max_num_seqs`` (vLLM's scheduler
    never makes one, so a stand-in step with empty payloads): ``{"cap": the model's
    bound, "failures": {req_id: error}}``."""
    import torch

    from vllm_omni_plugin.worker.stage_io import ScheduledRequest

    class Step:  # the StageStep interface the model uses
        finished = frozenset()

        def __init__(self, rows):
            self.rows, self.failures = rows, {}

        def params(self, req_id):
            return None

        def requests(self):
            return self.rows

        def inputs(self, req_id):
            return {}

        def failed(self, req_id):
            return req_id in self.failures

        def fail(self, req_id, exc):
            self.failures[req_id] = f"{type(exc).__name__}: {exc}"

    cap = getattr(model, "max_images_per_step", None)
    n = (cap or 4) + 1
    step = Step([ScheduledRequest(f"r{i}", i, 1, 0, 1) for i in range(n)])
    device = model.dit.marker_embeds.device
    model.stage_step = step
    try:
        model(torch.zeros(n, dtype=torch.int32, device=device), torch.arange(n, device=device))
    finally:
        model.stage_step = None
    return {"cap": cap, "failures": step.failures}


def _engine(spec: dict, engine: dict):
    from vllm import LLM

    from vllm_omni_plugin.config.settings import OmniSettings

    return LLM(spec["model"], **{
        **BASE_ENGINE_ARGS,
        "hf_overrides": {"architectures": [ARCH]},
        "additional_config": OmniSettings(
            stage_configs_path=spec["yaml"], stage_id=STAGE_ID, entry=False,
            payload_dir=spec["payload_dir"]).additional_config(),
        **engine.get("engine_args", {})})


def run_one(spec: dict, engine: dict) -> dict:
    from vllm import SamplingParams

    from vllm_omni_plugin.extra_args import PAYLOAD
    from vllm_omni_plugin.payload_store import PayloadStore

    store = PayloadStore(spec["payload_dir"])
    startup = StartupCalls()
    try:
        llm = _engine(spec, engine)
    finally:
        startup.stop()
    config = llm.llm_engine.model_config.hf_config
    batches = []
    try:
        for b, requests in enumerate(engine["batches"]):
            keys = [f"{engine['name']}.b{b}.r{i}" for i in range(len(requests))]
            params = []
            for key, request in zip(keys, requests, strict=True):
                store.create(key)
                payload, steps = _payload(Path(spec["fixtures"]), request, config)
                store.put(f"{key}.in", payload)
                params.append(SamplingParams(temperature=0.0, max_tokens=steps,
                                             ignore_eos=True, detokenize=False,
                                             extra_args={PAYLOAD: {"in": f"{key}.in",
                                                                   "out": key,
                                                                   "err": f"{key}.err"}}))
            llm.generate([{"prompt_token_ids": [0]}] * len(requests), params, use_tqdm=False)
            batches.append({"keys": keys})
        profile = llm.collective_rpc(memory_profile_calls, args=(
            lambda model: {"layer": model.dit.layers[0], "decoder": model.dit.vae},
            startup.calls))[0] if engine.get("probe") else None
        gathers = llm.apply_model(mask_gathers)[0] if engine.get("probe") else None
        cap = llm.apply_model(cap_probe)[0] if engine.get("probe") else None
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return {"batches": batches, "memory_profile": profile, "mask_gathers": gathers,
            "cap": cap}


if __name__ == "__main__":
    sys.exit(run_engines(sys.argv, run_one))

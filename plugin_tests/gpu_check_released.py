"""``gpu_check --released DIR``: a released checkpoint (Qwen3-Omni-30B-A3B-Instruct or
BAGEL-7B-MoT, downloaded to ``DIR``) served on this host's GPUs with a memory plan (a
shipped ``stage_configs/*_1xh200.yaml``-like plan or a plan tool YAML: ``--plan``,
default: the one ``--stage-configs-path auto`` serves on the visible GPUs,
:func:`resolve_plan`), one request answered, and each
engine's KV cache as vLLM sized it against what the plan tool planned for it.

Three child processes, one after the other: the plan tool's plan for ``DIR`` (the
command in the plan YAML's first line, ``MODEL`` replaced by ``DIR``; it builds the
stages on the meta device, which needs vLLM's process-global distributed state), then the
pipeline serving one request (:func:`serve`: an in-process ``OmniEngineClient``, as
``plugin_tests/engine/scripts/omni_pipeline.py`` drives the tiny one), each printing JSON
on its last stdout line. The report gives per stage the modes vLLM chose (checked as the
tiny cases' are: ``gpu_check.EXPECTED_MODES``), its KV cache in tokens and GiB, the
plan's, and their ratio.

Exit status 0 when every stage started with the modes expected, the request was
answered, and every stage with a KV cache got at least :data:`KV_FLOOR` of the plan's.

    python -m plugin_tests.gpu_check --released ~/Qwen3-Omni-30B-A3B-Instruct
    python -m plugin_tests.gpu_check --released ~/BAGEL-7B-MoT --plan bagel_1xh100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from vllm_omni_plugin.config.placement import GIB

#: the least share of its planned KV cache (tokens) a stage may get: the plan estimates
#: activation peaks from vLLM's GPU scheduler defaults but leaves out the multimodal
#: encoder's profile and CUDA graph pools beyond a flat overhead, so a GPU engine may get
#: less; under this the plan is too optimistic to rely on
KV_FLOOR = 0.8
#: Seconds: bound on each child process (the released thinker loads 59 GiB of weights)
TIMEOUT_S = 3600
#: the plan tool's command as a plan YAML's first line names it
_WRITTEN_BY = re.compile(r"^# Written by: python -m vllm_omni_plugin\.tools\.plan MODEL (.*)$")
#: what the plan tool's summary line says a plan fits on (GPU plans)
_FITS_ON = re.compile(r"^# fits on (\d+) x ([\d.]+) GiB")


def plan_header(path: str) -> tuple[list[str], tuple[int, float] | None, int | None]:
    """``(plan tool arguments after MODEL, (GPU count, GiB each) it fits on, its
    --max-model-len)`` from a plan YAML's header (``tools/plan.py``'s ``plan_yaml``).

    Raises:
        ValueError: the YAML has no plan tool header (a pipeline, not a plan).
    """
    lines = Path(path).read_text().splitlines()[:3]
    match = _WRITTEN_BY.match(lines[0]) if lines else None
    if match is None:
        raise ValueError(f"{path} is not a plan (no '# Written by: python -m "
                         "vllm_omni_plugin.tools.plan MODEL ...' first line): write one with "
                         "the plan tool")
    args = shlex.split(match.group(1))
    fits = next(((int(m.group(1)), float(m.group(2))) for line in lines
                 if (m := _FITS_ON.match(line))), None)
    max_model_len = next((int(args[i + 1]) for i, a in enumerate(args[:-1])
                          if a == "--max-model-len"), None)
    return args, fits, max_model_len


def resolve_plan(plan: str | None, model_dir: Path, host) -> str:
    """The plan YAML's path: ``plan`` (a file or a shipped name), or what ``vllm serve
    DIR --stage-configs-path auto`` serves on ``host`` (a ``config.placement.Host``; the
    plan lookup of ``config/auto_plan.py``: the shipped plan that fits its GPUs).

    Raises:
        StageConfigError: no plan fits (names the plan tool command for these GPUs).
        ValueError: the checkpoint has no config.json, or the YAML is not a plan (the
            lookup kept the pipeline: the checkpoint fits its shares).
    """
    from vllm_omni_plugin.config.auto_plan import choose
    from vllm_omni_plugin.config.pipelines import AUTO, resolve_stage_configs

    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} has no config.json: not a checkpoint directory")
    path = resolve_stage_configs(plan or AUTO, str(model_dir))
    if plan is None:
        path = choose(Path(path).stem, path, str(model_dir), None, host, None, auto=True)
    plan_header(path)  # a plan, with the command that made it
    return path


def _child(argv: list[str], timeout: float = TIMEOUT_S) -> dict:
    """Run ``python -m plugin_tests.gpu_check_released ARGV`` and return its JSON."""
    from plugin_tests.helpers import run_process_group

    proc = run_process_group([sys.executable, "-m", "plugin_tests.gpu_check_released", *argv],
                             timeout=timeout, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=Path(__file__).resolve().parents[1])
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not lines[-1].startswith("{"):
        raise RuntimeError(f"{argv[0]} exited {proc.returncode}: {proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def planned(plan_path: str, model_dir: str) -> dict:
    """Stage id (str) -> ``{"name", "kv_tokens", "kv_bytes", "kv_per_token", "share"}``:
    the plan tool's plan for ``model_dir`` by the command in the plan's header (run in
    this process: see the module docstring)."""
    from vllm_omni_plugin.tools.plan import plan_from_args

    args, _, _ = plan_header(plan_path)
    plan, _ = plan_from_args([model_dir, *args])
    return {str(s.stage_id): {"name": s.name, "kv_tokens": s.kv_tokens, "kv_bytes": s.kv_bytes,
                              "kv_per_token": s.kv_per_token, "share": s.share}
            for s in plan.stages}


async def serve(model_dir: str, plan_path: str) -> dict:
    """Start the plan's pipeline on ``model_dir``, answer one request (Qwen3-Omni: a chat
    turn with speech; BAGEL: a 512 px image) and report ``{"settings": {stage: ...},
    "kv": {stage: {"blocks", "block_size"}}, "answer": ...}``."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    import vllm_omni_plugin
    from plugin_tests.engine.scripts.omni_pipeline import engine_settings
    from vllm_omni_plugin.engine.omni_request import (
        AUDIO,
        IMAGE,
        TEXT,
        OmniRequest,
        omni_request_scope,
    )

    vllm_omni_plugin.register()
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # see omni_pipeline.main
    _, _, max_model_len = plan_header(plan_path)
    ns = argparse.Namespace(model=model_dir, max_model_len=max_model_len,
                            stage_configs_path=plan_path, middleware=[])
    config = AsyncEngineArgs.from_cli_args(ns).create_engine_config(UsageContext.OPENAI_API_SERVER)
    client = AsyncLLM.from_vllm_config(config)
    report = {"settings": {}, "kv": {}}
    try:
        orchestrator = client.orchestrator
        engines = {orchestrator.entry.stage_id: client}
        for stage_id, pool in orchestrator.pools.items():
            engines.setdefault(stage_id, next(iter(pool.replicas.values())).engine)
        for stage_id, engine in sorted(engines.items()):
            report["settings"][stage_id] = await engine_settings(engine)
            cache = engine.vllm_config.cache_config
            report["kv"][stage_id] = {"blocks": cache.num_gpu_blocks or 0,
                                      "block_size": cache.block_size}
        if config.model_config.hf_config.model_type == "bagel":
            from plugin_tests.engine.scripts.bagel_pipeline import IMAGES
            from vllm_omni_plugin.entrypoints.images import completion_body
            from vllm_omni_plugin.processors import plan_image
            from vllm_omni_plugin.processors.hookspecs import ImageRequest

            request = ImageRequest(model=model_dir, **IMAGES["512px"])
            image = plan_image(config.model_config.hf_config, request)
            omni = OmniRequest(modalities=(IMAGE,), options={"image": image.options},
                               companions=dict(image.companions))
            prompt = {"prompt": completion_body(request, image.prompt)["prompt"]}
            params = SamplingParams(max_tokens=1, temperature=0.0)
        else:
            from transformers import AutoTokenizer

            omni = OmniRequest(modalities=(TEXT, AUDIO))
            prompt = {"prompt": AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
                [{"role": "user", "content": "Say hello."}], add_generation_prompt=True,
                tokenize=False)}
            params = SamplingParams(max_tokens=32, temperature=0.0)
        final = None
        with omni_request_scope(omni):
            async for out in client.generate(prompt, params, "released"):
                final = out
        result = omni.result
        report["answer"] = {
            "error": getattr(result, "error", "no result") if result is None or result.error
            else None,
            "text": final.outputs[0].text if final is not None else None,
            "payload": {k: list(getattr(v, "shape", ())) for k, v in
                        (result.payload.items() if result is not None else ())}}
    finally:
        client.shutdown()
    return report


def verdict(served: dict, plan: dict) -> tuple[list[str], list[str]]:
    """``(report lines, problems)`` of a served released pipeline against its plan."""
    from plugin_tests.gpu_check import EXPECTED_MODES, _short, mode_problems

    lines, problems = [], []
    for stage, kv in sorted(served["kv"].items(), key=lambda i: int(i[0])):
        want = plan.get(str(stage), {})
        tokens = kv["blocks"] * kv["block_size"]
        line = f"stage {stage} {want.get('name', '?')}: {_short(served['settings'][stage])}"
        if want.get("kv_tokens"):
            ratio = tokens / want["kv_tokens"]
            line += (f"; KV {tokens:,} tokens ({tokens * want['kv_per_token'] / GIB:.2f} GiB) "
                     f"vs planned {want['kv_tokens']:,} ({want['kv_bytes'] / GIB:.2f} GiB): "
                     f"{ratio:.2f}")
            if ratio < KV_FLOOR:
                problems.append(f"stage {stage}: KV cache {ratio:.2f} of the plan's (under "
                                f"{KV_FLOOR:g})")
        else:
            line += "; no KV cache (planned none)"
        lines.append(line)
    eager = served.get("eager", {})
    problems.extend(mode_problems(served["settings"], EXPECTED_MODES["gpu"],
                                  {int(k): v for k, v in eager.items()}))
    answer = served.get("answer") or {}
    if answer.get("error") is not None:
        problems.append(f"the request failed: {answer['error']}")
    lines.append(f"answer: {answer.get('text', '')!r}; payload {answer.get('payload')}")
    return lines, problems


def main(args, parser) -> int:
    """``gpu_check --released DIR [--plan NAME|YAML]``: see the module docstring."""
    from plugin_tests.gpu_check import pipeline_eager

    if args.cpu:
        parser.error("--released serves a released checkpoint on GPUs: drop --cpu")
    from vllm_omni_plugin.config.placement import Host
    from vllm_omni_plugin.config.schema import StageConfigError

    model_dir = args.released.expanduser().resolve()
    host = Host.current(device_memory=True)
    if host.is_cpu or not host.devices:
        parser.error("--released needs a visible CUDA device")
    try:
        plan_path = resolve_plan(args.plan, model_dir, host)
    except (StageConfigError, ValueError) as exc:
        parser.error(str(exc))
    print(f"[gpu_check] {model_dir} with the plan {plan_path} ...", file=sys.stderr, flush=True)
    plan = _child(["plan", plan_path, str(model_dir)])
    served = _child(["serve", plan_path, str(model_dir)])
    served["eager"] = pipeline_eager(plan_path)
    lines, problems = verdict(served, plan)
    print("\n".join([f"gpu_check --released {model_dir}: plan {plan_path} on "
                     f"{len(host.devices)} GPU(s) of {host.memory_bytes / GIB:.1f} GiB", *lines,
                     *(f"  {p}" for p in problems), "ok" if not problems else "FAILED"]))
    if args.json:
        args.json.write_text(json.dumps({"plan": plan, "served": served,
                                         "problems": problems}, indent=1))
    return 0 if not problems else 1


if __name__ == "__main__":
    what, plan_path, model_dir = sys.argv[1:4]
    out = planned(plan_path, model_dir) if what == "plan" else \
        asyncio.run(serve(model_dir, plan_path))
    print(json.dumps(out))

"""Drive a real OmniEngineClient (three EngineCores on vLLM's worker and model runner)
in one process and report what each scenario observed as JSON on the last stdout line.

Usage: python omni_pipeline.py [--dtype DTYPE] [--gpu-memory-utilization F] CKPT YAML
OUT_DIR SCENARIO [SCENARIO ...]

The report always holds ``settings``: per stage, what vLLM chose for its engine
(:func:`engine_settings`). Scenarios: parity (each of :data:`PROMPTS` alone, with audio
and text-only, then :data:`CONCURRENT` requests cycling through them at once; codes and
waveforms saved to OUT_DIR/served.npz as ``{solo,concurrent}_{codes,waveform}_{i}``),
streamed (the parity requests as the API layer streams them: the talker fed while the
thinker runs, code2wav in chunks; saved as ``streamed_{solo,concurrent}_...`` alike,
and per talker task whether it got a growing input), media (one request per file in
OUT_DIR/media: ``image.png``, ``audio.wav``; the user turn is the medium then
:data:`MEDIA_TEXT`; codes and waveforms saved to OUT_DIR/media.npz as
``{image,audio}_{codes,waveform}``), cancel (client disconnect while the talker engine
holds the request), abort (explicit abort(), likewise), liveness (the canaries of
``compat.internals.engine_processes`` and ``liveness_probe`` on the talker's engine, see
:func:`liveness_canary`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import numpy as np

PROMPTS = ["Say hello", "Tell me a story about a cat", "What is two plus two?", "hi"]
CONCURRENT = 8
MEDIA_TEXT = "What is this?"


#: A system message of a few hundred tokens: the prompts of the prefix-caching scenario
#: fill whole KV blocks (128 positions on vLLM's CPU build) with it
LONG_SYSTEM = " ".join(["the quick brown fox jumps over the lazy dog"] * 40)

#: Seconds: bound on waiting for a request to reach the talker, and for the pipeline to
#: clean up after an abort
WAIT_S = 120.0
#: Seconds a stopped EngineCore is given to answer a liveness probe (an idle one answers
#: in milliseconds; far below the stall timeout of the pipeline's talker, 120 s)
STOPPED_PROBE_S = 3.0


async def _wait_for(pred, timeout=WAIT_S) -> bool:
    """True as soon as ``pred()`` holds (polled every 10 ms); its last value after
    ``timeout`` seconds. Returns to the caller without yielding to the event loop once
    it holds, so the caller acts while it still does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(0.01)
    return pred()


def chat_prompt_ids(tokenizer) -> list[list[int]]:
    """:data:`PROMPTS` as user turns through the chat template: the token ids served."""
    return [tokenizer(tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False).input_ids for text in PROMPTS]


def _model_runner(worker) -> str:
    """The qualified class name of ``worker``'s model runner (run in each worker)."""
    runner = getattr(worker, "worker", worker).model_runner
    return f"{type(runner).__module__}.{type(runner).__qualname__}"


def _gloo_loops(_worker) -> int:
    """How many gloo loop threads (``gloo_tcp_loop``) the worker's process runs."""
    tasks = f"/proc/{os.getpid()}/task"
    return sum(open(f"{tasks}/{t}/comm").read().strip() == "gloo_tcp_loop"
               for t in os.listdir(tasks))


def _is_engine_core(process) -> bool:
    return "EngineCore" in " ".join([process.name(), *process.cmdline()])


async def liveness_canary(engine, other) -> dict:
    """What the stall watch relies on, on a real stage engine (``engine``, an ``AsyncLLM``
    idle in the pipeline; ``other``: another stage's): ``engine_processes`` gives the pid
    of an EngineCore process this process started; its liveness probe is answered, is not
    while that process is stopped (SIGSTOP) though the other engine's is, and is again once
    it is continued (SIGCONT). Returns what was seen, for the test to judge."""
    import signal

    import psutil

    from vllm_omni_plugin.compat.internals import engine_processes, liveness_probe

    async def answered(eng, timeout) -> float | None:
        start = time.monotonic()
        try:
            await asyncio.wait_for(liveness_probe(eng), timeout)
        except asyncio.TimeoutError:
            return None
        return time.monotonic() - start

    processes = engine_processes(engine) or []
    seen = {"pids": [p.pid for p in processes],
            "engine_core_children": sorted(p.pid for p in psutil.Process().children()
                                           if _is_engine_core(p)),
            "answered_before_s": await answered(engine, WAIT_S)}
    if len(processes) != 1:
        return seen
    pid = processes[0].pid
    seen["workers"] = [p.pid for p in psutil.Process(pid).children(recursive=True)]
    os.kill(pid, signal.SIGSTOP)
    try:
        seen["answered_stopped_s"] = await answered(engine, STOPPED_PROBE_S)
        seen["other_answered_s"] = await answered(other, WAIT_S)
    finally:
        os.kill(pid, signal.SIGCONT)
    seen["answered_after_s"] = await answered(engine, WAIT_S)
    return seen


async def engine_settings(engine) -> dict:
    """What vLLM chose for a stage engine (an ``AsyncLLM``): its workers' model runner,
    CUDA graph mode, async scheduling, tensor parallel size and dtype; and how many gloo
    loop threads each worker runs."""
    config = engine.vllm_config
    return {
        "model_runner": sorted(set(await engine.collective_rpc(_model_runner))),
        "gloo_loops": await engine.collective_rpc(_gloo_loops),
        "block_size": config.cache_config.block_size,
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
    }


async def main(ckpt, yaml_path, out_dir, scenarios, dtype="float32",
               gpu_memory_utilization=0.3):
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    import vllm_omni_plugin
    from vllm_omni_plugin.engine.omni_request import OmniRequest, omni_request_scope

    vllm_omni_plugin.register()
    # engine_settings asks each worker for its model runner by a function (pickled):
    # vLLM's msgpack frames take one only with this set, before the engines start
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    # gpu_memory_utilization: on vLLM's CPU build, the share of host memory that must be
    # free at start-up (the KV cache is sized by VLLM_CPU_KVCACHE_SPACE); on a GPU, each
    # engine's share of the device.
    ns = argparse.Namespace(model=ckpt, dtype=dtype, max_model_len=2048,
                            gpu_memory_utilization=gpu_memory_utilization,
                            stage_configs_path=yaml_path, middleware=[])
    config = AsyncEngineArgs.from_cli_args(ns).create_engine_config(UsageContext.OPENAI_API_SERVER)
    client = AsyncLLM.from_vllm_config(config)
    report = {"client_class": type(client).__name__}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    prompts = chat_prompt_ids(tokenizer)
    report["prompt_ids"] = [list(p) for p in prompts]

    results = {}

    async def run(request_id, prompt_ids=prompts[0], prompt=None, modalities=("text", "audio"),
                  streamed=False):
        """The final output; the pipeline's result lands in ``results[request_id]``."""
        final = None
        request = OmniRequest(modalities=modalities)
        if streamed:  # as the API layer marks a request it streams to the client
            request.partials = asyncio.Queue()
        prompt = prompt or TokensPrompt(prompt_token_ids=prompt_ids)
        try:
            with omni_request_scope(request):
                async for out in client.generate(prompt,
                                                 SamplingParams(temperature=0, max_tokens=12),
                                                 request_id):
                    final = out
        finally:
            if request.result is not None:
                results[request_id] = request.result
        return final

    async def served_alone_and_batched(streamed: bool) -> None:
        """The parity requests alone, then :data:`CONCURRENT` at once; codes and
        waveforms into ``served.npz`` (``streamed.npz``)."""
        prefix = "streamed_" if streamed else ""
        served, tokens = {}, report.setdefault(f"{prefix}thinker_tokens", {})

        def keep(kind, i, final):
            result = results.pop(f"{prefix}{kind}{i}", None)
            assert result is not None and result.error is None, result
            served[f"{kind}_codes_{i}"] = result.stage_outputs[1].payload["codes"].numpy()
            served[f"{kind}_waveform_{i}"] = result.payload["waveform"].numpy()
            tokens[f"{kind}_{i}"] = list(final.outputs[0].token_ids)
            report["sample_rate"] = result.sample_rate

        for i, prompt in enumerate(prompts):
            keep("solo", i, await run(f"{prefix}solo{i}", prompt, streamed=streamed))
            if not streamed:
                text = await run(f"text{i}", prompt, modalities=("text",))
                tokens[f"text_{i}"] = list(text.outputs[0].token_ids)
        finals = await asyncio.gather(*(
            run(f"{prefix}concurrent{i}", prompts[i % len(prompts)], streamed=streamed)
            for i in range(CONCURRENT)))
        for i, final in enumerate(finals):
            keep("concurrent", i, final)
        np.savez(os.path.join(out_dir, f"{'streamed' if streamed else 'served'}.npz"),
                 **served)

    orchestrator = client.orchestrator
    talker = orchestrator.pools[1].replicas[0].engine
    try:
        entry = orchestrator.entry.stage_id
        report["settings"] = {entry: await engine_settings(client)}
        for stage_id, pool in sorted(orchestrator.pools.items()):
            if stage_id != entry:
                replica = next(iter(pool.replicas.values()))
                report["settings"][stage_id] = await engine_settings(replica.engine)
        if "streamed" in scenarios:
            report["talker_fed"] = fed = {}
            pool = orchestrator.pools[1]
            pool_run = pool.run

            async def spy(task, on_rows=None):
                fed[task.request_id] = task.growth is not None
                return await pool_run(task, on_rows)

            pool.run = spy
            await served_alone_and_batched(streamed=True)
            pool.run = pool_run
        if "parity" in scenarios:
            await served_alone_and_batched(streamed=False)
            prefill = orchestrator.prefill
            report["prefill_requests"] = sum(
                r.requests_total
                for r in orchestrator.pools[prefill.stage_id].replicas.values()
            ) if prefill is not None else None
        if "media" in scenarios:
            report["media"] = {}
            served = {}
            for kind, data in _media(tokenizer, os.path.join(out_dir, "media")).items():
                final = await run(kind, prompt=data)
                result = results.pop(kind, None)
                assert result is not None and result.error is None, (kind, result)
                served[f"{kind}_codes"] = result.stage_outputs[1].payload["codes"].numpy()
                served[f"{kind}_waveform"] = result.payload["waveform"].numpy()
                report["media"][kind] = {"prompt_ids": list(final.prompt_token_ids),
                                         "thinker_tokens": list(final.outputs[0].token_ids)}
            np.savez(os.path.join(out_dir, "media.npz"), **served)
        if "prefix" in scenarios:
            report["prefix"], served = {}, {}
            # with PD, the prefill stage's engine: the blocks its row cache served
            prefill = orchestrator.prefill
            prefill_engine = None if prefill is None else next(
                iter(orchestrator.pools[prefill.stage_id].replicas.values())).engine

            async def prefill_hit_blocks() -> int | None:
                if prefill_engine is None:
                    return None
                stats = await prefill_engine.collective_rpc("omni_row_cache_stats")
                return stats[0]["hit_blocks"] if stats[0] is not None else 0

            async def cold_then_warm(case, cold, warm):
                for kind, prompt in (("cold", cold), ("warm", warm)):
                    before = await prefill_hit_blocks()
                    final = await run(f"{case}_{kind}", prompt=prompt)
                    result = results.pop(f"{case}_{kind}")
                    assert result.error is None, (case, kind, result)
                    served[f"{case}_{kind}_codes"] = \
                        result.stage_outputs[1].payload["codes"].numpy()
                    served[f"{case}_{kind}_waveform"] = result.payload["waveform"].numpy()
                    after = await prefill_hit_blocks()
                    report["prefix"].setdefault(case, {})[kind] = {
                        "tokens": list(final.outputs[0].token_ids),
                        "prompt_tokens": len(final.prompt_token_ids),
                        "cached": final.num_cached_tokens,
                        "prefill_hit_blocks": None if after is None else after - before}

            cases = _prefix_prompts(tokenizer, os.path.join(out_dir, "media"))
            for case in ("text", "audio"):  # the same prompt twice: warm the second time
                await cold_then_warm(case, cases[case], cases[case])
            first = await run("turn1", prompt=cases["turn1"])
            results.pop("turn1")
            answer = tokenizer.decode(first.outputs[0].token_ids, skip_special_tokens=True)
            await cold_then_warm("two_turns", cases["turn2"](answer, "conversation-cold"),
                                 cases["turn2"](answer, "conversation"))
            np.savez(os.path.join(out_dir, "prefix.npz"), **served)
        for scenario in ("cancel", "abort"):
            if scenario not in scenarios:
                continue
            task = asyncio.create_task(run(scenario))
            # stopped while the talker stage runs it and the talker engine holds it
            # unfinished: both still hold when the cancel or abort below is issued
            in_talker = await _wait_for(lambda scenario=scenario: scenario in orchestrator.runs
                and any(s == 1 for s, _ in orchestrator.runs[scenario].tasks)
                and talker.output_processor.get_num_unfinished_requests() > 0)
            if scenario == "cancel":
                task.cancel()
            else:
                await client.abort(scenario)
            try:
                await task
            except asyncio.CancelledError:
                pass

            def left(scenario=scenario) -> dict:
                return {
                    "talker_unfinished": talker.output_processor.get_num_unfinished_requests(),
                    "payload_dirs_left": sorted(os.listdir(orchestrator.store.root)),
                    "inflight_left": scenario in orchestrator.runs,
                }

            await _wait_for(lambda: left() == {"talker_unfinished": 0, "payload_dirs_left": [],
                                               "inflight_left": False})
            report[scenario] = {"was_in_talker": in_talker,
                                "result_stored": results.pop(scenario, None) is not None,
                                **left()}
        if "liveness" in scenarios:
            code2wav = next(iter(orchestrator.pools[2].replicas.values())).engine
            report["liveness"] = await liveness_canary(talker, code2wav)
        after = await run("after")
        result = results.pop("after", None)
        report["after_ok"] = bool(after and after.finished and result and result.error is None)
    finally:
        client.shutdown()
    print(json.dumps(report))


def _prefix_prompts(tokenizer, folder) -> dict:
    """The prefix-caching scenario's prompts, each after :data:`LONG_SYSTEM`: ``text`` and
    ``audio`` (one user turn, with an audio clip for ``audio``), ``turn1`` (the same audio
    turn, under the cache salt ``conversation``) and ``turn2(answer, salt)``: turn 1, the
    assistant's ``answer``, a second audio turn."""
    import soundfile as sf

    clip = sf.read(os.path.join(folder, "audio.wav"), dtype="float32")
    system = {"role": "system", "content": LONG_SYSTEM}
    heard = {"role": "user", "content": [{"type": "audio"},
                                         {"type": "text", "text": MEDIA_TEXT}]}

    def prompt(messages, salt, clips=()):
        # token ids without media, as vLLM's API server hands a text chat to the engine
        # (and the PD pipeline to its prefill stage); text with them
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
        if not clips:
            return {"prompt_token_ids": tokenizer(text).input_ids, "cache_salt": salt}
        return {"prompt": text, "cache_salt": salt,
                "multi_modal_data": {"audio": clips[0] if len(clips) == 1 else list(clips)}}

    return {
        "text": prompt([system, {"role": "user", "content": "Say hello"}], "text"),
        "audio": prompt([system, heard], "audio", [clip]),
        "turn1": prompt([system, heard], "conversation", [clip]),
        "turn2": lambda answer, salt: prompt(
            [system, heard, {"role": "assistant", "content": answer}, heard], salt,
            [clip, clip]),
    }


def _media(tokenizer, folder) -> dict:
    """kind -> vLLM prompt (chat-template text plus the decoded medium) per file present."""
    import soundfile as sf
    from PIL import Image

    out = {}
    for kind, name in (("image", "image.png"), ("audio", "audio.wav")):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            continue
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": MEDIA_TEXT}]}],
            add_generation_prompt=True, tokenize=False)
        if kind == "image":
            data = Image.open(path).convert("RGB")
        else:
            samples, rate = sf.read(path, dtype="float32")
            data = (samples, rate)
        out[kind] = {"prompt": text, "multi_modal_data": {kind: data}}
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt")
    parser.add_argument("yaml_path")
    parser.add_argument("out_dir")
    parser.add_argument("scenarios", nargs="+")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    asyncio.run(main(**vars(parser.parse_args())))

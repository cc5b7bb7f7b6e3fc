"""What publishing the thinker's rows costs: decode steps/s of one thinker engine with
requests that publish their rows (audio requests) vs the same requests text-only.

One vLLM engine of the thinker stage (``OmniPluginQwen3OmniThinker`` on the plugin's
``OmniWorker``, vLLM's CPU build here) with a payload store where a served pipeline
keeps it (``/dev/shm``), in this process's child EngineCore. Each trial is one
``generate`` of ``--batch`` requests decoding ``--tokens`` tokens each (greedy,
``ignore_eos``), text-only and publishing one after the other (the order alternating
per trial). A publishing request has an output key: every step the worker copies its
rows (``embed``, ``hidden``, ``positions``) to the host and appends them to the store,
as for an audio chat. Steps/s is ``--tokens`` divided by the trial's wall time (one
decode step per token; the prefill is one more step).

Prints the median steps/s of each kind and the median and range of the per-trial ratio
text-only ÷ publishing (issue 27's target: ≤ 1.10).

    .venv/bin/python benchmarks/publish_bench.py                 # 7 trials, 16 x 64 tokens
    .venv/bin/python benchmarks/publish_bench.py --batch 32 --trials 9
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fmt, make_checkpoint, median, table  # noqa: E402

from vllm_omni_plugin.config.pipelines import builtin_pipeline  # noqa: E402

YAML = Path(builtin_pipeline("qwen3_omni_moe"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16, help="requests per trial")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each request decodes")
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--model", help="checkpoint (default: the tiny one, built here)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm import LLM, SamplingParams

    from vllm_omni_plugin.config.settings import OmniSettings
    from vllm_omni_plugin.extra_args import PAYLOAD
    from vllm_omni_plugin.payload_store import PayloadStore, default_run_dir

    with tempfile.TemporaryDirectory(prefix="publish-bench-") as tmp:
        model = args.model
        if model is None:
            model = str(Path(tmp) / "ckpt")
            make_checkpoint(Path(model))
        payload_dir = default_run_dir()  # /dev/shm, as a served pipeline's
        store = PayloadStore(payload_dir)
        llm = LLM(model, hf_overrides={"architectures": ["OmniPluginQwen3OmniThinker"]},
                  worker_cls="vllm_omni_plugin.worker.omni_worker.OmniWorker",
                  max_model_len=512, dtype="float32", enforce_eager=True, seed=0,
                  gpu_memory_utilization=0.2, enable_prefix_caching=False,
                  additional_config=OmniSettings(
                      stage_configs_path=str(YAML), stage_id=0, entry=False,
                      payload_dir=payload_dir).additional_config())
        prompts = [{"prompt_token_ids": [10 + i, 20, 30, 40, 50, 60, 70, 80]}
                   for i in range(args.batch)]

        def trial(publish: bool, n: int) -> float:
            keys = [f"t{n}.p{i}" for i in range(args.batch)] if publish else \
                [None] * args.batch
            for key in filter(None, keys):
                store.create(key)
            params = [SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True,
                                     extra_args={PAYLOAD: {"out": key}} if key else None)
                      for key in keys]
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            for key in filter(None, keys):
                rows = store.get(key)["embed"].shape[0]
                assert rows == len(prompts[0]["prompt_token_ids"]) + args.tokens - 1, rows
                store.delete(key)
            return args.tokens / seconds

        trial(False, -1), trial(True, -2)  # warm-up
        text, publishing = [], []
        for n in range(args.trials):
            order = (False, True) if n % 2 == 0 else (True, False)
            for publish in order:
                (publishing if publish else text).append(trial(publish, n))
        ratios = [t / p for t, p in zip(text, publishing, strict=True)]
        print(table(
            ["batch x tokens", "text-only steps/s", "publishing steps/s",
             "text ÷ publishing (median)", "range"],
            [[f"{args.batch} x {args.tokens}", fmt(median(text)), fmt(median(publishing)),
              fmt(median(ratios), ".3f"), f"{min(ratios):.3f}-{max(ratios):.3f}"]],
            title=f"thinker decode steps/s, {args.trials} paired trials"))
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

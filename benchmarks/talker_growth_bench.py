"""Per growth of a streamed talker input, a long user turn vs a short one: what the
talker and the API server do each time the thinker's output grows, before and after a
change, side by side in one run.

A chat streamed with audio feeds the talker while the thinker runs (the pipeline's
``stream_input``): each thinker token grows the talker's input by one row. Per growth,

* **talker**: ``Qwen3OmniTalkerStage._state`` on the grown input payload (the worker's
  growing input, a ``GrowingPayload``): the thinker rows it moves to the talker's device
  and the prompt it derives from them (the rest of a talker step, the decoder and the
  code predictor, does not depend on the input's length);
* **API server**: ``StageStreams.run_streaming_input``'s growth on a real
  ``InputStream`` over a payload store in a temporary directory: reading the new rows,
  ``thinker2talker`` on the output so far, and the rows sent.

The talker's projections and codec embedding are random modules of the tiny checkpoint's
widths (``--thinker-width``/``--talker-width`` for others, e.g. the released 2048/1024);
no engine starts. The code measured is this checkout's (``after``) and, with
``--before REV``, a ``git worktree`` of ``REV`` (``before``); each trial runs both in
child processes, order alternating, and prints ms per growth (median over the
``--tokens`` growths of one chat) for a ``--long`` and a ``--short`` user turn: CPU time
of the child (one torch thread), so other work on a shared host does not count. The
child is this file, so ``REV`` must have its API (``StageStreams`` taking a
``PipelineRun`` and processors a ``StageRequest``: from the commit that added them on;
the figures of the change before that are in benchmarks/README.md).

    .venv/bin/python benchmarks/talker_growth_bench.py --before REV
    .venv/bin/python benchmarks/talker_growth_bench.py --before REV --thinker-width 2048 \\
        --talker-width 1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, fmt, make_checkpoint, median, table  # noqa: E402

FILLER = 40  # a text token id of the tiny vocabulary


# -- the child: one code tree, both turns ---------------------------------------------------
#: CPU time of this process (its threads included): the other work on a shared host
#: does not count (a talker on a device is timed by the wall clock instead).
_clock = time.process_time


def _config(ckpt: Path, thinker_width: int | None, talker_width: int | None):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(ckpt))
    if thinker_width:
        config.talker_config.thinker_hidden_size = thinker_width
    if talker_width:
        config.talker_config.text_config.hidden_size = talker_width
        config.talker_config.text_config.intermediate_size = 2 * talker_width
    return config


def _talker(config, device: str):
    """The talker stage's prompt path on random projections of the config's widths."""
    import torch
    from torch import nn

    from vllm_omni_plugin.models.qwen3_omni.talker import Qwen3OmniTalkerStage

    class Projection(nn.Module):
        def __init__(self, inner: int, mid: int, outer: int):
            super().__init__()
            self.linear_fc1, self.linear_fc2 = nn.Linear(inner, mid), nn.Linear(mid, outer)

        def forward(self, x):
            return self.linear_fc2(torch.nn.functional.silu(self.linear_fc1(x)))

    tc = config.talker_config
    widths = (tc.thinker_hidden_size, tc.text_config.intermediate_size, tc.text_config.hidden_size)
    stage = Qwen3OmniTalkerStage.__new__(Qwen3OmniTalkerStage)
    nn.Module.__init__(stage)
    stage.model = nn.Module()
    stage.model.embed_tokens = nn.Embedding(tc.text_config.vocab_size, widths[2])
    stage.text_projection, stage.hidden_projection = Projection(*widths), Projection(*widths)
    stage.omni_config = config
    stage.speakers = {v: k for k, v in tc.speaker_id.items()}
    stage._requests = {}
    return stage.to(device).eval()


class _Step:
    """The worker's view of the one request (``StageStep``'s methods the talker reads)."""

    def __init__(self, payload):
        self.payload = payload

    def inputs(self, req_id):
        return self.payload.tensors()

    def params(self, req_id):
        return None

    def grows(self, req_id):
        return True


def _prompt(config, user_tokens: int) -> list[int]:
    """``<|im_start|>user`` + filler + ``<|im_end|>`` ``\\n`` + the generation prompt."""
    nl = 29
    return ([config.im_start_token_id, config.user_token_id, nl] + [FILLER] * user_tokens
            + [config.im_end_token_id, nl, config.im_start_token_id, config.assistant_token_id,
               nl])


def _talker_ms(config, user_tokens: int, tokens: int, device: str) -> float:
    """Median ms of the talker's growths for one chat."""
    from types import SimpleNamespace

    import torch

    from vllm_omni_plugin.models.qwen3_omni import talker_inputs as ti
    from vllm_omni_plugin.payload_store import GrowingPayload

    stage = _talker(config, device)
    width = config.talker_config.thinker_hidden_size
    prompt = _prompt(config, user_tokens)
    p = len(prompt)
    seq = torch.tensor(prompt + [FILLER + 1] * tokens)
    embed = torch.randn(seq.shape[0] - 1, width)
    payload = GrowingPayload()
    step = _Step(payload)
    speaker = ti.resolve_speaker(config.talker_config, None)
    r = SimpleNamespace(req_id="r", num_prompt_tokens=p - 3 + ti.ASSISTANT_PREFIX_LEN)
    clock = _clock if device == "cpu" else time.perf_counter
    times, taken = [], 0
    with torch.no_grad():
        for end in range(p + 2, seq.shape[0] + 1):  # the talker starts at 2 generated
            chunk = {"sequence_ids": seq[taken + 1 if taken else 0:end],
                     "thinker_embed": embed[taken:end - 1], "thinker_hidden": embed[taken:end - 1]}
            if not taken:
                chunk.update(tts_embed=torch.randn(3, width),
                             speaker_id=torch.tensor([speaker]), prompt_len=torch.tensor([p]),
                             thinker_positions=torch.arange(p)[:, None].expand(p, 3))
            payload.extend([chunk])
            if device != "cpu":
                torch.cuda.synchronize()
            start = clock()
            stage._state(step, r)
            if device != "cpu":
                torch.cuda.synchronize()
            if taken:
                times.append(clock() - start)
            taken = end - 1
    return 1000 * statistics.median(times)


def _api_server_ms(config, user_tokens: int, tokens: int, width: int) -> float:
    """Median ms of the API server's growths for one chat (see the module docstring)."""
    from types import SimpleNamespace

    import torch

    from vllm_omni_plugin.engine.omni_request import OmniRequest
    from vllm_omni_plugin.engine.pipeline_run import PipelineRun
    from vllm_omni_plugin.engine.streaming import InputStream, StageStreams
    from vllm_omni_plugin.models.qwen3_omni.processors import thinker2talker
    from vllm_omni_plugin.payload_store import PayloadStore
    from vllm_omni_plugin.processors.hookspecs import StageRequest, UpstreamOutput

    prompt = _prompt(config, user_tokens)
    p = len(prompt)

    def rows(n: int) -> dict:
        return {"embed": torch.randn(n, width), "hidden": torch.randn(n, width),
                "positions": torch.zeros(n, 3, dtype=torch.long)}

    async def chat(root: str) -> list[float]:
        store, key = PayloadStore(root), "thinker.out"
        store.create(key)
        stream, generated, times = InputStream(store, key, 0), [], []

        def publish():  # the thinker's step: one token, and the row of the one before
            generated.append(FILLER + 1)
            if len(generated) > 1:
                store.append(key, rows(1))
            stream.update(prompt, generated)

        async def run_stage(run, stage, first, on_rows, growth=None):
            while len(generated) < tokens:
                publish()
                start = _clock()
                await anext(growth)
                times.append(_clock() - start)
            stream.finish(UpstreamOutput(stage_id=0, prompt_token_ids=prompt,
                                         output_token_ids=list(generated),
                                         payload=store.get(key)))
            async for _ in growth:
                pass

        store.append(key, {**rows(p), "tts_embed": torch.randn(3, width)})
        publish(), publish()  # the talker starts at 2 generated
        streams = StageStreams(lambda stage, upstream, request: thinker2talker(
            upstream, stage, request), run_stage, {})
        talker = SimpleNamespace(stage_id=1, name="talker")
        await streams.run_streaming_input(PipelineRun("r", OmniRequest(), 0), talker, stream,
                                          StageRequest(config))
        return times

    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) \
            as root:
        return 1000 * statistics.median(asyncio.run(chat(root)))


def child(args) -> None:
    """Measure the code importable here (``vllm_omni_plugin`` on ``sys.path``) and print
    one JSON line: ``{"talker": {turn: ms}, "api": {turn: ms}}``."""
    import logging

    import torch

    logging.disable(logging.INFO)
    torch.set_num_threads(1)  # no intra-op threads spinning on a shared host
    config = _config(args.checkpoint, args.thinker_width, args.talker_width)
    turns = {"long": args.long, "short": args.short}
    out = {"talker": {}, "api": {}}
    for kind, n in turns.items():
        out["talker"][kind] = _talker_ms(config, n, args.tokens, args.device)
        out["api"][kind] = _api_server_ms(config, n, args.tokens,
                                          config.talker_config.thinker_hidden_size)
    import vllm_omni_plugin

    out["code"] = str(Path(vllm_omni_plugin.__file__).parent.parent)
    print(json.dumps(out), flush=True)


# -- the parent: trials, both trees --------------------------------------------------------
def _run(tree: Path, args) -> dict:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--checkpoint",
            str(args.checkpoint), "--long", str(args.long), "--short", str(args.short),
            "--tokens", str(args.tokens), "--device", args.device]
    for flag in ("thinker_width", "talker_width"):
        if getattr(args, flag):
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(argv, env=env, cwd=str(tree), capture_output=True, text=True,
                          timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: {done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(out["code"]).resolve() != tree.resolve():
        raise RuntimeError(f"the child measured {out['code']}, not {tree}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="git revision of the code before (a worktree)")
    parser.add_argument("--checkpoint", type=Path, help="tiny checkpoint dir (made if missing)")
    parser.add_argument("--long", type=int, default=4000, help="long user turn, tokens")
    parser.add_argument("--short", type=int, default=100, help="short user turn, tokens")
    parser.add_argument("--tokens", type=int, default=48, help="thinker tokens per chat")
    parser.add_argument("--thinker-width", type=int, help="thinker hidden size (default: "
                        "the checkpoint's)")
    parser.add_argument("--talker-width", type=int, help="talker hidden size (default: the "
                        "checkpoint's; intermediate twice it)")
    parser.add_argument("--device", default="cpu", help="the talker's device (cpu, cuda)")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="talker-growth-bench-"))
    if args.checkpoint is None:
        args.checkpoint = tmp / "ckpt"
    if not (args.checkpoint / "config.json").exists():
        make_checkpoint(args.checkpoint)
    trees = {"after": REPO}
    if args.before:
        trees["before"] = tmp / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(trees["before"]),
                        args.before], cwd=str(REPO), check=True, capture_output=True)
    results: dict[str, list[dict]] = {name: [] for name in trees}
    try:
        for trial in range(args.trials):
            order = list(trees) if trial % 2 == 0 else list(reversed(trees))
            for name in order:
                results[name].append(_run(trees[name], args))
                r = results[name][-1]
                print(f"trial {trial + 1} {name}: talker long {r['talker']['long']:.3f} / "
                      f"short {r['talker']['short']:.3f} ms, API server long "
                      f"{r['api']['long']:.3f} / short {r['api']['short']:.3f} ms", flush=True)
    finally:
        if args.before:
            subprocess.run(["git", "worktree", "remove", "--force", str(trees["before"])],
                           cwd=str(REPO), check=False, capture_output=True)
    rows = []
    for name in ("before", "after"):
        if name not in results:
            continue
        for part, label in (("talker", "talker"), ("api", "API server")):
            long = [r[part]["long"] for r in results[name]]
            short = [r[part]["short"] for r in results[name]]
            ratios = [a / b for a, b in zip(long, short, strict=True)]
            rows.append([f"{name} ({args.before if name == 'before' else 'this checkout'})",
                         label, fmt(median(long), ".3f"), fmt(median(short), ".3f"),
                         fmt(median(ratios), ".2f")])
    width = args.thinker_width or "checkpoint's"
    print(table(["code", "per growth", f"{args.long}-token turn ms", f"{args.short}-token "
                 "turn ms", "long ÷ short"], rows, left=2,
                title=f"per growth of a streamed talker input, {args.tokens} thinker tokens, "
                      f"{args.trials} trials (medians), thinker width {width}, "
                      f"device {args.device}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

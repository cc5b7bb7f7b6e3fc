#!/usr/bin/env bash
# Install (first run), write a tiny Qwen3-Omni checkpoint, start `vllm serve` in
# omni mode and ask it for text + speech. Leaves the server running; stop it
# with `kill $(cat /tmp/vllm-omni-quickstart.pid)`.
#   PORT (default 8000), CKPT (default /tmp/tiny-qwen3-omni)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV="${VLLM_OMNI_PLUGIN_VENV:-.venv}"
PORT="${PORT:-8000}"
CKPT="${CKPT:-/tmp/tiny-qwen3-omni}"
[ -f "$CKPT/config.json" ] || "$VENV/bin/python" -m vllm_omni_plugin.tools.tiny_checkpoint qwen3-omni "$CKPT" --seed 0
# No memory flags: the pipeline sets each stage's share of its device (and, on vLLM's
# CPU build, its KV cache size) and places the stages (--omni-placement auto).
"$VENV/bin/vllm" serve "$CKPT" --stage-configs-path qwen3_omni_moe \
  --port "$PORT" --max-model-len 2048 --dtype float32 > /tmp/vllm-omni-quickstart.log 2>&1 &
echo $! > /tmp/vllm-omni-quickstart.pid
echo "[quickstart] vllm serve started (pid $(cat /tmp/vllm-omni-quickstart.pid)), log: /tmp/vllm-omni-quickstart.log"
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 "$(cat /tmp/vllm-omni-quickstart.pid)" 2>/dev/null || { tail -50 /tmp/vllm-omni-quickstart.log; exit 1; }
  sleep 1
done
curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "'"$CKPT"'",
  "messages": [{"role": "user", "content": "Say hello"}],
  "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"},
  "max_tokens": 16, "temperature": 0
}' > /tmp/vllm-omni-quickstart.json
"$VENV/bin/python" - <<'PY'
import base64, io, json
import soundfile as sf
r = json.load(open("/tmp/vllm-omni-quickstart.json"))
msg = r["choices"][0]["message"]
data, rate = sf.read(io.BytesIO(base64.b64decode(msg["audio"]["data"])))
open("/tmp/vllm-omni-quickstart.wav", "wb").write(base64.b64decode(msg["audio"]["data"]))
print(f"text: {msg['content']!r}")
print(f"audio: {len(data)} samples at {rate} Hz -> /tmp/vllm-omni-quickstart.wav")
PY

"""The omni API server's entry points: the ASGI middleware in front of vLLM's OpenAI server
(:mod:`.middleware`, installed through vLLM's ``--middleware``) and its handlers: chat and
text completions with audio output (:mod:`.chat_audio`), text to speech (:mod:`.speech`),
image generation (:mod:`.images`), the Realtime API over WebSocket (:mod:`.realtime`, with
server VAD in :mod:`.vad`), and their helpers: checks of media input (:mod:`.media_input`),
audio output formats (:mod:`.audio_encoding`) and shared ASGI plumbing (:mod:`.asgi`).
"""

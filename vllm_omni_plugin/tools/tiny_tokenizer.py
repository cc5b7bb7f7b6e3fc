"""A tiny Qwen-style byte-level BPE tokenizer, built in-process for the tiny checkpoints
(:mod:`vllm_omni_plugin.tools.tiny_checkpoint`); nothing is downloaded.

The BPE is learned deterministically from a short built-in English text; the Qwen2
pre-tokenizer regex, NFC and a byte-level decoder make any text encode. Special tokens are
appended after the BPE vocabulary in the order given, as upstream Qwen tokenizers append
theirs, so their ids depend on the BPE size only.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

# Qwen2 pre-tokenizer regex (same as transformers' Qwen2Tokenizer / upstream tokenizer.json).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2.5's added tokens (151643..151664), (token, special) in upstream order; `special=False`
# mirrors upstream for the tool and FIM markers.
QWEN25_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)

# Words that must be single BPE tokens, as they appear right after `<|im_start|>` (HF
# `generate` and the talker prompt construction compare the id after `<|im_start|>` with
# config.system/user/assistant_token_id).
ROLE_WORDS = ("system", "user", "assistant")

QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part is string -%}"
    "{{- part -}}"
    "{%- elif part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- elif part['type'] in ['image', 'image_url'] or 'image' in part or 'image_url' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ['audio', 'input_audio', 'audio_url'] or 'audio' in part"
    " or 'audio_url' in part -%}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif part['type'] in ['video', 'video_url'] or 'video' in part or 'video_url' in part -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# Short built-in English text the BPE merges are learned from (any text still encodes,
# byte by byte in the worst case).
_CORPUS = """\
You are a helpful assistant. You are Qwen, a virtual human developed by the Qwen Team,
capable of perceiving auditory and visual inputs, as well as generating text and speech.
Hello! How are you today? I am fine, thank you. What is your name? My name is Ethan.
Please tell me a short story about a cat and a dog who live in a small house near the sea.
The quick brown fox jumps over the lazy dog. The weather is nice and the sun is bright.
Describe this image. What do you hear in this audio? What happens in this video?
Can you help me write a poem about the moon, the stars and the night sky?
This is a test of the speech system. Count from one to ten: one, two, three, four, five,
six, seven, eight, nine, ten. The answer is 42. It's a good day, isn't it? Yes, it is.
We will go to the park in the morning and come back home in the evening for dinner.
Thank you very much for your question. Here is the answer: the capital of France is Paris.
Good morning, good afternoon, good evening and good night. See you later, my friend.
"""

# BPE vocabulary (bytes + merged tokens) is grown until it reaches this size.
_BPE_VOCAB_TARGET = 960  # not reached with _CORPUS (692)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte -> printable unicode char map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _bpe_split(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """Apply BPE merges (lowest rank, leftmost first) to a byte-level word."""
    symbols = list(word)
    while len(symbols) > 1:
        best: tuple[int, int] | None = None
        for i in range(len(symbols) - 1):
            r = ranks.get((symbols[i], symbols[i + 1]))
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        symbols = symbols[:i] + [symbols[i] + symbols[i + 1]] + symbols[i + 2 :]
    return symbols


def _qwen2_pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def build_byte_level_bpe(
    corpus: str, forced_words: Sequence[str] = ROLE_WORDS, vocab_target: int = _BPE_VOCAB_TARGET
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Deterministically learn a byte-level BPE whose merges turn whole words into tokens.

    Words are taken (forced words first, then corpus pre-tokens by descending frequency,
    ties by text) and merges are appended left to right until each word is one token.
    Appending a merge with a rank above all existing ones never changes how earlier words
    tokenize, so every processed word stays a single token.
    """
    byte_chars = list(_bytes_to_unicode().values())
    vocab: dict[str, int] = {ch: i for i, ch in enumerate(byte_chars)}
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}

    pre = _qwen2_pre_tokenizer()
    counts = Counter(tok for tok, _ in pre.pre_tokenize_str(corpus))
    ordered = list(forced_words) + [
        w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    ]
    # Forced words are plain ASCII letters, identical in byte-level form.
    seen: set[str] = set()
    for word in ordered:
        if word in seen or len(word) < 2:
            continue
        seen.add(word)
        pieces = _bpe_split(word, ranks)
        added: list[tuple[str, str]] = []
        while len(pieces) > 1:
            pair = (pieces[0], pieces[1])
            added.append(pair)
            ranks[pair] = len(merges) + len(added) - 1
            pieces = _bpe_split(word, ranks)
        new_tokens = [a + b for a, b in added if a + b not in vocab]
        if len(vocab) + len(set(new_tokens)) > vocab_target and word not in forced_words:
            for pair in added:  # roll back: this word does not fit any more
                del ranks[pair]
            break
        merges.extend(added)
        for tok in new_tokens:
            if tok not in vocab:
                vocab[tok] = len(vocab)
    return vocab, merges


def build_qwen_tokenizer(added_tokens: Sequence[tuple[str, bool]],
                         extra_special_tokens: dict[str, str] | None = None):
    """A ``PreTrainedTokenizerFast``: the tiny BPE, then ``added_tokens`` ((text, special)
    pairs) with consecutive ids after the BPE vocabulary; eos ``<|im_end|>``, pad
    ``<|endoftext|>``, ChatML chat template; ``system``, ``user`` and ``assistant`` are
    single tokens.

    Raises:
        RuntimeError: an added token did not get the id after its predecessor, or a role
            word is not a single token.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    vocab, merges = build_byte_level_bpe(_CORPUS)
    raw = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    raw.normalizer = normalizers.NFC()
    raw.pre_tokenizer = _qwen2_pre_tokenizer()
    raw.decoder = decoders.ByteLevel()
    # Added one by one so ids follow upstream order right after the BPE vocabulary.
    for text, special in added_tokens:
        tok = AddedToken(text, special=special, normalized=False, single_word=False)
        if special:
            raw.add_special_tokens([tok])
        else:
            raw.add_tokens([tok])
    for i, (text, _) in enumerate(added_tokens):
        got = raw.token_to_id(text)
        if got != len(vocab) + i:
            raise RuntimeError(f"special token {text!r} got id {got}, expected {len(vocab) + i}")

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        errors="replace",
        extra_special_tokens=dict(extra_special_tokens or {}),
    )
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    for word in ROLE_WORDS:
        ids = tokenizer.encode(word, add_special_tokens=False)
        if len(ids) != 1:
            raise RuntimeError(f"role word {word!r} is not a single token: {ids}")
    return tokenizer


def set_tokenizer_class(out_dir: Path, name: str) -> None:
    """Record the upstream tokenizer class (the file is a plain tokenizers-backed BPE)."""
    path = out_dir / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data["tokenizer_class"] = name
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")

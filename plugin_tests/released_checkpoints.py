"""The released checkpoints' published facts, vendored under
``plugin_tests/fixtures/checkpoints/`` (sources in its README.md): Qwen3-Omni-30B-A3B-Instruct's
per-tensor listing (name, shape, dtype, shard) and facts; BAGEL-7B-MoT's facts and
derived key listing."""

from __future__ import annotations

import itertools
import json
import os
import re
from typing import NamedTuple

CHECKPOINTS = os.path.join(os.path.dirname(__file__), "fixtures", "checkpoints")
QWEN3_OMNI = os.path.join(CHECKPOINTS, "qwen3-omni-30b-a3b-instruct")
_RANGE = re.compile(r"\{(\d+)-(\d+)\}")


class Tensor(NamedTuple):
    shape: tuple[int, ...]
    dtype: str
    #: shard file, or None where the listing says "Multi Files"
    file: str | None


def expand(pattern: str) -> list[str]:
    """The names a listing pattern stands for: each ``{a-b}`` is every integer a..b."""
    parts = _RANGE.split(pattern)
    literals, ranges = parts[0::3], list(zip(parts[1::3], parts[2::3], strict=True))
    names = []
    for values in itertools.product(*(range(int(a), int(b) + 1) for a, b in ranges)):
        names.append(literals[0] + "".join(f"{v}{lit}"
                                           for v, lit in zip(values, literals[1:], strict=True)))
    return names


def qwen3_omni_tensors() -> dict[str, Tensor]:
    """Every tensor of the released Qwen3-Omni-30B-A3B-Instruct, from the listing."""
    tensors: dict[str, Tensor] = {}
    with open(os.path.join(QWEN3_OMNI, "published_listing.tsv")) as f:
        rows = [line.rstrip("\n").split("\t") for line in f
                if line.strip() and not line.startswith("#")]
    for name, shape, dtype, file, *_ in rows[1:]:
        for key in expand(name):
            assert key not in tensors, f"{key} listed twice"
            tensors[key] = Tensor(tuple(json.loads(shape)), dtype,
                                  None if file == "Multi Files" else file)
    return tensors


def qwen3_omni_facts() -> dict:
    with open(os.path.join(QWEN3_OMNI, "facts.json")) as f:
        return json.load(f)

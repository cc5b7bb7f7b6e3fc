"""pluggy hook specifications for stage input processors.

A *stage input processor* turns what upstream stage(s) produced for one
request into the request submitted to the next stage (e.g. thinker hidden
states -> talker prompt). Processors are contributed by plugins through the
``omni_register_stage_input_processors`` hook and referenced by name from a
stage YAML's ``input_processor`` field. See ``docs/contributing/processors.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch

    from vllm_omni_plugin.config.schema import StageConfig

PROJECT_NAME = "vllm_omni_plugin"
#: Longest voice name accepted (speaker names in Qwen3-Omni's config are short words).
MAX_VOICE_CHARS = 64
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class RequestError(ValueError):
    """A request the API refuses with HTTP 400; ``field`` names the offending field (hook
    implementations raise it for a request field they cannot serve)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"'{field}': {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class StreamChunk:
    """Where one chunk of a streamed stage's input sits in the request's stream.

    Attributes:
        stream_id: the same for every chunk of one request's stream into one stage
            (unique per head): a stage that keeps state between chunks keys it by this.
            The chunks go to one replica while it is up.
        first_row: the stream row of the chunk's first row after its ``context_rows``.
        last: the stream's last chunk (nothing follows it).
    """

    stream_id: str
    first_row: int
    last: bool


@dataclass
class UpstreamOutput:
    """What one upstream stage produced for one request.

    Attributes:
        stage_id: id of the stage that produced this output.
        prompt_token_ids: token ids that stage was prompted with.
        output_token_ids: token ids that stage generated.
        payload: tensors the stage's worker published for this request
            (e.g. ``{"hidden_states": ...}``); may be empty.
        context_rows: for one chunk of a streamed stage's input (stage field
            ``streaming``): the payload holds the chunk's rows (dim 0) preceded by this
            many earlier rows, which the consuming stage sees as left context only; the
            processor passes it on to the stage's model, which drops their output. 0
            otherwise.
        chunk: for one chunk of a streamed stage's input, where it sits in the stream;
            None otherwise.
        finished: False while the upstream stage still runs (a stage with
            ``stream_input`` gets its input processor called on the output so far): the
            payload holds the rows published so far, the token ids those generated so far.
        state: for a processor called on an output as it grows (``finished`` False, then
            the finished output): one dict, the same object at every call for one
            request's input stream, empty at the first; the processor may keep in it,
            under its own name, what it derived from the earlier calls, so that a call
            costs what the output added, not the whole output. A fresh dict otherwise.
    """

    stage_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    payload: dict[str, torch.Tensor] = field(default_factory=dict)
    context_rows: int = 0
    chunk: StreamChunk | None = None
    finished: bool = True
    state: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass
class StageInput:
    """What a processor returns: the next stage's request.

    Attributes:
        prompt_token_ids: token ids submitted to the next stage's EngineCore
            (placeholder ids are allowed; the worker replaces their embeddings
            from ``payload``).
        payload: tensors the next stage's worker fetches by request id.
        sampling_overrides: ``vllm.SamplingParams`` fields merged over the
            stage's ``default_sampling_params``.
        ready: for an upstream output that is not finished, how many output tokens the
            stage may generate in all on this input (0: not enough to start). A later
            call on more of the upstream output may only add rows (dim 0) to payload
            tensors; the prompt and every other tensor stay as they were. None for a
            finished upstream output.
        output: set (see :meth:`nothing_to_do`) when a valid request leaves the stage
            nothing to do: the stage does not run for it, and this payload stands as its
            output (what the stage publishes for an empty answer, e.g. 0 codec frames);
            the stages after it run on that as usual. None otherwise.
        reason: why the stage has nothing to do (logged); with ``output`` only.
    """

    prompt_token_ids: list[int]
    payload: dict[str, torch.Tensor] = field(default_factory=dict)
    sampling_overrides: dict[str, Any] = field(default_factory=dict)
    ready: int | None = None
    output: dict[str, torch.Tensor] | None = None
    reason: str = ""

    @classmethod
    def nothing_to_do(cls, output: dict[str, torch.Tensor], reason: str) -> StageInput:
        """The stage's input for a request that leaves it nothing to do: ``output`` is
        taken as the stage's output, without running it; ``reason`` is logged. ``output``
        has the shapes and dtypes the stage publishes, with 0 rows where it produced
        nothing (e.g. the talker's ``codes`` ``[0, 16]`` int64)."""
        return cls(prompt_token_ids=[], output=output, reason=reason)


@dataclass(frozen=True)
class StageRequest:
    """What a stage input processor knows of the request beyond its upstream outputs.

    Attributes:
        hf_config: The served checkpoint's HF config.
        voice: The voice the client asked for, as written (``Voices.resolve`` turns it
            into one of the checkpoint's), or None for the default.
        options: The model's per-request data from the API layer, by name (the images
            API puts its :class:`ImagePlan`'s ``options`` under ``"image"``).
        companions: The outputs of the request's companion prompts
            (:attr:`ImagePlan.companions`), by name.
        extra: The client's own ``extra_args`` (``vllm_xargs``; the plugin's reserved
            keys removed).
    """

    hf_config: Any
    voice: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    companions: Mapping[str, UpstreamOutput] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)


#: Calling convention of a processor:
#: ``processor(upstream, stage, request) -> StageInput``.
StageInputProcessor = Callable[
    [list[UpstreamOutput], "StageConfig", StageRequest], StageInput
]


@hookspec
def omni_register_stage_input_processors() -> dict[str, StageInputProcessor]:
    """Return this plugin's stage input processors as ``{name: processor}``.

    Each processor is called once per request, when all stages listed in the
    consuming stage's ``inputs`` have finished for that request::

        processor(upstream: list[UpstreamOutput],
                  stage: StageConfig,
                  request: StageRequest) -> StageInput

    ``upstream`` holds one entry per id in ``stage.inputs`` (same order);
    ``stage`` is the *consuming* stage's config; ``request`` carries the
    per-request data of the client request (:class:`StageRequest`: the voice, the
    model's options, companions' outputs). Names must be unique across all plugins
    (a duplicate raises ``ValueError`` at lookup).
    """


@dataclass
class Voices:
    """The voices a checkpoint speaks in: ``names`` as the client writes them (matched
    case-insensitively), ``default`` the one used when a request names none.

    :meth:`resolve` is the one check of a requested voice: the API calls it to answer
    HTTP 400 before any stage runs, and a model's stage input processor to turn the
    voice into the model's speaker id."""

    names: list[str]
    default: str

    def resolve(self, voice: str | None) -> str:
        """The name in :attr:`names` that ``voice`` matches case-insensitively;
        :attr:`default` for None.

        Raises:
            ValueError: the checkpoint has no such voice (the message lists them).
        """
        if voice is None:
            return self.default
        for name in self.names:
            if name.lower() == voice.lower():
                return name
        raise ValueError(f"unknown voice {voice[:MAX_VOICE_CHARS]!r}; known: "
                         f"{', '.join(self.names)}")


@hookspec(firstresult=True)
def omni_list_voices(hf_config: Any) -> Voices | None:
    """Return the voices of the served checkpoint (its HF config), or None when this
    plugin does not know the model. The first non-None answer wins. The API serves it
    as ``GET /v1/audio/voices`` and refuses any other voice with HTTP 400."""


@dataclass(frozen=True)
class ImageRequest:
    """A ``POST /v1/images/generations`` body whose OpenAI fields the API validated.

    Attributes:
        model: the served model's name.
        prompt: what to draw.
        size: ``(width, height)`` in pixels; None for the model's default.
        seed: the noise's seed; None for a random one.
        negative_prompt: what not to draw, or None.
        extra: the body's other fields (the model's own knobs), for the model to check.
        reasoning: the text the entry stage wrote for the plan's :attr:`ImagePlan.planning`
            step, once it ran (the model is then asked to plan the request again, with
            it); None before, or when the plan has no such step.
        images: input images to edit (``POST /v1/images/edits``, or an image in an image
            chat's last user message): decoded RGB Pillow images, in the request's order;
            empty for an image drawn from text alone.
    """

    model: str
    prompt: str
    size: tuple[int, int] | None = None
    seed: int | None = None
    negative_prompt: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    reasoning: str | None = None
    images: tuple[Any, ...] = ()


@dataclass(frozen=True)
class PlanningStep:
    """Text the entry stage writes before an image is drawn (a model's "thinking"): the
    API layer completes ``prompt`` greedily and plans the request again with the text as
    :attr:`ImageRequest.reasoning`, which the answer returns (``revised_prompt``).

    Attributes:
        prompt: the entry stage's prompt to complete (the model's special tokens allowed).
        max_tokens: the most tokens written.
        stop: the text ends before the first of these strings (special tokens are kept in
            the text, so a special token may be one).
    """

    prompt: str
    max_tokens: int
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class ImagePlan:
    """How the pipeline serves one :class:`ImageRequest`.

    Attributes:
        prompt: the entry stage's prompt (text; the model's special tokens allowed).
        width, height: the image's size in pixels.
        options: what the model's stage input processors need, handed to them as
            ``StageRequest.options["image"]``.
        companions: more prompts the entry stage runs for the request, by name (e.g. a
            negative prompt's context for CFG); their outputs reach the processors as
            ``StageRequest.companions[name]`` (an :class:`UpstreamOutput`).
        planning: text to write first (:class:`PlanningStep`); the plan's other fields
            are then not used: the request is planned again with the text. None: draw
            as planned.
    """

    prompt: str
    width: int
    height: int
    options: Any = None
    companions: dict[str, str] = field(default_factory=dict)
    planning: PlanningStep | None = None


@hookspec(firstresult=True)
def omni_plan_image(hf_config: Any, request: ImageRequest) -> ImagePlan | None:
    """Plan an image generation on the served checkpoint (its HF config), or return None
    when this plugin does not know the model. Raise :class:`RequestError` naming the field
    for a request the model cannot serve (a size it cannot draw, a bad knob, an unknown
    field in ``request.extra``)."""

"""SFT datasets prepared where the student's tokenizer lives: ``TrainerService.PrepareDataset``.

A client (a recipe) hands over the URL of trajectories as orchard-rollout gave them: a
teacher's rollouts carry a conversation (`conversation_json`) and no turns, the student's own
carry turns in its tokens. Each conversation is rendered in the model's tokenizer and chat
template turn by turn (`orchard.trainer.teacher`); rows with turns are kept as they are, after
a check that their ids lie in the model's vocabulary. A vision-language model folder (its
config has a ``vision_config``) renders with its processor, screenshots included, and its rows
keep their conversation (`orchard.trainer.vision`); a text model refuses rows with screenshots
by the reason ``image_content``. The curation steps asked for
(`orchard.trainer.curation`) then run over the rows, and the kept ones are written as JSON
Lines at the output URL, whole, only when the call succeeds. The result says how many rows went
in, were rendered, kept and dropped (by step and reason), how many SFT samples a job on the
dataset builds (`orchard.trainer.masks`), and which rows could not be rendered and why. One
success threshold (`success_threshold_of`) decides both which rows curation counts as
successes and which rows the count trains on whole.

Rendering a conversation tokenizes its history once per assistant turn, so a large input
takes minutes: the work runs in a thread off the event loop and the RPC streams progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchard.core.artifacts import ArtifactStore
from orchard.core.errors import OrchardError, Reason
from orchard.core.success import DEFAULT_SUCCESS_THRESHOLD, check_success_threshold
from orchard.lm.chat import ChatRenderer
from orchard.trainer.curation import (
    CapPerSource,
    CurationError,
    CurationStep,
    KnownTools,
    ParsableActions,
    ShortestSuccessful,
    StepReport,
    TokenLimit,
    ToolSchema,
    curate,
    default_order,
)
from orchard.trainer.datasets import DatasetError, parse_numbered
from orchard.trainer.masks import (
    Overflow,
    Sample,
    SampleConfig,
    Skip,
    TrajectoryError,
    sft_samples,
)
from orchard.trainer.teacher import TrajectoryBuildError, teacher_trajectory
from orchard.trainer.v1 import trainer_service_pb2 as api
from orchard.types.v1 import trajectory_pb2

__all__ = ["DatasetPreparer", "PreparedRows"]

log = logging.getLogger(__name__)

UNRENDERED_SHOWN = 100
"""Rows the result lists by name among those that could not be rendered (all are counted)."""
PROGRESS_EVERY_S = 0.5
"""Least time between two progress messages."""
TOKENIZERS_KEPT = 4
"""Tokenizers kept loaded, by model: a recipe prepares twice on one model."""
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

Progress = Callable[[int, int], None]


def _invalid(message: str) -> OrchardError:
    return OrchardError(Reason.INVALID_ARGUMENT, message)


@dataclass
class PreparedRows:
    """The rows of one call as they pass through: rendered or passed, and the ones that fell."""

    rows: list[trajectory_pb2.Trajectory] = field(default_factory=list)
    rendered: int = 0
    passed: int = 0
    unrendered: list[api.UnrenderedRow] = field(default_factory=list)
    unrendered_by_reason: Counter[str] = field(default_factory=Counter)

    @property
    def unrendered_count(self) -> int:
        return sum(self.unrendered_by_reason.values())

    def fail(self, row: trajectory_pb2.Trajectory, line: int, reason: str, detail: str) -> None:
        self.unrendered_by_reason[reason] += 1
        if len(self.unrendered) < UNRENDERED_SHOWN:
            self.unrendered.append(
                api.UnrenderedRow(trajectory_id=row.id, line=line, reason=reason, detail=detail)
            )


@dataclass(frozen=True)
class _Tokenizer:
    renderer: ChatRenderer
    vocab_size: int
    samples: Callable[[trajectory_pb2.Trajectory, SampleConfig], list[Sample | Skip]] = sft_samples
    """How an SFT job on this model cuts a row's samples (a vision-language model's carry
    images)."""


@dataclass(frozen=True)
class _Rendering:
    """What every row of one call is rendered with."""

    tokenizer: _Tokenizer
    tools: Mapping[str, Sequence[Mapping[str, Any]]]
    source_model: str


def harness_tools(entries: Sequence[api.HarnessTools]) -> dict[str, list[dict[str, Any]]]:
    """The tools of each harness from the request; raises INVALID_ARGUMENT naming the harness
    whose declarations are not a JSON array of tool objects, or a harness given twice."""
    out: dict[str, list[dict[str, Any]]] = {}
    for index, entry in enumerate(entries):
        where = f"tools[{index}] (harness {entry.harness!r})"
        if not entry.harness:
            raise _invalid(f"tools[{index}].harness is empty: name the harness the tools are of")
        if entry.harness in out:
            raise _invalid(f"{where}: the harness is given twice; give its tools once")
        try:
            tools = json.loads(entry.tools_json or "[]")
        except json.JSONDecodeError as exc:
            raise _invalid(f"{where}: tools_json is not JSON ({exc.msg})") from None
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise _invalid(f"{where}: tools_json must be a JSON array of tool objects")
        try:
            ToolSchema.of(tools)  # every declaration must render and validate
        except CurationError as exc:
            raise _invalid(f"{where}: {exc}") from None
        out[entry.harness] = tools
    return out


def success_threshold_of(request: api.PrepareDatasetRequest) -> float:
    """The request's success threshold: `success_threshold`, else the deprecated
    `curation.success_threshold`, else the shared default; INVALID_ARGUMENT outside [0, 1] or
    when both are set and differ."""
    given = request.success_threshold if request.HasField("success_threshold") else None
    curation = request.curation if request.HasField("curation") else None
    legacy = (
        curation.success_threshold
        if curation is not None and curation.HasField("success_threshold")
        else None
    )
    if given is not None and legacy is not None and given != legacy:
        raise _invalid(
            f"success_threshold ({given}) and curation.success_threshold ({legacy}) differ: "
            "give success_threshold only"
        )
    for value, what in ((given, "success_threshold"), (legacy, "curation.success_threshold")):
        if value is not None:
            try:
                return check_success_threshold(value, what)
            except ValueError as exc:
                raise _invalid(str(exc)) from None
    return DEFAULT_SUCCESS_THRESHOLD


def curation_steps(
    settings: api.CurationSettings | None,
    tools: Mapping[str, Sequence[Mapping[str, Any]]],
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
) -> list[CurationStep]:
    """The steps `settings` asks for, in the order they run, successes counted at
    `success_threshold`; raises INVALID_ARGUMENT for a setting that cannot run."""
    if settings is None:
        return []
    if settings.max_tokens < 0 or settings.cap_per_source < 0:
        raise _invalid("curation.max_tokens and curation.cap_per_source must not be negative")
    steps: list[CurationStep] = []
    try:
        if settings.max_tokens:
            steps.append(TokenLimit(settings.max_tokens))
        if settings.drop_unparsable:
            steps.append(ParsableActions())
        if settings.drop_unknown_tools:
            if not tools:
                raise _invalid(
                    "curation.drop_unknown_tools needs the tools of the rows' harnesses "
                    "(request.tools)"
                )
            steps.append(KnownTools({name: ToolSchema.of(list(ts)) for name, ts in tools.items()}))
        if settings.shortest_success_per_task:
            steps.append(
                ShortestSuccessful(
                    success_threshold=success_threshold, per_harness=settings.per_harness
                )
            )
        if settings.cap_per_source:
            steps.append(CapPerSource(settings.cap_per_source, settings.source_key or "repository"))
    except CurationError as exc:
        raise _invalid(f"curation: {exc}") from None
    return default_order(steps)


def step_report(report: StepReport, examples: int) -> api.CurationStepReport:
    """One step's report as the RPC gives it, with the first `examples` drops per reason."""
    shown: Counter[str] = Counter()
    message = api.CurationStepReport(
        step=report.step,
        rows_in=report.rows_in,
        kept=report.kept,
        dropped=len(report.dropped),
        dropped_by_reason=dict(report.by_reason),
    )
    for drop in report.dropped:
        if shown[drop.reason] < examples:
            shown[drop.reason] += 1
            message.examples.add(
                trajectory_id=drop.trajectory_id, reason=drop.reason, detail=drop.detail
            )
    return message


class DatasetPreparer:
    """PrepareDataset of one service: reads and writes through `store`, caches model folders
    under `cache`, runs at most `limit` preparations at once."""

    def __init__(self, store: ArtifactStore, cache: Path, *, limit: int = 2) -> None:
        self.store = store
        self.cache = cache
        self.limit = limit
        self._active = 0
        self._tokenizers: OrderedDict[str, _Tokenizer] = OrderedDict()
        self._lock = threading.Lock()

    # -- the RPC ---------------------------------------------------------------------------

    async def stream(
        self, request: api.PrepareDatasetRequest
    ) -> AsyncIterator[api.PrepareDatasetResponse]:
        """Progress messages while the preparation runs in a thread, then the result; the
        thread stops at the next row when the caller goes away."""
        if self._active >= self.limit:
            raise OrchardError(
                Reason.RESOURCE_EXHAUSTED,
                f"this trainer prepares at most {self.limit} dataset(s) at once "
                "(jobs.max_preparing); retry when one finished",
            )
        self._active += 1
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[api.PrepareDatasetProgress] = asyncio.Queue()
        stop = threading.Event()

        def progress(done: int, total: int) -> None:
            update = api.PrepareDatasetProgress(rows_total=total, rows_done=done)
            with contextlib.suppress(RuntimeError):  # the loop closed: the server is stopping
                loop.call_soon_threadsafe(updates.put_nowait, update)

        work = asyncio.ensure_future(asyncio.to_thread(self.prepare, request, progress, stop))
        work.add_done_callback(self._finished)
        try:
            while not work.done():
                waiter = asyncio.ensure_future(updates.get())
                await asyncio.wait({work, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if waiter.done():
                    yield api.PrepareDatasetResponse(progress=waiter.result())
                else:
                    waiter.cancel()
            result = work.result()  # an OrchardError becomes the call's status
            yield api.PrepareDatasetResponse(result=result)
        finally:
            stop.set()

    def _finished(self, work: asyncio.Future[api.PrepareDatasetResult]) -> None:
        self._active -= 1
        if not work.cancelled():
            work.exception()  # retrieved: a caller that went away leaves no warning behind

    # -- the work (in a thread) ------------------------------------------------------------

    def prepare(
        self,
        request: api.PrepareDatasetRequest,
        progress: Progress,
        stop: threading.Event,
    ) -> api.PrepareDatasetResult:
        """Read, render, curate, count and write (see the module docstring)."""
        tools = harness_tools(request.tools)
        threshold = success_threshold_of(request)
        settings = request.curation if request.HasField("curation") else None
        steps = curation_steps(settings, tools, threshold)
        samples = self._sample_config(request, threshold)
        source = self.store.require(request.trajectories, what="trajectories")
        output = self._output(request.output)
        tokenizer = self._tokenizer(request.model)
        lines = self._read(source)
        rendering = _Rendering(tokenizer, tools, request.source_model or "unknown")
        prepared = self._render(lines, rendering, progress, stop)
        counts = self._check_samples(prepared, lines, samples, tokenizer.samples)
        result = curate(prepared.rows, steps)
        sft_total = sum(counts[id(row)][0] for row in result.rows)
        skipped: Counter[str] = Counter()
        for row in result.rows:
            skipped.update(counts[id(row)][1])
        if stop.is_set():
            raise OrchardError(Reason.ABORTED, "the caller went away; nothing was written")
        written = self._write(output, result.rows)
        examples = request.examples_per_reason or 3
        log.info(
            "dataset prepared",
            extra={"dataset": written, "rows": len(lines), "kept": len(result.rows)},
        )
        return api.PrepareDatasetResult(
            dataset=written,
            rows_in=len(lines),
            rows_rendered=prepared.rendered,
            rows_passed=prepared.passed,
            rows_unrendered=prepared.unrendered_count,
            rows_kept=len(result.rows),
            sft_samples=sft_total,
            sft_skipped=dict(skipped),
            curation=[step_report(r, examples) for r in result.reports],
            curation_summary=result.summary(examples),
            unrendered=prepared.unrendered,
            unrendered_by_reason=dict(prepared.unrendered_by_reason),
        )

    @staticmethod
    def _sample_config(
        request: api.PrepareDatasetRequest, success_threshold: float
    ) -> SampleConfig:
        """How the SFT job the request names will cut samples, so the count is its count (the
        job is given the same success threshold)."""
        if request.max_sequence_tokens < 0 or request.max_sequence_tokens == 1:
            raise _invalid(
                "max_sequence_tokens must be 0 (no limit) or at least 2, got "
                f"{request.max_sequence_tokens}"
            )
        if request.examples_per_reason < 0:
            raise _invalid("examples_per_reason must not be negative")
        return SampleConfig(
            context_window=request.max_sequence_tokens or None,
            overflow=Overflow.DROP if request.drop_long else Overflow.TRUNCATE_LEFT,
            success_threshold=success_threshold,
        )

    def _output(self, url: str) -> str:
        if not url:
            raise _invalid("output is required: the artifact URL to write the dataset at")
        checked = self.store.check(url, what="output").url
        if self.store.exists(checked):
            raise OrchardError(
                Reason.ALREADY_EXISTS,
                f"output {url!r} exists already; artifacts never change, so name a new URL",
            )
        return checked

    def _tokenizer(self, model: str) -> _Tokenizer:
        """The model's tokenizer and chat renderer, loaded once per model name (artifacts
        never change, so a URL names one tokenizer for good)."""
        with self._lock:
            found = self._tokenizers.get(model)
            if found is not None:
                self._tokenizers.move_to_end(model)
                return found
        loaded = self._load_tokenizer(model)
        with self._lock:
            self._tokenizers[model] = loaded
            while len(self._tokenizers) > TOKENIZERS_KEPT:
                self._tokenizers.popitem(last=False)
        return loaded

    def _load_tokenizer(self, model: str) -> _Tokenizer:
        from orchard.trainer.policy import BUILTIN_SIZES  # noqa: PLC0415

        if not model:
            raise _invalid(
                'model is required: "builtin:<size>" or the artifact URL of the model folder '
                "whose tokenizer renders the dataset"
            )
        if model.startswith("builtin:"):
            if model.removeprefix("builtin:") not in BUILTIN_SIZES:
                known = ", ".join("builtin:" + s for s in BUILTIN_SIZES)
                raise _invalid(f"model {model!r}: unknown built-in size; known: {known}")
            from orchard.lm.tokenizer import build_tokenizer  # noqa: PLC0415

            builtin = build_tokenizer()
            return _Tokenizer(ChatRenderer(builtin), len(builtin))
        self.store.require(model, what="model", folder=True)
        if not any(self.store.is_file(f"{model.rstrip('/')}/{n}") for n in _TOKENIZER_FILES):
            raise _invalid(
                f"model {model!r} has no tokenizer (tokenizer.json or tokenizer_config.json); "
                "save the tokenizer into the model folder"
            )
        folder = self.store.get_dir(model, cache_dir=self.cache)
        from orchard.lm.vision import is_vision_language_folder  # noqa: PLC0415

        if is_vision_language_folder(folder):
            return _vision_tokenizer(model, folder)
        from transformers import AutoTokenizer  # noqa: PLC0415

        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        return _Tokenizer(ChatRenderer(tokenizer), _vocab_size(folder, len(tokenizer)))

    def _read(self, url: str) -> list[tuple[int, trajectory_pb2.Trajectory]]:
        try:
            with self.store.open_read(url, text=True) as lines:
                return list(parse_numbered(lines, url))
        except DatasetError as exc:
            raise _invalid(str(exc)) from None
        except UnicodeDecodeError as exc:
            raise _invalid(f"trajectories {url!r} is not UTF-8 text: {exc.reason}") from None

    def _render(
        self,
        lines: Sequence[tuple[int, trajectory_pb2.Trajectory]],
        rendering: _Rendering,
        progress: Progress,
        stop: threading.Event,
    ) -> PreparedRows:
        out = PreparedRows()
        total = len(lines)
        progress(0, total)
        last = time.monotonic()
        for done, (line, row) in enumerate(lines, start=1):
            if stop.is_set():
                raise OrchardError(Reason.ABORTED, "the caller went away; nothing was written")
            self._one(out, line, row, rendering)
            if time.monotonic() - last >= PROGRESS_EVERY_S or done == total:
                progress(done, total)
                last = time.monotonic()
        return out

    @staticmethod
    def _one(
        out: PreparedRows,
        line: int,
        row: trajectory_pb2.Trajectory,
        rendering: _Rendering,
    ) -> None:
        tools = rendering.tools
        if row.turns:
            bad = _outside_vocabulary(row, rendering.tokenizer.vocab_size)
            if bad:
                out.fail(row, line, "token_out_of_vocabulary", bad)
                return
            out.rows.append(row)
            out.passed += 1
            return
        if not row.conversation_json:
            out.fail(
                row,
                line,
                "no_conversation",
                "the row carries neither turns nor a conversation to render",
            )
            return
        if row.harness not in tools:
            known = ", ".join(sorted(tools)) or "none"
            out.fail(
                row,
                line,
                "unknown_harness",
                f"no tools were given for harness {row.harness!r} (given: {known}); its "
                "conversation cannot be rendered as the model saw it",
            )
            return
        try:
            rendered = teacher_trajectory(
                row,
                rendering.tokenizer.renderer,
                tools[row.harness],
                teacher_model=rendering.source_model,
            )
        except TrajectoryBuildError as exc:
            out.fail(row, line, exc.reason, str(exc))
            return
        out.rows.append(rendered)
        out.rendered += 1

    @staticmethod
    def _check_samples(
        prepared: PreparedRows,
        lines: Sequence[tuple[int, trajectory_pb2.Trajectory]],
        config: SampleConfig,
        cut: Callable[[trajectory_pb2.Trajectory, SampleConfig], list[Sample | Skip]],
    ) -> dict[int, tuple[int, Counter[str]]]:
        """Each row's SFT sample count and skip reasons (by object id), its samples cut by
        `cut`; a row whose turns, credit spans or images cannot make a sample is moved to the
        unrendered ones."""
        line_of = {row.id: line for line, row in lines}
        counts: dict[int, tuple[int, Counter[str]]] = {}
        kept = []
        for row in prepared.rows:
            try:
                built = cut(row, config)
            except TrajectoryError as exc:
                prepared.fail(row, line_of.get(row.id, 0), "malformed_trajectory", str(exc))
                continue
            skips = Counter(str(b.reason) for b in built if isinstance(b, Skip))
            counts[id(row)] = (len(built) - sum(skips.values()), skips)
            kept.append(row)
        prepared.rows = kept
        return counts

    def _write(self, url: str, rows: Sequence[trajectory_pb2.Trajectory]) -> str:
        from google.protobuf import json_format  # noqa: PLC0415

        if self.store.exists(url):
            raise OrchardError(
                Reason.ALREADY_EXISTS,
                f"output {url!r} was written meanwhile by another call; name a new URL",
            )
        with self.store.open_write(url) as handle:
            for row in rows:
                handle.write((json_format.MessageToJson(row, indent=None) + "\n").encode())
        return url


def _outside_vocabulary(row: trajectory_pb2.Trajectory, vocab_size: int) -> str:
    for turn in row.turns:
        for name in ("input_token_ids", "output_token_ids"):
            if any(t < 0 or t >= vocab_size for t in getattr(turn, name)):
                return (
                    f"turn {turn.index}: {name} holds ids outside the model's vocabulary "
                    f"[0, {vocab_size}): the row is in another model's tokens"
                )
    return ""


def _vision_tokenizer(model: str, folder: Path) -> _Tokenizer:
    """A vision-language model folder's renderer: its processor, screenshots included."""
    from transformers import AutoProcessor  # noqa: PLC0415

    from orchard.lm.vision import VisionChatRenderer  # noqa: PLC0415
    from orchard.trainer.vision import VisionInputs  # noqa: PLC0415

    try:
        processor = AutoProcessor.from_pretrained(str(folder), local_files_only=True)  # type: ignore[no-untyped-call]
        renderer = VisionChatRenderer(processor)
    except (OSError, ValueError) as exc:  # ChatFormatError is a ValueError
        raise _invalid(
            f"model {model!r} is a vision-language model whose processor cannot render the "
            f"conversations: {exc}"
        ) from None
    vocab = _vocab_size(folder, len(renderer.tokenizer))
    return _Tokenizer(renderer, vocab, VisionInputs(renderer).sft_samples)


def _vocab_size(folder: Path, tokenizer_size: int) -> int:
    """The model's vocabulary: its config's `vocab_size` (embeddings may be padded past the
    tokenizer; a vision-language config keeps it in `text_config`), else the tokenizer's
    size."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        text = config.get("text_config")
        size = config.get("vocab_size") or (text.get("vocab_size") if isinstance(text, dict) else 0)
        return max(int(size or 0), tokenizer_size)
    except (OSError, ValueError, TypeError, AttributeError):
        return tokenizer_size

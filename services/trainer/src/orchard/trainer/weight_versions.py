"""Weight versions through orchard-trainer: what GetWeightVersion, ListWeightVersions and
PublishModel do.

Clients (a recipe on a laptop) read published versions and publish a starting model here
instead of reaching etcd or building a model themselves: a built-in model is built by this
service from its seed, exactly as a training job builds it, saved into the artifact store once
per content and published, so a job started from the published location starts from the same
weights. Publishing is idempotent per version.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from orchard.core.artifacts import ArtifactStore
from orchard.core.errors import OrchardError, Reason
from orchard.lm.weights import (
    InvalidWeightVersion,
    WeightRegistry,
    WeightVersion,
    WeightVersionConflict,
)
from orchard.trainer.jobs import SpecError, check_artifacts
from orchard.trainer.v1 import trainer_service_pb2 as api

__all__ = ["WeightVersions", "weight_version_proto"]

MAX_PAGE = 1000
SOURCE = "source"
"""Metadata key: the model a version was published from (PublishModel's `model`)."""
SEED = "seed"
"""Metadata key: a built-in model's seed."""


def _invalid(message: str) -> OrchardError:
    return OrchardError(Reason.INVALID_ARGUMENT, message)


def weight_version_proto(model: str, version: WeightVersion) -> api.WeightVersion:
    proto = api.WeightVersion(
        model=model,
        version=version.version,
        number=version.number,
        location=version.location,
        metadata=dict(version.metadata),
    )
    proto.publish_time.FromNanoseconds(int(version.published_at * 1e9))
    return proto


def _digest(folder: Path) -> str:
    """A digest of a folder's file names and contents: the same weights get the same URL."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:24]


def build_builtin(model: str, seed: int, store: ArtifactStore, scratch: Path) -> str:
    """`model` ("builtin:<size>") built from `seed` as a training job builds it, saved as a
    model folder into `store` (once per content); its URL. Blocks: run it off the loop."""
    from orchard.lm.model_folder import save_model_folder  # noqa: PLC0415
    from orchard.trainer.policy import PolicyError, load_policy  # noqa: PLC0415

    try:
        policy = load_policy(model, seed=seed)
    except PolicyError as exc:
        raise _invalid(f"model: {exc}") from None
    assert policy.tokenizer is not None  # built-in models carry the offline tokenizer
    scratch.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="publish-", dir=scratch))
    try:
        folder = save_model_folder(
            work / "model",
            policy.model,
            policy.tokenizer,
            metadata={SOURCE: model, SEED: str(seed)},
        )
        url = store.url("models", f"{model.removeprefix('builtin:')}-{_digest(folder)}")
        if not store.exists(url):
            try:
                store.put_dir(folder, url)
            except OrchardError:
                if not store.exists(url):
                    raise
                # another replica put the same content there first: the same bytes
        return url
    finally:
        shutil.rmtree(work, ignore_errors=True)


class WeightVersions:
    """The registry's versions as the weight RPCs read and publish them."""

    def __init__(
        self, registry: WeightRegistry, store: ArtifactStore, scratch: Path, cache: Path
    ) -> None:
        self.registry = registry
        self.store = store
        self.scratch = scratch
        self.cache = cache
        self._publishing = asyncio.Lock()

    def _of(self, model: str) -> WeightRegistry:
        try:
            return self.registry.for_model(model or self.registry.model)
        except InvalidWeightVersion as exc:
            raise _invalid(f"model: {exc}") from None

    async def get(self, model: str, version: str) -> api.WeightVersion:
        registry = self._of(model)
        try:
            found = await (registry.get(version) if version else registry.latest())
        except InvalidWeightVersion as exc:
            raise _invalid(f"version: {exc}") from None
        if found is None:
            which = f"version {version!r}" if version else "any version"
            raise OrchardError(
                Reason.NOT_FOUND,
                f"{which} of model {registry.model!r} is not published; a training job's "
                "Step or PublishCheckpoint publishes one, PublishModel publishes a model",
            )
        return weight_version_proto(registry.model, found)

    async def list(
        self, model: str, page_size: int, page_token: str
    ) -> tuple[list[api.WeightVersion], str]:
        """One page, oldest first; the token is the last number given (numbers never shift)."""
        if not 0 <= page_size <= MAX_PAGE:
            raise _invalid(f"page_size must lie in [0, {MAX_PAGE}], got {page_size}")
        after = 0
        if page_token:
            if not page_token.isdigit():
                raise _invalid(
                    f"page_token {page_token!r} is not one this service gave: pass a previous "
                    "response's next_page_token, or none for the first page"
                )
            after = int(page_token)
        registry = self._of(model)
        size = page_size or 100
        later = [v for v in await registry.versions() if v.number > after]
        page = later[:size]
        token = str(page[-1].number) if len(later) > size else ""
        return [weight_version_proto(registry.model, v) for v in page], token

    async def publish_model(self, request: api.PublishModelRequest) -> api.PublishModelResponse:
        """PublishModel: see the proto. One publish at a time in this process: a built-in
        model is built once even when a client retries while the first call still builds."""
        registry = self._of(request.weight_model)
        model = request.model
        if not model:
            raise _invalid('model is empty: give "builtin:<size>" or a model folder\'s URL')
        builtin = model.startswith("builtin:")
        async with self._publishing:
            try:
                existing = await registry.get(request.version)
            except InvalidWeightVersion as exc:
                raise _invalid(f"version: {exc}") from None
            location = "" if builtin else await asyncio.to_thread(self._checked_folder, model)
            if existing is not None:
                self._same_source(registry.model, existing, model, request.seed, location)
                return api.PublishModelResponse(
                    weight_version=weight_version_proto(registry.model, existing), created=False
                )
            if builtin:
                location = await asyncio.to_thread(
                    build_builtin, model, request.seed, self.store, self.scratch
                )
            metadata: Mapping[str, str] = {
                **request.metadata,
                SOURCE: model,
                **({SEED: str(request.seed)} if builtin else {}),
            }
            try:
                published = await registry.publish(request.version, location, metadata)
            except WeightVersionConflict as exc:
                raise OrchardError(Reason.ALREADY_EXISTS, str(exc)) from None
        return api.PublishModelResponse(
            weight_version=weight_version_proto(registry.model, published), created=True
        )

    def _checked_folder(self, url: str) -> str:
        """`url`, refused when it names no model folder with a tokenizer the store holds."""
        try:
            check_artifacts(api.TrainingJobSpec(model=url), self.store, self.cache)
        except SpecError as exc:
            raise _invalid(str(exc).replace("spec.model", "model")) from None
        return url

    @staticmethod
    def _same_source(
        model: str, existing: WeightVersion, source: str, seed: int, location: str
    ) -> None:
        """ALREADY_EXISTS when `existing` was published from another model or seed."""
        if source.startswith("builtin:"):
            same = existing.metadata.get(SOURCE) == source and existing.metadata.get(SEED) == str(
                seed
            )
            was = f"{existing.metadata.get(SOURCE, '?')} seed {existing.metadata.get(SEED, '?')}"
            asked = f"{source} seed {seed}"
        else:
            same = existing.location == location
            was, asked = existing.location, location
        if not same:
            raise OrchardError(
                Reason.ALREADY_EXISTS,
                f"version {existing.version!r} of {model!r} is already published from {was}, "
                f"not {asked}; publish these weights under a new version",
            )

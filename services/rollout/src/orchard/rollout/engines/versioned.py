"""The lifecycle every engine that serves model folders shares, written once: start (the
configured folder, else the first version published in the weight registry, waited for), follow
the registry (each newer version loaded and swapped in; etcd outages retried, unloadable
versions logged and skipped), `load_version`, close.

An engine subclasses `VersionedEngine` and says only how it loads a folder (`_swap`), what it
starts beside the follower (`_on_start`) and how it lets go of its model (`_shutdown`). No
import of etcd or the artifact layer happens before a registry or a published URL is used, so
the module also imports in vLLM's own environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Coroutine
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

from orchard.rollout.engines.base import NoWeightsLoaded
from orchard.rollout.engines.config import EngineSettings

if TYPE_CHECKING:
    from orchard.lm.weights import WeightRegistry, WeightVersion

__all__ = ["VersionedEngine", "fetch_model_folder"]

log = logging.getLogger(__name__)

C = TypeVar("C", bound=EngineSettings)


class VersionedEngine(ABC, Generic[C]):
    """Start, follow the weight registry, load versions, close; see the module docstring.

    `async with Engine(config, registry=registry) as engine:` starts it; every generation
    reports the one version that sampled all of it.
    """

    def __init__(self, config: C, *, registry: WeightRegistry | None = None) -> None:
        self.config = config
        self._registry = registry
        self._loading = asyncio.Lock()
        self._loaded = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        self._closed = False
        self.load_times: list[tuple[str, float]] = []
        """(version, seconds from asking to serving it) for every version loaded, in order."""

    # -- what an engine says ------------------------------------------------------------

    @property
    @abstractmethod
    def weight_version(self) -> str:
        """The version new requests are sampled with (empty before any is loaded)."""

    @abstractmethod
    async def _swap(self, version: str, folder: str) -> None:
        """Load the model folder `folder` and sample new requests with it as `version`.
        Raises when the folder cannot be served (the old version stays)."""

    async def _prepare(self) -> None:
        """Checks before anything loads (e.g. that the engine's library is installed)."""

    def _on_start(self) -> None:
        """Start what the engine runs beside the registry follower (with `_spawn`)."""

    def _interrupt(self) -> None:
        """Ask work running in threads to stop (before the engine's tasks are cancelled)."""

    async def _shutdown(self) -> None:
        """Release the model and fail requests still waiting (`EngineClosed`)."""

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the weights (the configured folder, else the first published version) and start
        serving and following the registry. Raises `NoWeightsLoaded` when there is nothing to
        load or nothing was published within `first_version_timeout_s`."""
        if self._started:
            raise RuntimeError("the engine is already started")
        self._started = True
        settings = self.config
        try:
            await self._prepare()
            if not self.weight_version and settings.model_folder is not None:
                await self.load_version(settings.weight_version, settings.model_folder)
            registry = self._registry
            if registry is not None and (not self.weight_version or settings.follow_registry):
                self._spawn(self._follow(registry))
            self._on_start()
            if not self.weight_version:
                if registry is None:
                    raise NoWeightsLoaded("the engine needs a model_folder, weights or a registry")
                try:
                    async with asyncio.timeout(settings.first_version_timeout_s):
                        await self.wait_for_weights()
                except TimeoutError:
                    raise NoWeightsLoaded(
                        f"no version of {settings.registry_model!r} was published and loaded "
                        f"within {settings.first_version_timeout_s} s"
                    ) from None
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Stop following and serving; requests still waiting fail with `EngineClosed`."""
        self._closed = True
        self._interrupt()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self._shutdown()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def running(self) -> bool:
        return self._started and not self._closed

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        self._tasks.append(asyncio.create_task(work))

    # -- versions -------------------------------------------------------------------------

    async def load_version(self, version: str, folder: str) -> None:
        """Sample with `version` (the model folder `folder`) from the next request on; a
        version already served is not loaded again. One load at a time."""
        begun = time.perf_counter()
        async with self._loading:
            if self.weight_version == version:
                return
            await self._swap(version, folder)
            self.load_times.append((version, time.perf_counter() - begun))
        await self._announce()
        log.info("%s now samples with weight version %s", type(self).__name__, version)

    async def wait_for_weights(self, version: str | None = None) -> None:
        """Wait until weights are loaded (`version` if given); bound it with `asyncio.timeout`."""

        def ready() -> bool:
            current = self.weight_version
            return bool(current) and (version is None or current == version)

        async with self._loaded:
            await self._loaded.wait_for(ready)

    async def _announce(self) -> None:
        """Wake `wait_for_weights` callers: the served version changed."""
        async with self._loaded:
            self._loaded.notify_all()

    async def _follow(self, registry: WeightRegistry) -> None:
        from orchard.core.etcd import EtcdError  # noqa: PLC0415 (only with a registry)

        while True:
            try:
                async with registry.watch() as updates:
                    async for version in updates:
                        await self._load_published(version)
            except EtcdError as e:
                log.warning("weight registry watch failed (%s); retrying", e)
            await asyncio.sleep(self.config.retry_interval_s)

    async def _load_published(self, version: WeightVersion) -> None:
        if version.version == self.weight_version:
            return
        try:
            folder = await asyncio.to_thread(fetch_model_folder, version.location)
            await self.load_version(version.version, str(folder))
        except Exception as e:  # an unloadable version must not stop the follower
            log.error(
                "cannot load weight version %s from %s: %s", version.version, version.location, e
            )


def fetch_model_folder(location: str) -> Path:
    """A local folder holding the model folder at `location`, read through the artifact layer
    (file:// in place on the shared volume; other stores downloaded once per URL).

    The registry is the operator's (only the trainer publishes), so a published URL is the one
    prefix this read may touch; it is still checked for its form (no '..', no chaining).
    A bare path (an operator's `model_folder` setting) is taken as ``file://`` + its absolute
    form.
    """
    from orchard.core.artifacts import ArtifactError, ArtifactStore, as_url  # noqa: PLC0415
    from orchard.lm.model_folder import ModelFolderError  # noqa: PLC0415

    try:
        url = as_url(location)
        return ArtifactStore(url).get_dir(url)
    except ArtifactError as e:
        raise ModelFolderError(f"model folder {location}: {e.message}") from None

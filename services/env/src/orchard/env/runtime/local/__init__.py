"""The ``local`` runtime: sandboxes as namespaced process trees on this host (see
:mod:`orchard.env.runtime.local.runtime`)."""

from orchard.env.runtime.local.config import LocalRuntimeConfig
from orchard.env.runtime.local.runtime import LocalRuntime

__all__ = ["LocalRuntime", "LocalRuntimeConfig"]

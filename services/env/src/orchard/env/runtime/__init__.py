"""Sandbox runtimes: one interface (:mod:`orchard.env.runtime.base`), one module per backend.

Backends are imported lazily by :func:`orchard.env.runtime.create_runtime`, so a service that
runs ``local`` never imports a Kubernetes client and the reverse.
"""

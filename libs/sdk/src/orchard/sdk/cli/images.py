"""``orchard images prepull``: pull a recipe's images on chosen nodes before a run.

::

    orchard images prepull --config env.yaml python:3.12-slim ghcr.io/acme/swe-task:7
    orchard images prepull --kubeconfig ~/.kube/config --namespace orchard-sandboxes \\
        --inagent-image ghcr.io/orchard-dev/orchard-inagent:0.1.0 --nodes gpu-1,gpu-2 IMAGE

An operator's command: it talks to the Kubernetes API with the env service's ``kubernetes``
runtime (the ``orchard-env`` package must be installed) and its configuration (``--config``:
the env service's config file, its ``runtime`` section; flags override it). One Pod per node
pulls the images and exits; the nodes then hold them, and sandboxes prefer those nodes (image
locality). Progress goes to stderr as pulls finish, a table (or ``--json``) to stdout. Exit
status 0 when every image is on every node, 1 when a pull failed or timed out, 2 for a command
line or configuration that cannot work.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from orchard.sdk.cli.output import print_table
from orchard.sdk.cli.sandbox import UsageError

__all__ = ["add_images_commands"]


def add_images_commands(subparsers: Any, formatter: type[argparse.HelpFormatter]) -> None:
    images = subparsers.add_parser(
        "images",
        help="images on the nodes of a Kubernetes cluster",
        description="Images on the nodes that run sandboxes (the kubernetes runtime).",
        formatter_class=formatter,
    )
    commands = images.add_subparsers(dest="images_command", metavar="COMMAND", required=True)
    prepull = commands.add_parser(
        "prepull",
        help="pull images on chosen nodes ahead of a run",
        description=__doc__,
        formatter_class=formatter,
    )
    prepull.add_argument("images", nargs="+", metavar="IMAGE", help="image references to pull")
    prepull.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="the env service's config file; its `runtime` section (type: kubernetes) is used",
    )
    prepull.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster)")
    prepull.add_argument("--api-url", help="API server URL without credentials (kubectl proxy)")
    prepull.add_argument("--namespace", help="the sandbox namespace the Pods run in")
    prepull.add_argument("--inagent-image", help="the orchard-inagent image (its no-op runs)")
    where = prepull.add_mutually_exclusive_group()
    where.add_argument(
        "--nodes", help="comma-separated node names (default: the sandbox pool's nodes)"
    )
    where.add_argument(
        "--node-selector",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="nodes with this label (repeatable; default: the runtime's node_selector)",
    )
    prepull.add_argument(
        "--timeout", type=float, metavar="SECONDS", help="give up on pulls after this long"
    )
    prepull.add_argument("--json", action="store_true", help="print the result as JSON")
    prepull.set_defaults(run=_run_prepull)


def _runtime_settings(args: argparse.Namespace) -> dict[str, Any]:
    import yaml  # noqa: PLC0415 - only this command reads YAML

    settings: dict[str, Any] = {}
    if args.config is not None:
        try:
            data = yaml.safe_load(args.config.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise UsageError(f"--config {args.config}: {exc}") from None
        runtime = data.get("runtime") if isinstance(data, dict) else None
        if not isinstance(runtime, dict) or runtime.get("type") != "kubernetes":
            raise UsageError(
                f"--config {args.config}: no `runtime: {{type: kubernetes, ...}}` section"
            )
        settings.update(runtime)
    for flag, key in (
        ("kubeconfig", "kubeconfig"),
        ("api_url", "api_url"),
        ("namespace", "namespace"),
        ("inagent_image", "inagent_image"),
    ):
        value = getattr(args, flag)
        if value:
            settings[key] = value
    settings["type"] = "kubernetes"
    return settings


def _selector(pairs: list[str]) -> dict[str, str] | None:
    if not pairs:
        return None
    selector = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--node-selector {pair!r}: want KEY=VALUE")
        selector[key] = value
    return selector


def _run_prepull(args: argparse.Namespace) -> int:
    try:
        from orchard.env.runtime.kubernetes.config import (  # noqa: PLC0415 - this command only
            KubernetesRuntimeConfig,
        )
        from orchard.env.runtime.kubernetes.runtime import KubernetesRuntime  # noqa: PLC0415
    except ImportError:
        sys.stderr.write(
            "orchard images prepull: needs the orchard-env package (pip install orchard-env): "
            "it drives the env service's kubernetes runtime\n"
        )
        return 2
    from pydantic import ValidationError  # noqa: PLC0415

    try:
        config = KubernetesRuntimeConfig(**_runtime_settings(args))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise UsageError(f"runtime configuration: {problems}") from None
    nodes = [n.strip() for n in (args.nodes or "").split(",") if n.strip()]
    selector = _selector(args.node_selector)
    return asyncio.run(_prepull(KubernetesRuntime(config), args, nodes, selector))


async def _prepull(
    runtime: Any, args: argparse.Namespace, nodes: list[str], selector: dict[str, str] | None
) -> int:
    from orchard.env.runtime.base import RuntimeUnavailable  # noqa: PLC0415

    final = None
    reported: set[tuple[str, str, str]] = set()
    try:
        await runtime.start()
        updates = runtime.prepull_images(
            args.images, nodes, node_selector=selector, timeout_s=args.timeout
        )
        async with contextlib.aclosing(updates) as progress_updates:
            async for progress in progress_updates:
                for state in progress.states:
                    key = (state.node, state.image, state.status)
                    if state.status != "waiting" and key not in reported:
                        reported.add(key)
                        detail = f": {state.message}" if state.message else ""
                        sys.stderr.write(f"{state.node}  {state.image}  {state.status}{detail}\n")
                sys.stderr.write(
                    f"prepull: {progress.count('done')}/{progress.total} pulled, "
                    f"{progress.count('failed')} failed\n"
                )
                final = progress
    except ValueError as exc:
        sys.stderr.write(f"orchard images prepull: {exc}\n")
        return 2
    except RuntimeUnavailable as exc:
        sys.stderr.write(f"orchard images prepull: {exc}\n")
        return 1
    finally:
        await runtime.close()
    if final is None:
        return 1
    if args.json:
        rows = [
            {"node": s.node, "image": s.image, "status": s.status, "message": s.message}
            for s in final.states
        ]
        sys.stdout.write(json.dumps({"states": rows}, indent=2) + "\n")
    else:
        print_table(
            ["NODE", "IMAGE", "STATUS", "MESSAGE"],
            [[s.node, s.image, s.status, s.message] for s in final.states],
        )
    return 0 if final.count("done") == final.total else 1

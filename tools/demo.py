"""Orchard's main job on embedded defaults: the built-in recipe end to end, ending in a report.

Run it with `make demo` (needs root: the local runtime uses namespaces, cgroups and an overlay
over the host root). It starts an embedded etcd, orchard-env with the local runtime,
orchard-reward, orchard-rollout and orchard-trainer as processes under ``runs/demo/stack``, runs
the built-in recipe (``orchard recipe check`` shows it) against them with a progress bar per
stage, and prints the held-out resolve rates and where the report is
(``runs/demo/builtin-swe/report/report.md``). Everything it starts, it stops.

``--resume`` keeps the previous demo's outputs and continues at the first unfinished stage;
without it the demo starts from nothing.

``--recipe claw`` (``make demo-claw``) runs the built-in Claw recipe instead: personal-assistant
tasks through unmodified agent programs from the harness cache ``make harnesses`` builds
(Claude Code and Codex to train with, OpenClaw held out), the student's calls captured through
the rollout service's proxy, which listens on this host's address for the sandboxes.

``--recipe gui`` (``make demo-gui``) runs the built-in GUI recipe: web tasks in browser
sandboxes (the browser folder ``make gui-browser`` builds; the stack's tenant may give
sandboxes user namespaces, for Chromium's own sandbox), scored by the reward service's built-in
state judge.

``--experiment FILE`` (``make experiment``) runs an experiment file instead (`orchard experiment
run`: every arm once per seed, compared in ``report/experiment.md``) on the same kind of stack,
its runs and stack under ``runs/experiments/<name>``; with ``--resume`` it goes on where it
stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

from orchard.core.config import ConfigError
from orchard.recipes.experiment import run_experiment
from orchard.recipes.pipeline import StageError, run_recipe
from orchard.recipes.workspace import StackEndpoints
from orchard.rollout.harnesses.sandboxed import MANIFEST, host_address
from orchard.sdk.cli.host_probe import remove_cgroup_parent
from orchard.sdk.cli.stack import LocalStack, StackError
from orchard.sdk.experiment import load_experiment
from orchard.sdk.recipe import BUILTIN_RECIPES, builtin_recipe, load_recipe

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "runs" / "demo"
HARNESS_CACHE = ROOT / ".cache" / "harnesses"
"""Where `make harnesses` puts the agent programs (tools/harnesses.py)."""
GUI_BROWSER_DIR = ROOT / ".cache" / "gui-browser"
"""Where `make gui-browser` puts the folder browser sandboxes run Chromium's tool server from."""
BOLD, RESET = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rate(value: float | None) -> str:
    """A pass@k figure; "n/a" where no task had k scored attempts."""
    return "n/a" if value is None else f"{value:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resume", action="store_true", help="continue the previous demo")
    parser.add_argument("--workers", type=int, default=4, help="rollouts at once (default 4)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder of the run and its stack (runs/demo; runs/demo-claw, runs/demo-gui for the "
        "Claw and GUI recipes)",
    )
    parser.add_argument(
        "--recipe",
        choices=BUILTIN_RECIPES,
        default="swe",
        help="the built-in recipe: swe (default), claw (agent programs; `make harnesses`) or gui "
        "(browser sandboxes; `make gui-browser`)",
    )
    parser.add_argument(
        "--experiment",
        type=Path,
        default=None,
        help="run this experiment file (its arms and seeds, compared) in place of one recipe",
    )
    args = parser.parse_args()
    name = f"builtin-{args.recipe}"
    experiment = None
    if args.experiment is not None:
        try:
            experiment, default_out = load_experiment(args.experiment, workdir=ROOT)
        except ConfigError as exc:
            sys.stderr.write(f"demo: {args.experiment} is not a valid experiment:\n{exc}\n")
            return 2
        if experiment.recipe.removeprefix("builtin:") in BUILTIN_RECIPES:
            args.recipe = experiment.recipe.removeprefix("builtin:")
        if args.out is None:
            args.out = default_out
    demo: Path = (
        args.out or (DEMO if args.recipe == "swe" else DEMO.with_name(f"demo-{args.recipe}"))
    ).resolve()
    # SIGTERM ends the demo like Ctrl-C: the stack it started is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if os.geteuid() != 0:
        sys.stderr.write("demo: the local runtime needs root (namespaces, cgroups); run as root\n")
        return 2
    if not args.resume:
        shutil.rmtree(demo, ignore_errors=True)
    demo.mkdir(parents=True, exist_ok=True)
    rollout_settings: dict[str, object] = {}
    env_settings: list[str] = []
    if args.recipe == "gui":
        from orchard.tasks.gui.browser_dir import LAUNCHER  # noqa: PLC0415

        browser = Path(os.environ.get("ORCHARD_GUI_BROWSER_DIR") or GUI_BROWSER_DIR).absolute()
        if not (browser / LAUNCHER).exists():
            sys.stderr.write(
                f"demo: the GUI recipe runs Chromium's tool server from {browser}, which has "
                "none: run `make gui-browser` first\n"
            )
            return 2
        rollout_settings = {"gui": {"browser_dir": str(browser)}}
        # Chromium keeps its own sandbox (a user namespace) as an unprivileged user.
        env_settings = ['privileges.user_namespaces=["*"]']
    if args.recipe == "claw":
        cache = Path(os.environ.get("ORCHARD_HARNESS_CACHE") or HARNESS_CACHE)
        if not (cache / MANIFEST).exists():
            sys.stderr.write(
                f"demo: the Claw recipe runs agent programs from {cache}, which has none: run "
                "`make harnesses` first (a minute, 2.1 GiB, from the package registries)\n"
            )
            return 2
        address = host_address()
        if address.startswith("127."):
            sys.stderr.write(
                "demo: the Claw recipe's agent programs reach the model through an address of "
                "this host other than loopback, and this host has none (no default route)\n"
            )
            return 2
        rollout_settings = {
            "proxy": {"host": address},
            "harnesses": {"cache_dir": str(cache)},
        }
    recipe = load_recipe(builtin_recipe(args.recipe), workdir=demo).model_copy(
        update={"output_dir": demo / name}
    )
    token = secrets.token_urlsafe(16)
    metrics = f"127.0.0.1:{_free_port()}"
    reward = f"127.0.0.1:{_free_port()}"
    rollout = f"127.0.0.1:{_free_port()}"
    trainer = f"127.0.0.1:{_free_port()}"
    cgroup = f"orchard-demo-{uuid.uuid4().hex[:8]}"
    run_dir = Path(tempfile.mkdtemp(prefix="od-"))  # sandbox socket paths must stay short
    stack = LocalStack(
        demo / "stack",
        listen=f"127.0.0.1:{_free_port()}",
        token=token,
        runtime={"cgroup_parent": cgroup, "run_dir": str(run_dir)},
        settings=[f"server.metrics_address={metrics}", *env_settings],
        services={"reward": reward, "rollout": rollout, "trainer": trainer},
        service_settings={"rollout": rollout_settings} if rollout_settings else None,
    )
    started = time.monotonic()
    if experiment is not None:
        print(
            f"{BOLD}Orchard experiment{RESET} {experiment.name}: {len(experiment.arms)} arm(s) x "
            f"{len(experiment.seeds)} seed(s) of {experiment.recipe}, here"
        )
    else:
        print(f"{BOLD}Orchard demo{RESET}: the built-in {args.recipe} recipe, every stage, here")
    try:
        with stack:
            print(
                f"  services: etcd {stack.etcd_endpoint}, env {stack.endpoint}, "
                f"reward {reward}, rollout {rollout}, trainer {trainer}"
            )
            endpoints = StackEndpoints(
                env=stack.endpoint,
                env_token=token,
                reward=reward,
                etcd=stack.etcd_endpoint,
                trainer=trainer,
                rollout=rollout,
                env_metrics=metrics,
                artifacts=stack.artifacts_url,
            )
            if experiment is not None:
                report = run_experiment(
                    experiment,
                    demo,
                    args.experiment.resolve().parent,
                    endpoints,
                    workers=args.workers,
                    source=str(args.experiment),
                )
            else:
                report = run_recipe(recipe, endpoints, workers=args.workers)
    except (StackError, StageError) as exc:
        sys.stderr.write(f"demo: {exc}\n")
        return 1
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        try:
            remove_cgroup_parent(cgroup)
        except OSError as exc:
            sys.stderr.write(f"demo: cgroup {cgroup} not removed: {exc}\n")
    if experiment is not None:
        shown = report.relative_to(ROOT) if report.is_relative_to(ROOT) else report
        print(f"\nexperiment report: {shown}  ({time.monotonic() - started:.0f} s in all)")
        return 0
    summary = json.loads((report.parent / "report.json").read_text())
    print(f"\n{BOLD}Held-out resolve rate{RESET}")
    for evaluation in summary.get("evaluations", []):
        low, high = evaluation["interval"]
        print(
            f"  {evaluation['model']:<5} {evaluation['resolved']:>3}/{evaluation['attempts']:<3} "
            f"{evaluation['resolved'] / max(1, evaluation['attempts']):6.1%}  "
            f"(95% interval {low:.0%} to {high:.0%})"
        )
    shown = report.relative_to(ROOT) if report.is_relative_to(ROOT) else report
    for evaluation in summary.get("evaluations", []):
        for row in evaluation.get("harnesses", []):
            k = row.get("k", 1)
            held = " (held out)" if row.get("held_out") else ""
            excluded = f", {row['excluded']} excluded" if row.get("excluded") else ""
            print(
                f"  {evaluation['model']:<5} {row['harness']}{held}: "
                f"{row['resolved']}/{row['attempts']}{excluded}, "
                f"pass@{k} {_rate(row.get('pass_at_k'))}, pass^{k} {_rate(row.get('pass_hat_k'))}"
            )
    print(f"\nreport: {shown}  ({time.monotonic() - started:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

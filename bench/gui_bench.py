"""Concurrent browser episodes: how many this machine holds, and what each action costs.

    .venv/bin/python bench/gui_bench.py [--sizes 1,2,4,8] [--actions 20] [--json FILE]

Needs root: it starts a private etcd and orchard-env with the local runtime (tenants may give
sandboxes user namespaces, for Chromium's own sandbox), and the browser folder ``make
gui-browser`` builds (``.cache/gui-browser``, or ``$ORCHARD_GUI_BROWSER``).

For each size N it opens N browser episodes at once (`orchard.tasks.gui.episode`: a site
sandbox serving the playground and a browser sandbox allowed to reach it, the browser as an
unprivileged user with Chromium's sandbox on), then each runs the same script of actions
(``goto_url``, ``scroll``, ``hover``, ``click``, ``press_keys``, ``wait`` 0, round and round)
until it has made ``--actions``, all N at once. Reported per size:

  - open s: opening one episode (both sandboxes, both servers), median;
  - actions/s: every episode's actions over the wall time of the whole size;
  - action p50/p99 ms: one call as the client sees it (an exec of ``orchard-browser-call``:
    the action, its settling and the screenshot);
  - browser p50/p99 ms: the same calls as the browser measured them (``elapsed_s``), so the
    difference is the exec path's cost;
  - browser MiB, site MiB: PSS summed over each sandbox's processes (their ``smaps_rollup``,
    read on the host for the processes whose cgroup names the sandbox), median over the
    episodes, after the script.

Sizes stop growing at the first that fails to open or run, or that would not fit the memory the
machine has left (MemAvailable, keeping 1 GiB), and the report says which limit came first.

The floor, in the same run: the same script on a `BrowserSession` in this process (no
sandboxes, no exec), one browser.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchard.sdk import AsyncSandboxClient
from orchard.sdk.cli.bench import _free_port
from orchard.sdk.cli.host_probe import remove_cgroup_parent
from orchard.sdk.cli.stack import LocalStack
from orchard.tasks.gui.browser import BrowserConfig, BrowserSession
from orchard.tasks.gui.browser_dir import LAUNCHER, build_browser_dir
from orchard.tasks.gui.episode import BrowserEpisode, BrowserSandboxSettings
from orchard.tasks.gui.sites import SiteServer

if TYPE_CHECKING:
    from bench.harness_bench import sandbox_pss_kib
else:  # bench scripts run with bench/ on sys.path
    from harness_bench import sandbox_pss_kib

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "gui.json"


def script(base_url: str) -> list[tuple[str, dict[str, Any]]]:
    """One round of the actions every episode repeats."""
    return [
        ("goto_url", {"url": f"{base_url}/playground/"}),
        ("scroll", {"x": 640, "y": 400, "direction": "down", "amount": 300}),
        ("hover", {"x": 640, "y": 300}),
        ("click", {"x": 640, "y": 300}),
        ("press_keys", {"keys": ["Tab"]}),
        ("wait", {"seconds": 0}),
    ]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def mem_available_mib() -> float:
    with open("/proc/meminfo", encoding="ascii") as file:
        for line in file:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def run_episode(
    episode: BrowserEpisode, actions: int
) -> tuple[list[float], list[float], int]:
    rounds = script(episode.base_url)
    client_ms, browser_ms, failed = [], [], 0
    for index in range(actions):
        tool, arguments = rounds[index % len(rounds)]
        started = time.perf_counter()
        observation = await episode.call(tool, arguments)
        client_ms.append((time.perf_counter() - started) * 1000)
        browser_ms.append(observation.elapsed_s * 1000)
        failed += not observation.ok
    return client_ms, browser_ms, failed


async def one_size(
    client: AsyncSandboxClient, settings: BrowserSandboxSettings, size: int, actions: int
) -> dict[str, Any]:
    async def open_one() -> tuple[BrowserEpisode, float]:
        started = time.perf_counter()
        episode = await BrowserEpisode.open(
            client, settings, sites=["playground"], seed=1, lifetime_s=900
        )
        return episode, time.perf_counter() - started

    opened = await asyncio.gather(*(open_one() for _ in range(size)), return_exceptions=True)
    episodes = [item[0] for item in opened if not isinstance(item, BaseException)]
    errors = [repr(item) for item in opened if isinstance(item, BaseException)]
    try:
        if errors:
            return {"size": size, "failed": f"{len(errors)} of {size} did not open: {errors[0]}"}
        started = time.perf_counter()
        runs = await asyncio.gather(
            *(run_episode(e, actions) for e in episodes), return_exceptions=True
        )
        wall = time.perf_counter() - started
        broken = [repr(r) for r in runs if isinstance(r, BaseException)]
        if broken:
            return {"size": size, "failed": f"{len(broken)} of {size} broke: {broken[0]}"}
        done = [r for r in runs if not isinstance(r, BaseException)]
        client_ms = [v for r in done for v in r[0]]
        browser_ms = [v for r in done for v in r[1]]
        pss = sandbox_pss_kib()
        browser_mib = [pss.get(e.browser.id, 0) / 1024 for e in episodes]
        site_mib = [pss.get(e.site.id, 0) / 1024 for e in episodes]
        return {
            "size": size,
            "open_s_median": statistics.median(
                item[1] for item in opened if isinstance(item, tuple)
            ),
            "actions": len(client_ms),
            "failed_actions": sum(r[2] for r in done),
            "actions_per_s": len(client_ms) / wall,
            "action_ms_p50": percentile(client_ms, 0.5),
            "action_ms_p99": percentile(client_ms, 0.99),
            "browser_ms_p50": percentile(browser_ms, 0.5),
            "browser_ms_p99": percentile(browser_ms, 0.99),
            "browser_mib_median": statistics.median(browser_mib),
            "site_mib_median": statistics.median(site_mib),
        }
    finally:
        await asyncio.gather(*(e.close() for e in episodes), return_exceptions=True)


async def floor(actions: int) -> dict[str, Any]:
    """The script on one in-process browser against an in-process site server."""
    with SiteServer(seed=1, sites=["playground"]) as sites:
        rounds = script(sites.base_url)
        async with BrowserSession(BrowserConfig()) as browser:
            times = []
            started = time.perf_counter()
            for index in range(actions):
                tool, arguments = rounds[index % len(rounds)]
                begun = time.perf_counter()
                await browser.call(tool, arguments)
                times.append((time.perf_counter() - begun) * 1000)
            wall = time.perf_counter() - started
    return {
        "actions_per_s": actions / wall,
        "action_ms_p50": percentile(times, 0.5),
        "action_ms_p99": percentile(times, 0.99),
    }


async def measure(
    endpoint: str, token: str, browser_dir: str, args: argparse.Namespace
) -> dict[str, Any]:
    settings = BrowserSandboxSettings(browser_dir=browser_dir)
    result: dict[str, Any] = {"floor": await floor(args.actions), "sizes": [], "limit": ""}
    async with AsyncSandboxClient(endpoint, token=token) as client:
        for size in args.sizes:
            last = result["sizes"][-1] if result["sizes"] else None
            if last is not None:
                need = size * (last["browser_mib_median"] + last["site_mib_median"])
                room = mem_available_mib() - 1024
                if need > room:
                    result["limit"] = (
                        f"memory: {size} episodes need about {need:.0f} MiB, "
                        f"{room:.0f} MiB is free (keeping 1 GiB)"
                    )
                    break
            row = await one_size(client, settings, size, args.actions)
            result["sizes"].append(row)
            print(json.dumps(row), flush=True)
            if "failed" in row:
                result["limit"] = f"size {size}: {row['failed']}"
                break
        else:
            result["limit"] = f"none up to {args.sizes[-1]} (the largest size asked for)"
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--sizes", default="1,2,4,8", help="comma-separated numbers of concurrent episodes"
    )
    parser.add_argument("--actions", type=int, default=20, help="actions per episode")
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.sizes = [int(part) for part in args.sizes.split(",") if part.strip()]
    if os.geteuid() != 0:
        print("needs root (the local runtime)", file=sys.stderr)
        return 2
    folder = Path(os.environ.get("ORCHARD_GUI_BROWSER") or ROOT / ".cache" / "gui-browser")
    if not (folder / LAUNCHER).exists():
        build_browser_dir(folder)
    tag = secrets.token_hex(3)
    state = Path(tempfile.mkdtemp(prefix="orchard-gui-bench-"))
    run_dir = f"/run/orchard-gui-{tag}"
    token = secrets.token_urlsafe(24)
    stack = LocalStack(
        state,
        listen=f"127.0.0.1:{_free_port()}",
        token=token,
        runtime={"cgroup_parent": f"orchard-gui-bench-{tag}", "run_dir": run_dir},
        settings=['privileges.user_namespaces=["*"]'],
    )
    try:
        stack.start()
        result = asyncio.run(measure(stack.endpoint, token, str(folder.absolute()), args))
    finally:
        stack.stop()
        remove_cgroup_parent(f"orchard-gui-bench-{tag}")
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)
    result["cpus"] = os.cpu_count()
    heads = ("open s", "act/s", "p50 ms", "p99 ms", "brw p50", "brw p99", "brw MiB", "site MiB")
    print(f"{'episodes':<10} " + " ".join(f"{head:>8}" for head in heads))
    fl = result["floor"]
    print(
        f"{'floor':<10} {'-':>8} {fl['actions_per_s']:8.1f} {fl['action_ms_p50']:8.0f} "
        f"{fl['action_ms_p99']:8.0f}"
    )
    for row in result["sizes"]:
        if "failed" in row:
            print(f"{row['size']:<10} failed: {row['failed']}")
            continue
        print(
            f"{row['size']:<10} {row['open_s_median']:8.2f} {row['actions_per_s']:8.1f} "
            f"{row['action_ms_p50']:8.0f} {row['action_ms_p99']:8.0f} "
            f"{row['browser_ms_p50']:8.0f} {row['browser_ms_p99']:8.0f} "
            f"{row['browser_mib_median']:8.0f} {row['site_mib_median']:8.0f}"
        )
    print(f"limit: {result['limit']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

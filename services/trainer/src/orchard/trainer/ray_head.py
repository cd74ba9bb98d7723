"""A local Ray head in a process of its own: ``python -m orchard.trainer.ray_head``.

The trainer service needs a local Ray when `workers.kind` is ``ray`` without an address. Ray
starts its head processes with a Python `preexec_fn` after `fork()`, which is unsafe in a
process with running threads (gRPC, torch): the child can crash before `exec`. So the service
starts this module instead, a fresh single-threaded process that calls `ray.init`, prints the
cluster's address as one JSON line, and keeps the head up until its standard input closes (or
its parent is gone), then shuts it down. The service joins as a driver of that address.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

from orchard.trainer.ray_workers import import_ray


def _exit_with_parent(parent: int, ray: object) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    ray.shutdown()  # type: ignore[attr-defined]
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchard.trainer.ray_head")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs the Ray offers")
    args = parser.parse_args(argv)
    ray = import_ray(local=True)
    ray.init(
        num_cpus=args.num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    threading.Thread(
        target=_exit_with_parent, args=(os.getppid(), ray), name="parent-watch", daemon=True
    ).start()
    address = ray.get_runtime_context().gcs_address
    sys.stdout.write(json.dumps({"address": address}) + "\n")
    sys.stdout.flush()
    sys.stdin.read()  # until the service closes it
    ray.shutdown()
    return 0


if __name__ == "__main__":
    from orchard.trainer.ray_head import main as head_main

    sys.exit(head_main())

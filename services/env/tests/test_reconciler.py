"""Reconciler: it works from the record store's view, and lists etcd only when the runtime
has a sandbox the view does not know. Real etcd, servers and agents."""

from __future__ import annotations

from collections import Counter
from typing import Any

from orchard.core.etcd import EtcdStore
from orchard.env.runtime.base import RuntimeSandboxSpec


def count_etcd_calls(store: EtcdStore) -> Counter[str]:
    calls: Counter[str] = Counter()
    unary = store._unary

    async def counted(service: str, method: str, request: Any) -> Any:
        calls[f"{service}.{method}"] += 1
        return await unary(service, method, request)

    store._unary = counted  # type: ignore[method-assign]
    return calls


async def test_reconcile_reads_the_view_and_lists_only_for_an_unknown_sandbox(
    env: Any, runtime: Any
) -> None:
    kept = [await env.ready() for _ in range(3)]
    calls = count_etcd_calls(env.app.controller.store)
    done = await env.app.controller.reconcile()
    assert done == {"leftovers": 0, "failed": 0, "taken_over": 0, "repaired": 0}
    # One marker write to know the view is current; no record read.
    assert calls["kv.Range"] == 0 and calls["kv.Put"] == 1, calls
    # A runtime sandbox nobody recorded: etcd decides, and it goes.
    await runtime.create(RuntimeSandboxSpec(sandbox_id="sbx-leftover", image="host"))
    calls.clear()
    done = await env.app.controller.reconcile()
    assert done["leftovers"] == 1 and calls["kv.Range"] >= 1, (done, calls)
    assert sorted(await runtime.list_sandboxes()) == sorted(s.id for s in kept)

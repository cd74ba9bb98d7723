"""Sandbox networking: default deny.

Every sandbox gets a new network namespace with only ``lo`` (brought up by
:mod:`~orchard.env.runtime.local.sandbox_init`): no route anywhere, not to the host, other
sandboxes or the internet. Allowing named destinations (a veth pair into the host, nftables
rules per destination and port, expiry) is not built yet; :func:`check_egress` says so.
"""

from __future__ import annotations

from collections.abc import Sequence

from orchard.env.runtime.base import EgressRule, RuntimeNotSupported

__all__ = ["check_egress"]


def check_egress(sandbox_id: str, egress: Sequence[EgressRule]) -> None:
    """Accept ``egress`` if this runtime can enforce it: today only "no destination"."""
    if egress:
        raise RuntimeNotSupported(
            f"sandbox {sandbox_id}: the local runtime cannot allow egress yet (default deny "
            f"only); {len(egress)} rule(s) refused"
        )

"""Egress rules as nftables elements: ports merged, rules resolved, expired ones left out."""

from __future__ import annotations

import ipaddress

import pytest

from orchard.env.runtime.base import EgressRule, RuntimeNotSupported
from orchard.env.runtime.local import nft
from orchard.env.runtime.local.network import link_name, resolve_rules


def test_ports_merge_into_disjoint_ranges() -> None:
    assert nft.merge_ports([]) == ((0, 65535),)
    assert nft.merge_ports([443, 80, 81, 82, 80]) == ((80, 82), (443, 443))


async def test_rules_resolve_to_allowances() -> None:
    rules = [
        EgressRule("10.1.2.0/24", (443, 80), "tcp"),
        EgressRule("localhost", (), "", expire_unix_s=1002.5),  # /etc/hosts: no DNS query
        EgressRule("10.9.9.9", (53,), "udp", expire_unix_s=999.0),  # expired: left out
    ]
    first, second = await resolve_rules("s", rules, now=1000.0)
    assert first.networks == (ipaddress.IPv4Network("10.1.2.0/24"),)
    assert first.elements() == "10.1.2.0/24 . tcp . 80, 10.1.2.0/24 . tcp . 443"
    assert second.networks == (ipaddress.IPv4Network("127.0.0.1/32"),)
    assert second.protocols == ("tcp", "udp") and second.timeout_ms == 2500
    assert "127.0.0.1/32 . udp . 0-65535 timeout 2500ms" in second.elements()


async def test_ipv6_destinations_are_refused() -> None:
    with pytest.raises(RuntimeNotSupported, match="IPv6"):
        await resolve_rules("s", [EgressRule("2001:db8::/32")])


def test_replacing_keeps_one_transaction_that_drops_old_sets() -> None:
    allowance = nft.Allowance((ipaddress.IPv4Network("10.0.0.1/32"),), ("tcp",), ((80, 80),))
    script = nft.replace_sandbox(
        "t", "sbx-1", "orcabc", ipaddress.IPv4Address("10.213.0.1"), [allowance], old_sets=3
    )
    assert "delete set inet t allow-sbx-1-1" in script
    assert "delete set inet t allow-sbx-1-2" in script
    assert "delete set inet t allow-sbx-1-0" not in script
    assert script.index("ip saddr != 10.213.0.1 drop") < script.index("@allow-sbx-1-0 accept")
    assert script.rstrip().splitlines()[-3] == "add rule inet t sandbox-sbx-1 drop"


def test_link_names_fit_an_interface_name() -> None:
    name = link_name("orchard", "sbx-0123456789ab" * 3)
    assert len(name) <= 15 and name.startswith("orc")
    assert name != link_name("other", "sbx-0123456789ab" * 3)

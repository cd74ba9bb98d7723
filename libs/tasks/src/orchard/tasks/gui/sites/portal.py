"""A customer portal whose flows need a second tab: online billing is activated with an
agreement code printed at the end of the terms of service (a link that opens in a new tab), and
a voucher is redeemed with a code from the welcome letter (a button whose script opens it in a
new window). What the other tab shows must be typed back on the first.

World: ``{"customer": "Ana Silva", "account": "GE-48213", "agreement_code": "AGR-4821",
"voucher_code": "VCH-93QK", "plans": ["Basic", ...]}`` (`make_portal_world` for a seed).
State: whether billing is active, every activation and redemption tried (with the code typed
and whether it was right).
"""

from __future__ import annotations

import random
import string
from typing import Any

from .base import Request, Response, Site, esc

__all__ = ["PLANS", "PortalSite", "make_portal_world"]

PLANS = ("Basic", "Green", "Green Plus", "Family", "Night Saver")
_CUSTOMERS = ("Ana Silva", "Ben Carter", "Chen Wei", "Dara Quinn", "Eva Novak", "Femi Adeyemi")
_TERMS = (
    ("Scope", "These terms cover the supply of energy and the use of this portal."),
    ("Billing", "Bills are issued monthly and are due within fourteen days of issue."),
    ("Meter readings", "Readings sent through the portal replace estimated readings."),
    ("Payments", "Payments may be made by bank transfer, card or direct debit."),
    ("Changes", "We tell you about any change to these terms thirty days ahead."),
    ("Ending the contract", "Either side may end the contract with one month's notice."),
    ("Complaints", "Complaints are answered within ten working days."),
    ("Privacy", "Your data is used only to supply energy and to bill you for it."),
)


def _code(rng: random.Random, prefix: str, length: int) -> str:
    alphabet = string.ascii_uppercase.replace("O", "").replace("I", "") + "23456789"
    return prefix + "-" + "".join(rng.choice(alphabet) for _ in range(length))


def make_portal_world(seed: int | str) -> dict[str, Any]:
    """A customer, an account number, the two codes and the plans on offer, for a seed."""
    rng = random.Random(f"portal/{seed}")
    return {
        "customer": rng.choice(_CUSTOMERS),
        "account": f"GE-{rng.randint(10000, 99999)}",
        "agreement_code": _code(rng, "AGR", 4),
        "voucher_code": _code(rng, "VCH", 5),
        "plans": sorted(rng.sample(PLANS, 4)),
    }


class PortalSite(Site):
    name = "portal"
    title = "Greenfield Energy"
    description = "a customer portal whose codes are on pages that open in another tab"

    @classmethod
    def make_world(cls, seed: int) -> dict[str, Any]:
        return make_portal_world(seed)

    def load(self, world: dict[str, Any]) -> None:
        self.customer = str(world["customer"])
        self.account = str(world["account"])
        self.agreement_code = str(world["agreement_code"])
        self.voucher_code = str(world["voucher_code"])
        self.plans = [str(p) for p in world["plans"]]
        if not self.plans:
            raise ValueError("the portal needs at least one plan")
        self.billing_active = False
        self.activations: list[dict[str, Any]] = []
        self.redemptions: list[dict[str, Any]] = []

    def state(self) -> dict[str, Any]:
        return {
            "billing_active": self.billing_active,
            "activations": [dict(a) for a in self.activations],
            "redemptions": [dict(r) for r in self.redemptions],
        }

    def nav(self) -> list[tuple[str, str]]:
        return [
            (self.href("/"), "My account"),
            (self.href("/activate"), "Online billing"),
            (self.href("/voucher"), "Vouchers"),
        ]

    def handle(self, request: Request) -> Response:
        path, method = request.path, request.method
        if path == "/" and method == "GET":
            return self._home()
        if path == "/activate":
            return self._activate(request)
        if path == "/terms" and method == "GET":
            return self._terms()
        if path == "/voucher":
            return self._voucher(request)
        if path == "/letter" and method == "GET":
            return self._letter()
        return self.not_found(f"no page {path}")

    def _home(self) -> Response:
        billing = "active" if self.billing_active else "not active"
        body = (
            f"<h1>Welcome, {esc(self.customer)}</h1><p>Account number {esc(self.account)}.</p>"
            f"<p>Online billing is {billing}.</p>"
            f'<p><a class="button" href="{self.href("/activate")}">Activate online billing</a> '
            f'<a class="button" href="{self.href("/voucher")}">Redeem a voucher</a></p>'
        )
        return self.page("My account", body)

    def _activate(self, request: Request) -> Response:
        errors: list[str] = []
        code = ""
        if request.method == "POST":
            code = request.field("code")
            accepted = request.field("accept") == "yes"
            right = code.upper() == self.agreement_code
            if not accepted:
                errors.append("Accept the terms of service to continue")
            if not right:
                errors.append("That agreement code is not right: it is at the end of the terms")
            self.activations.append({"code": code, "accepted": accepted, "ok": not errors})
            if not errors:
                self.billing_active = True
                body = (
                    "<h1>Online billing is active</h1><p class='notice'>Your bills will now "
                    f"arrive online, {esc(self.customer)}.</p>"
                )
                return self.page("Billing active", body)
        error_html = "".join(f'<p class="error">{esc(e)}</p>' for e in errors)
        status = "<p class='notice'>Online billing is already active.</p>" * self.billing_active
        body = (
            f"<h1>Activate online billing</h1>{status}{error_html}<p>Read the "
            f'<a id="terms" href="{self.href("/terms")}" target="_blank">terms of service</a>'
            " (they open in a new tab). The agreement code is printed at their end.</p>"
            f'<form method="post" action="{self.href("/activate")}">'
            '<label for="code">Agreement code</label>'
            f'<input id="code" name="code" size="20" value="{esc(code)}">'
            '<label style="font-weight:normal"><input type="checkbox" id="accept" name="accept" '
            'value="yes"> I accept the terms of service</label>'
            '<p><button type="submit" id="activate">Activate billing</button></p></form>'
        )
        return self.page("Online billing", body, 400 if errors else 200)

    def _terms(self) -> Response:
        sections = "".join(
            f"<h2>{n}. {esc(title)}</h2><p>{esc(text)}</p><p>{esc(text)} This applies to "
            f"account {esc(self.account)}.</p>"
            for n, (title, text) in enumerate(_TERMS, start=1)
        )
        body = (
            f"<h1>Terms of service</h1>{sections}<div style='height:300px'></div>"
            f"<p class='notice'>Agreement code: <b id='agreement'>{esc(self.agreement_code)}"
            "</b></p>"
        )
        return self.page("Terms of service", body)

    def _voucher(self, request: Request) -> Response:
        errors: list[str] = []
        code, plan = "", ""
        if request.method == "POST":
            code, plan = request.field("code"), request.field("plan")
            right = code.upper() == self.voucher_code
            if not right:
                errors.append("That voucher code is not right: it is in your welcome letter")
            if plan not in self.plans:
                errors.append("Choose a plan")
            self.redemptions.append({"code": code, "plan": plan, "ok": not errors})
            if not errors:
                body = (
                    f"<h1>Voucher redeemed</h1><p class='notice'>Your voucher now pays for the "
                    f"{esc(plan)} plan.</p>"
                )
                return self.page("Voucher redeemed", body)
        error_html = "".join(f'<p class="error">{esc(e)}</p>' for e in errors)
        options = '<option value="">Choose a plan...</option>' + "".join(
            f"<option{' selected' if p == plan else ''}>{esc(p)}</option>" for p in self.plans
        )
        letter = self.href("/letter")
        body = (
            f"<h1>Redeem a voucher</h1>{error_html}<p>Your voucher code is in your welcome "
            "letter.</p><p><button type='button' id='letter' class='secondary' "
            f"onclick=\"window.open('{letter}', '_blank')\">Open my welcome letter</button></p>"
            f'<form method="post" action="{self.href("/voucher")}">'
            '<label for="code">Voucher code</label>'
            f'<input id="code" name="code" size="20" value="{esc(code)}">'
            f'<label for="plan">Plan</label><select id="plan" name="plan">{options}</select>'
            '<p><button type="submit" id="redeem">Redeem voucher</button></p></form>'
        )
        return self.page("Vouchers", body, 400 if errors else 200)

    def _letter(self) -> Response:
        body = (
            f"<h1>Welcome to Greenfield Energy</h1><p>Dear {esc(self.customer)},</p>"
            "<p>Thank you for joining us. As a welcome gift, here is a voucher for your first "
            "month.</p>"
            f"<p class='notice'>Your voucher code is <b id='voucher'>{esc(self.voucher_code)}"
            "</b></p><p><button type='button' id='close' onclick='window.close()'>Close this "
            "letter</button></p>"
        )
        return self.page("Welcome letter", body)

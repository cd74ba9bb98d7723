"""A multi-step form: a membership application in three steps (contact details, plan and
options, review with consent) that is submitted at the end. World: ``{"countries": [...],
"reference_prefix": "LIB-07"}``. State: the draft so far and the applications submitted."""

from __future__ import annotations

import random
from typing import Any

from .base import Request, Response, Site, esc

__all__ = ["PLANS", "ApplicationFormSite", "make_countries"]

PLANS = ("basic", "plus", "pro")
_COUNTRIES = (
    "Austria",
    "Brazil",
    "Canada",
    "Denmark",
    "Egypt",
    "Finland",
    "Ghana",
    "India",
    "Japan",
    "Kenya",
    "Mexico",
    "Norway",
    "Peru",
    "Spain",
    "Vietnam",
)


def make_countries(seed: int | str, count: int = 10) -> list[str]:
    """The countries the form offers for a seed, sorted."""
    return sorted(random.Random(f"forms/{seed}").sample(_COUNTRIES, count))


class ApplicationFormSite(Site):
    name = "forms"
    title = "Riverside Library Membership"
    description = "a three-step application form with validation and a review step"

    @classmethod
    def make_world(cls, seed: int) -> dict[str, Any]:
        return {
            "countries": make_countries(seed),
            "reference_prefix": f"LIB-{seed % 100:02d}",
        }

    def load(self, world: dict[str, Any]) -> None:
        self.countries = [str(c) for c in world["countries"]]
        if not self.countries:
            raise ValueError("the form needs at least one country")
        self.reference_prefix = str(world["reference_prefix"])
        self.draft: dict[str, Any] = {}
        self.step_done = 0
        self.submissions: list[dict[str, Any]] = []

    def state(self) -> dict[str, Any]:
        return {
            "draft": dict(self.draft),
            "steps_done": self.step_done,
            "submissions": [dict(s) for s in self.submissions],
        }

    def handle(self, request: Request) -> Response:
        path, method = request.path, request.method
        if path == "/" and method == "GET":
            return Response.redirect(self.href("/step/1"))
        if path in ("/step/1", "/step/2", "/step/3"):
            step = int(path[-1])
            if step > self.step_done + 1:
                return Response.redirect(self.href(f"/step/{self.step_done + 1}"))
            if method == "POST":
                return self._post(step, request)
            return self._form(step, [])
        if path == "/done" and method == "GET":
            if not self.submissions:
                return Response.redirect(self.href("/step/1"))
            ref = self.submissions[-1]["reference"]
            body = (
                f"<h1>Application received</h1><p class='notice'>Your reference is "
                f"<b id='reference'>{ref}</b>.</p>"
            )
            return self.page("Done", body)
        return self.not_found(f"no page {path}")

    def _post(self, step: int, request: Request) -> Response:
        errors: list[str] = []
        if step == 1:
            values = {k: request.field(k) for k in ("full_name", "email", "phone")}
            if not values["full_name"]:
                errors.append("Full name is required")
            if "@" not in values["email"]:
                errors.append("Email must be an email address")
            digits = [c for c in values["phone"] if c.isdigit()]
            if values["phone"] and len(digits) < 6:
                errors.append("Phone must have at least 6 digits")
            self.draft.update(values)
        elif step == 2:
            values = {"plan": request.field("plan"), "country": request.field("country")}
            if values["plan"] not in PLANS:
                errors.append("Choose a plan")
            if values["country"] not in self.countries:
                errors.append("Choose a country")
            self.draft.update(values)
            self.draft["newsletter"] = request.field("newsletter") == "yes"
        else:
            self.draft["comments"] = request.field("comments")
            if request.field("agree") != "yes":
                errors.append("You must agree to the library rules")
        if errors:
            return self._form(step, errors)
        self.step_done = max(self.step_done, step)
        if step < 3:
            return Response.redirect(self.href(f"/step/{step + 1}"))
        reference = f"{self.reference_prefix}{len(self.submissions) + 1:03d}"
        self.submissions.append({"reference": reference, **self.draft})
        self.draft, self.step_done = {}, 0
        return Response.redirect(self.href("/done"))

    def _text(self, name: str, label: str) -> str:
        return (
            f'<label for="{name}">{label}</label><input id="{name}" name="{name}" size="40" '
            f'value="{esc(self.draft.get(name, ""))}">'
        )

    def _form(self, step: int, errors: list[str]) -> Response:
        error_html = "".join(f'<p class="error">{esc(e)}</p>' for e in errors)
        if step == 1:
            fields = (
                self._text("full_name", "Full name")
                + self._text("email", "Email")
                + self._text("phone", "Phone (optional)")
            )
        elif step == 2:
            plans = "".join(
                f'<label style="font-weight:normal"><input type="radio" name="plan" id="plan-{p}"'
                f' value="{p}"{" checked" if self.draft.get("plan") == p else ""}> '
                f"{p.title()}</label>"
                for p in PLANS
            )
            options = '<option value="">Choose...</option>' + "".join(
                f"<option{' selected' if self.draft.get('country') == c else ''}>{c}</option>"
                for c in self.countries
            )
            checked = " checked" if self.draft.get("newsletter") else ""
            fields = (
                f"<fieldset><legend>Plan</legend>{plans}</fieldset>"
                f'<label for="country">Country</label><select id="country" name="country">'
                f"{options}</select>"
                f'<label style="font-weight:normal"><input type="checkbox" id="newsletter" '
                f'name="newsletter" value="yes"{checked}> Send me the newsletter</label>'
            )
        else:
            review = "".join(
                f"<tr><th>{esc(k.replace('_', ' ').title())}</th><td>{esc(v)}</td></tr>"
                for k, v in self.draft.items()
                if k != "comments"
            )
            fields = (
                f"<table id='review'>{review}</table>"
                '<label for="comments">Comments</label><textarea id="comments" name="comments" '
                f'rows="3" cols="40">{esc(self.draft.get("comments", ""))}</textarea>'
                '<label style="font-weight:normal"><input type="checkbox" id="agree" '
                'name="agree" value="yes"> I agree to the library rules</label>'
            )
        back = (
            f'<a class="button" href="{self.href(f"/step/{step - 1}")}">Back</a> '
            if step > 1
            else ""
        )
        label = "Submit application" if step == 3 else "Next"
        body = (
            f"<h1>Membership application</h1><p>Step {step} of 3</p>{error_html}"
            f'<form method="post" action="{self.href(f"/step/{step}")}">{fields}'
            f'<p>{back}<button type="submit" id="next">{label}</button></p></form>'
        )
        return self.page(f"Step {step} of 3", body, 400 if errors else 200)

"""A wiki: articles about a made-up valley (rivers, mountains, towns, plants, birds) with an
infobox of facts, categories and tags, a search box, an edit form, and a discussion thread per
article where visitors post replies.

World: ``{"articles": [{slug, title, category, tags, summary, facts: [[name, value]], body:
[paragraph], talk: [{author, text}]}]}`` (`make_wiki_world` for a seed). State: every
article's title, tags, body and revision, the discussions, the edits saved and the searches
made.
"""

from __future__ import annotations

import random
from typing import Any
from urllib.parse import quote, unquote, urlencode

from .base import Request, Response, Site, esc

__all__ = ["CATEGORIES", "TAGS", "WikiSite", "make_wiki_world"]

CATEGORIES = ("Rivers", "Mountains", "Towns", "Plants", "Birds")
TAGS = (
    "north",
    "south",
    "coastal",
    "protected",
    "historic",
    "rare",
    "alpine",
    "wetland",
    "lowland",
    "popular",
)
_SYLLABLES = (
    "al",
    "bor",
    "cal",
    "dun",
    "el",
    "fen",
    "gar",
    "hal",
    "is",
    "jor",
    "kel",
    "lun",
    "mar",
    "nor",
    "or",
    "pel",
    "quin",
    "ros",
    "sal",
    "tor",
    "ul",
    "ven",
    "wyn",
    "yar",
)
_AUTHORS = ("Mira Okafor", "Jonas Berg", "Lena Park", "Aiko Sato", "Omar Haddad", "Sofia Lund")
_REMARKS = (
    "The map in the infobox could use an update.",
    "I visited last spring and it matches the description.",
    "Does anyone have a source for the figures?",
    "Added a photo request on the project page.",
    "The history section needs more detail.",
)


def _word(rng: random.Random) -> str:
    return (rng.choice(_SYLLABLES) + rng.choice(_SYLLABLES)).capitalize()


def _article(rng: random.Random, category: str, stem: str, places: list[str]) -> dict[str, Any]:
    year = rng.randint(1620, 1960)
    if category == "Rivers":
        title = f"{stem} River"
        facts = [
            ["Length", f"{rng.randint(12, 480)} km"],
            ["Source", f"Mount {rng.choice(places)}"],
            ["Mouth", f"Lake {rng.choice(places)}"],
        ]
        summary = f"The {title} is a river of the valley."
        body = [
            f"The {title} rises on {facts[1][1]} and runs {facts[0][1]} to {facts[2][1]}.",
            f"Its banks were first mapped in {year}.",
        ]
    elif category == "Mountains":
        title = f"Mount {stem}"
        facts = [
            ["Height", f"{rng.randint(900, 4800):,} m"],
            ["Range", f"{rng.choice(places)} Range"],
            ["First ascent", str(year)],
        ]
        summary = f"{title} is a peak of the {facts[1][1]}."
        body = [
            f"{title} stands {facts[0][1]} high in the {facts[1][1]}.",
            f"It was first climbed in {year}.",
        ]
    elif category == "Towns":
        title = stem + rng.choice(("ford", "by", "ton", "wick", "stead"))
        facts = [
            ["Population", f"{rng.randint(800, 95000):,}"],
            ["Founded", str(year)],
            ["Region", f"{rng.choice(('North', 'South', 'East', 'West'))} {rng.choice(places)}"],
        ]
        summary = f"{title} is a town in {facts[2][1]}."
        body = [
            f"{title} was founded in {year} and has {facts[0][1]} inhabitants.",
            "Its market is held every Saturday.",
        ]
    elif category == "Plants":
        title = f"{rng.choice(('Blue', 'Golden', 'Marsh', 'Dwarf', 'Silver'))} {stem}wort"
        facts = [
            ["Flowering", rng.choice(("spring", "early summer", "late summer", "autumn"))],
            ["Height", f"{rng.randint(5, 180)} cm"],
            ["Habitat", rng.choice(("meadows", "river banks", "rocky slopes", "bogs", "woods"))],
        ]
        summary = f"{title} is a flowering plant of {facts[2][1]}."
        body = [
            f"{title} grows to {facts[1][1]} and flowers in {facts[0][1]}.",
            f"It was described in {year}.",
        ]
    else:
        title = f"{rng.choice(('Crested', 'Spotted', 'Little', 'Grey', 'Red'))} {stem} Finch"
        facts = [
            ["Wingspan", f"{rng.randint(14, 90)} cm"],
            ["Diet", rng.choice(("seeds", "insects", "berries", "fish"))],
            ["Migrates", rng.choice(("yes", "no"))],
        ]
        summary = f"The {title} is a small bird that eats {facts[1][1]}."
        body = [
            f"The {title} has a wingspan of {facts[0][1]}.",
            f"It was first recorded in {year}.",
        ]
    slug = "-".join(title.lower().split())
    talk = [
        {"author": rng.choice(_AUTHORS), "text": rng.choice(_REMARKS)}
        for _ in range(rng.randint(0, 2))
    ]
    return {
        "slug": slug,
        "title": title,
        "category": category,
        "tags": sorted(rng.sample(TAGS, rng.randint(1, 3))),
        "summary": summary,
        "facts": facts,
        "body": body,
        "talk": talk,
    }


def make_wiki_world(seed: int | str, per_category: int = 4) -> dict[str, Any]:
    """Articles for a seed: ``per_category`` of each category with distinct titles; some share
    a name stem (a town and a river of the same name), as real places do."""
    rng = random.Random(f"wiki/{seed}")
    places = [_word(rng) for _ in range(8)]
    stems: list[str] = []
    articles: list[dict[str, Any]] = []
    titles: set[str] = set()
    for category in CATEGORIES:
        made = 0
        while made < per_category:
            stem = rng.choice(stems) if stems and rng.random() < 0.3 else _word(rng)
            article = _article(rng, category, stem, places)
            if article["title"] in titles:
                continue
            titles.add(article["title"])
            stems.append(stem)
            articles.append(article)
            made += 1
    articles.sort(key=lambda a: a["title"])
    return {"articles": articles}


class WikiSite(Site):
    name = "wiki"
    title = "Valley Wiki"
    description = "a wiki: search, articles with facts, categories, tags, editing, discussions"

    @classmethod
    def make_world(cls, seed: int) -> dict[str, Any]:
        return make_wiki_world(seed)

    def load(self, world: dict[str, Any]) -> None:
        self.articles: dict[str, dict[str, Any]] = {}
        for article in world["articles"]:
            slug = str(article["slug"])
            if not slug or "/" in slug or slug in self.articles:
                raise ValueError(f"article slug {slug!r} must be distinct and have no '/'")
            self.articles[slug] = {
                "slug": slug,
                "title": str(article["title"]),
                "category": str(article["category"]),
                "tags": [str(t) for t in article["tags"]],
                "summary": str(article["summary"]),
                "facts": [[str(k), str(v)] for k, v in article["facts"]],
                "body": [str(p) for p in article["body"]],
                "talk": [
                    {"author": str(r["author"]), "text": str(r["text"])}
                    for r in article.get("talk", [])
                ],
                "revision": 1,
            }
        if not self.articles:
            raise ValueError("a wiki needs at least one article")
        self.edits: list[dict[str, Any]] = []
        self.searches: list[str] = []

    def state(self) -> dict[str, Any]:
        return {
            "articles": [
                {
                    "slug": a["slug"],
                    "title": a["title"],
                    "category": a["category"],
                    "tags": list(a["tags"]),
                    "body": list(a["body"]),
                    "revision": a["revision"],
                    "talk": [dict(r) for r in a["talk"]],
                }
                for a in self.articles.values()
            ],
            "edits": [dict(e) for e in self.edits],
            "searches": list(self.searches),
        }

    def nav(self) -> list[tuple[str, str]]:
        return [(self.href("/"), "Main page")] + [
            (self.href(f"/category/{quote(c)}"), c) for c in self._categories()
        ]

    def _categories(self) -> list[str]:
        return sorted({a["category"] for a in self.articles.values()})

    def handle(self, request: Request) -> Response:
        path, method = request.path, request.method
        parts = [unquote(p) for p in path.split("/") if p]
        if not parts and method == "GET":
            return self._home()
        if parts == ["search"] and method == "GET":
            return self._search(request.field("q"))
        if len(parts) == 2 and parts[0] in ("category", "tag") and method == "GET":
            return self._listing(parts[0], parts[1])
        if len(parts) >= 2 and parts[0] == "article":
            article = self.articles.get(parts[1])
            if article is None:
                return self.not_found(f"no article {parts[1]}")
            action = parts[2] if len(parts) > 2 else ""
            if action == "" and method == "GET":
                return self._article(article, request.field("notice"))
            if action == "edit":
                return self._edit(article, request)
            if action == "talk":
                return self._talk(article, request)
        return self.not_found(f"no page {path}")

    def _search_box(self, query: str = "") -> str:
        return (
            f'<form method="get" action="{self.href("/search")}"><input id="q" name="q" '
            f'size="40" aria-label="Search the wiki" placeholder="Search the wiki" '
            f'value="{esc(query)}"> <button type="submit">Search</button></form>'
        )

    def _links(self, articles: list[dict[str, Any]]) -> str:
        return "".join(
            f'<li><a href="{self.href("/article/" + a["slug"])}">{esc(a["title"])}</a>: '
            f"{esc(a['summary'])}</li>"
            for a in articles
        )

    def _home(self) -> Response:
        categories = "".join(
            f'<li><a href="{self.href(f"/category/{quote(c)}")}">{esc(c)}</a> '
            f"({sum(a['category'] == c for a in self.articles.values())} articles)</li>"
            for c in self._categories()
        )
        used = sorted({t for a in self.articles.values() for t in a["tags"]})
        tags = " ".join(
            f'<a href="{self.href(f"/tag/{quote(t)}")}" aria-label="Tag {esc(t)}">{esc(t)}</a>'
            for t in used
        )
        body = (
            f"<h1>Welcome to the Valley Wiki</h1>{self._search_box()}"
            f"<p>{len(self.articles)} articles about the rivers, peaks, towns, plants and birds "
            f"of the valley.</p><h2>Categories</h2><ul>{categories}</ul>"
            f"<h2>Tags</h2><p>{tags}</p>"
        )
        return self.page("Main page", body)

    def _search(self, query: str) -> Response:
        self.searches.append(query)
        needle = query.lower()
        found = [
            a
            for a in sorted(self.articles.values(), key=lambda a: a["title"])
            if needle
            and (
                needle in a["title"].lower()
                or needle in a["summary"].lower()
                or any(needle == t for t in a["tags"])
            )
        ]
        results = f"<ul class='results'>{self._links(found)}</ul>" if found else ""
        body = (
            f"{self._search_box(query)}<h1>Search results for &ldquo;{esc(query)}&rdquo;</h1>"
            f"<p>{len(found)} result{'s' if len(found) != 1 else ''}.</p>{results}"
        )
        return self.page("Search", body)

    def _listing(self, kind: str, value: str) -> Response:
        members = [
            a
            for a in sorted(self.articles.values(), key=lambda a: a["title"])
            if (a["category"] == value if kind == "category" else value in a["tags"])
        ]
        heading = (
            f"Category: {esc(value)}"
            if kind == "category"
            else f"Tagged &ldquo;{esc(value)}&rdquo;"
        )
        body = (
            f"<h1>{heading}</h1>"
            f"<p>{len(members)} article{'s' if len(members) != 1 else ''}.</p>"
            f"<ul>{self._links(members)}</ul>"
        )
        return self.page(f"{kind.title()} {value}", body)

    def _article(self, article: dict[str, Any], notice: str) -> Response:
        slug = article["slug"]
        facts = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in article["facts"])
        paragraphs = "".join(f"<p>{esc(p)}</p>" for p in article["body"])
        tags = " ".join(
            f'<a href="{self.href(f"/tag/{quote(t)}")}" aria-label="Tag {esc(t)}">{esc(t)}</a>'
            for t in article["tags"]
        )
        notice_html = f'<p class="notice">{esc(notice)}</p>' if notice else ""
        category = article["category"]
        body = (
            f"<h1>{esc(article['title'])}</h1>{notice_html}<p><i>{esc(article['summary'])}</i></p>"
            f"<table class='infobox'>{facts}</table>{paragraphs}"
            f'<p>Category: <a href="{self.href(f"/category/{quote(category)}")}">'
            f"{esc(category)}</a></p><p>Tags: {tags or 'none'}</p>"
            f'<p><a class="button" href="{self.href(f"/article/{slug}/edit")}">Edit this '
            f'article</a> <a class="button" href="{self.href(f"/article/{slug}/talk")}">'
            f"Discussion ({len(article['talk'])})</a></p>"
        )
        return self.page(article["title"], body)

    def _edit(self, article: dict[str, Any], request: Request) -> Response:
        slug = article["slug"]
        errors: list[str] = []
        text = "\n\n".join(article["body"])
        tags = ", ".join(article["tags"])
        summary = ""
        if request.method == "POST":
            text, tags, summary = (
                request.field("text"),
                request.field("tags"),
                request.field("summary"),
            )
            paragraphs = [" ".join(p.split()) for p in text.replace("\r", "").split("\n\n")]
            paragraphs = [p for p in paragraphs if p]
            if not paragraphs:
                errors.append("The article text cannot be empty")
            if not errors:
                new_tags = list(dict.fromkeys(t.strip().lower() for t in tags.split(",")))
                article["body"] = paragraphs
                article["tags"] = [t for t in new_tags if t]
                article["revision"] += 1
                self.edits.append({"slug": slug, "summary": summary})
                return Response.redirect(
                    self.href(f"/article/{slug}"), {"notice": "Your changes were saved"}
                )
        error_html = "".join(f'<p class="error">{esc(e)}</p>' for e in errors)
        body = (
            f"<h1>Editing {esc(article['title'])}</h1>{error_html}"
            f'<form method="post" action="{self.href(f"/article/{slug}/edit")}">'
            '<label for="text">Article text</label>'
            f'<textarea id="text" name="text" rows="8" cols="90">{esc(text)}</textarea>'
            '<label for="tags">Tags (separated by commas)</label>'
            f'<input id="tags" name="tags" size="60" value="{esc(tags)}">'
            '<label for="summary">Edit summary</label>'
            f'<input id="summary" name="summary" size="60" value="{esc(summary)}">'
            '<p><button type="submit" id="save">Save changes</button> '
            f'<a href="{self.href(f"/article/{slug}")}">Cancel</a></p></form>'
        )
        return self.page(f"Editing {article['title']}", body, 400 if errors else 200)

    def _talk(self, article: dict[str, Any], request: Request) -> Response:
        slug = article["slug"]
        errors: list[str] = []
        author, text = "", ""
        if request.method == "POST":
            author, text = request.field("author"), " ".join(request.field("reply").split())
            if not author:
                errors.append("Your name is required")
            if not text:
                errors.append("The reply cannot be empty")
            if not errors:
                article["talk"].append({"author": author, "text": text})
                query = urlencode({"notice": "Your reply was posted"})
                return Response.redirect(self.href(f"/article/{slug}/talk") + "?" + query)
        replies = "".join(
            f"<li class='reply'><b>{esc(r['author'])}</b> wrote: {esc(r['text'])}</li>"
            for r in article["talk"]
        )
        notice = request.field("notice") if request.method == "GET" else ""
        notice_html = f'<p class="notice">{esc(notice)}</p>' if notice else ""
        error_html = "".join(f'<p class="error">{esc(e)}</p>' for e in errors)
        body = (
            f"<h1>Discussion: {esc(article['title'])}</h1>{notice_html}"
            f'<p><a href="{self.href(f"/article/{slug}")}">Back to the article</a></p>'
            + (f"<ul>{replies}</ul>" if replies else "<p>No replies yet.</p>")
            + f"<h2>Post a reply</h2>{error_html}"
            f'<form method="post" action="{self.href(f"/article/{slug}/talk")}">'
            '<label for="author">Your name</label>'
            f'<input id="author" name="author" size="30" value="{esc(author)}">'
            '<label for="reply">Your reply</label>'
            f'<textarea id="reply" name="reply" rows="3" cols="60">{esc(text)}</textarea>'
            '<p><button type="submit" id="post">Post reply</button></p></form>'
        )
        return self.page(f"Discussion: {article['title']}", body, 400 if errors else 200)

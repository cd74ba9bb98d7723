"""The report's screenshot trails: a page per chosen GUI episode, each action with its screenshot.

An evaluation job that keeps GUI trails (`RolloutJobSpec.keep_gui_trails`) leaves, for each GUI
episode, a ``trail.json`` and its screenshots in the artifact store (`orchard.rollout.trails`
describes them), and each trajectory names its trail in ``metadata["gui_trail"]``.
`report_trails` picks a few of them per evaluated model from the evaluate stage's groups
(``<run>/evaluate/<model>.groups.jsonl``) and writes into the report folder::

    trails/index.html                        the chosen episodes, per model
    trails/<model>/<n>-<task>.html           one episode: intent, answer, reward, then each step
    trails/<model>/<n>-<task>/<NNN>.png      its screenshots, linked relatively

Everything in a trail came from a sandbox (URLs, titles, the agent's arguments and answer):
every string is HTML-escaped, URLs are shown and never linked, the pages run no script and their
Content-Security-Policy allows none, and only files named ``NNN.png`` that hold a PNG are copied,
from beside the trail.json, into the episode's own folder.
"""

from __future__ import annotations

import html
import json
import logging
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from google.protobuf import json_format

from orchard.sdk.report import TrailLink
from orchard.types.v1 import reward_pb2, trajectory_pb2

if TYPE_CHECKING:
    from orchard.core.artifacts import ArtifactStore
    from orchard.recipes.recipe_tasks import RecipeTask

__all__ = [
    "TRAILS_FOLDER",
    "TrailChoice",
    "choose_trails",
    "evaluated_trails",
    "keeps_trails",
    "report_trails",
    "write_trail_pages",
]

log = logging.getLogger(__name__)

TRAILS_FOLDER = "trails"
"""The trails' folder in the report folder."""
PER_MODEL = 3
"""Episodes shown per evaluated model."""
TRAIL_METADATA = "gui_trail"
MAX_TRAIL_BYTES = 8 * 1024 * 1024
MAX_PNG_BYTES = 16 * 1024 * 1024
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_SCREENSHOT_NAME = re.compile(r"^[0-9]{3,6}\.png$")
_UNSAFE_IN_NAME = re.compile(r"[^A-Za-z0-9._-]+")
# No script at all; images only from the page's own folder; the page's own <style>.
CSP = "default-src 'none'; img-src 'self'; style-src 'unsafe-inline'; base-uri 'none'"


@dataclass(frozen=True, slots=True)
class TrailChoice:
    """One evaluated GUI episode whose trail the report shows."""

    model: str
    task_id: str
    harness: str
    rollout_id: str
    url: str
    """Its trail.json in the artifact store."""
    reward: float
    resolved: bool


def keeps_trails(tasks: Sequence[RecipeTask]) -> bool:
    """Whether an evaluation job of ``tasks`` sets `RolloutJobSpec.keep_gui_trails`: when one of
    them is a GUI task (its trails are what the report's pages show; other tasks keep none)."""
    return any(task.gui_id for task in tasks)


def main_line(group: trajectory_pb2.TrajectoryGroup) -> list[trajectory_pb2.Trajectory]:
    """One trajectory per rollout, its first main-line path: auxiliary branches are left out,
    and so are further paths of a rollout whose history forked (a re-tokenized turn), which
    all carry the rollout's one reward."""
    seen: set[str] = set()
    out = []
    for trajectory in group.trajectories:
        if "branch" in trajectory.metadata or trajectory.rollout_id in seen:
            continue
        seen.add(trajectory.rollout_id)
        out.append(trajectory)
    return out


def choose_trails(
    model: str,
    groups: Sequence[trajectory_pb2.TrajectoryGroup],
    mark: float,
    per_model: int = PER_MODEL,
) -> list[TrailChoice]:
    """Up to ``per_model`` scored episodes with a trail, successes and failures in turn when
    both exist, different tasks first; ordered by task, harness and rollout id, so the same
    groups give the same choice."""
    candidates = []
    for group in groups:
        for trajectory in main_line(group):
            url = trajectory.metadata.get(TRAIL_METADATA, "")
            if not url or trajectory.reward.status != reward_pb2.REWARD_STATUS_SCORED:
                continue
            value = trajectory.reward.value
            candidates.append(
                TrailChoice(
                    model=model,
                    task_id=group.task_id,
                    harness=group.harness,
                    rollout_id=trajectory.rollout_id,
                    url=url,
                    reward=value,
                    resolved=value >= mark,
                )
            )
    candidates.sort(key=lambda c: (c.task_id, c.harness, c.rollout_id))
    successes = [c for c in candidates if c.resolved]
    failures = [c for c in candidates if not c.resolved]
    chosen: list[TrailChoice] = []
    tasks: set[str] = set()
    for fresh_tasks_only in (True, False):
        pools = [list(successes), list(failures)]
        turn = 0
        while len(chosen) < per_model and any(pools):
            pool = pools[turn % 2] or pools[(turn + 1) % 2]
            turn += 1
            while pool:
                candidate = pool.pop(0)
                if candidate in chosen or (fresh_tasks_only and candidate.task_id in tasks):
                    continue
                chosen.append(candidate)
                tasks.add(candidate.task_id)
                break
    return chosen


def _read_groups(path: Path) -> list[trajectory_pb2.TrajectoryGroup]:
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    return [json_format.Parse(line, trajectory_pb2.TrajectoryGroup()) for line in lines if line]


def evaluated_trails(
    evaluate_dir: Path, models: Sequence[str], mark: float, per_model: int = PER_MODEL
) -> list[TrailChoice]:
    """The episodes to show for each of ``models`` (in that order) from the evaluate stage's
    ``<model>.groups.jsonl``; a model without the file (the same weights as another) has none."""
    chosen: list[TrailChoice] = []
    for model in models:
        groups = _read_groups(evaluate_dir / f"{model}.groups.jsonl")
        chosen += choose_trails(model, groups, mark, per_model)
    return chosen


# -- pages --------------------------------------------------------------------------------------


def _slug(text: str, limit: int = 60) -> str:
    slug = _UNSAFE_IN_NAME.sub("-", text).strip("-.")[:limit].strip("-.")
    return slug or "x"


def _e(value: object) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _text(data: Mapping[str, Any], key: str) -> str:
    value = data.get(key)
    return "" if value is None else str(value)


def _reward_line(trail: Mapping[str, Any]) -> str:
    reward = trail.get("reward")
    if isinstance(reward, Mapping) and isinstance(reward.get("value"), int | float):
        line = f"{float(reward['value']):g}"
        if reward.get("scorer"):
            line += f" by {reward['scorer']}"
        if reward.get("detail"):
            line += f": {reward['detail']}"
        return line
    failure = trail.get("failure")
    return f"not scored ({failure})" if failure else "not scored"


_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em auto; max-width: 1100px;
       padding: 0 1em; color: #1d1d1d; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 2em; }
dl.head { display: grid; grid-template-columns: max-content 1fr; gap: .25em 1em; }
dl.head dt { font-weight: 600; } dl.head dd { margin: 0; white-space: pre-wrap; }
section.step { border-top: 1px solid #ccc; padding: .8em 0; }
.action { font-family: ui-monospace, monospace; background: #f3f3f3; padding: .3em .5em;
          white-space: pre-wrap; word-break: break-all; }
.failed { color: #a03c3c; } .url { font-family: ui-monospace, monospace; word-break: break-all; }
.result { white-space: pre-wrap; }
img { max-width: min(100%, 960px); border: 1px solid #bbb; display: block; margin-top: .5em; }
table { border-collapse: collapse; } td, th { padding: .25em .6em; border-bottom: 1px solid #ddd;
text-align: left; }
"""


def _page(title: str, body: list[str]) -> str:
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en">',
            "<head>",
            '<meta charset="utf-8">',
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
            '<meta name="referrer" content="no-referrer">',
            f"<title>{_e(title)}</title>",
            f"<style>{_STYLE}</style>",
            "</head>",
            "<body>",
            *body,
            "</body>",
            "</html>",
            "",
        ]
    )


def _step_section(step: Mapping[str, Any], number: int, image: str | None) -> list[str]:
    tool = _text(step, "tool") or "?"
    arguments = step.get("arguments")
    shown = json.dumps(arguments, ensure_ascii=False, sort_keys=True) if arguments else ""
    ok = step.get("ok") is True
    result = _text(step, "message")
    if not ok:
        result = f"error ({_text(step, 'error') or 'unknown'}): {result}"
    events = step.get("events")
    notes = [str(e) for e in events] if isinstance(events, list) else []
    lines = [
        f'<section class="step" id="step-{number}">',
        f"<h2>Step {number}</h2>",
        f'<div class="action">{_e(tool)}({_e(shown)})</div>',
        f'<p class="result{"" if ok else " failed"}">{_e(result)}</p>',
    ]
    lines += [f'<p class="note">note: {_e(note)}</p>' for note in notes]
    url, title = _text(step, "url"), _text(step, "title")
    if url or title:
        lines.append(
            f'<p>page: <span class="title">{_e(title or "(no title)")}</span> '
            f'<span class="url">{_e(url)}</span></p>'
        )
    if image is not None:
        lines.append(f'<img src="{_e(image)}" alt="screenshot after step {number}">')
    else:
        lines.append("<p>(no screenshot this step)</p>")
    lines.append("</section>")
    return lines


def _copy_screenshot(
    store: ArtifactStore, trail_url: str, name: object, folder: Path
) -> str | None:
    """Copies screenshot ``name`` from beside the trail into ``folder``; its name, or None for
    a name that is no ``NNN.png`` or bytes that are no PNG."""
    if not isinstance(name, str) or not _SCREENSHOT_NAME.match(name):
        return None
    url = f"{trail_url.rsplit('/', 1)[0]}/{name}"
    try:
        data = store.read_bytes(url)
    except Exception as exc:  # the store's errors name the URL
        log.warning("screenshot %s not copied into the report: %s", url, exc)
        return None
    if len(data) > MAX_PNG_BYTES or not data.startswith(PNG_SIGNATURE):
        log.warning("screenshot %s is no PNG (or too large): left out of the report", url)
        return None
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)
    return name


def render_trail_page(
    trail: Mapping[str, Any], model: str, images: Sequence[str | None], index_href: str
) -> str:
    """One episode's page: ``images[i]`` is step i's screenshot, relative to the page."""
    steps = trail.get("steps")
    steps = [s for s in steps if isinstance(s, Mapping)] if isinstance(steps, list) else []
    response = trail.get("response")
    task = _text(trail, "task_id")
    body = [
        f'<p><a href="{_e(index_href)}">All trails</a></p>',
        f"<h1>{_e(model)}: {_e(task)}</h1>",
        '<dl class="head">',
        f'<dt>Intent</dt><dd class="intent">{_e(_text(trail, "intent"))}</dd>',
        f'<dt>Answer</dt><dd class="answer">'
        f"{_e(response) if response is not None else '(no answer given)'}</dd>",
        f'<dt>Reward</dt><dd class="reward">{_e(_reward_line(trail))}</dd>',
        f"<dt>Ended</dt><dd>{_e(_text(trail, 'status'))} ({_e(_text(trail, 'outcome'))})</dd>",
        f'<dt>Start page</dt><dd class="url">{_e(_text(trail, "start_url"))}</dd>',
        f"<dt>Harness</dt><dd>{_e(_text(trail, 'harness'))}</dd>",
        f"<dt>Rollout</dt><dd>{_e(_text(trail, 'rollout_id'))}</dd>",
        "</dl>",
    ]
    for number, step in enumerate(steps):
        image = images[number] if number < len(images) else None
        body += _step_section(step, number, image)
    return _page(f"{model}: {task}", body)


def _index_page(links: Sequence[TrailLink]) -> str:
    body = [
        "<h1>Screenshot trails of evaluated GUI episodes</h1>",
        "<p>A few episodes per model, successes and failures; each page shows every action "
        "with its result and the screenshot after it.</p>",
        "<table>",
        "<tr><th>model</th><th>task</th><th>harness</th><th>reward</th><th>resolved</th>"
        "<th>steps</th><th>page</th></tr>",
    ]
    prefix = f"{TRAILS_FOLDER}/"
    for link in links:
        href = link.page.removeprefix(prefix)
        reward = "-" if link.reward is None else f"{link.reward:g}"
        body.append(
            f"<tr><td>{_e(link.model)}</td><td>{_e(link.task_id)}</td><td>{_e(link.harness)}</td>"
            f"<td>{_e(reward)}</td><td>{'yes' if link.resolved else 'no'}</td>"
            f'<td>{link.steps}</td><td><a href="{_e(href)}">{_e(href)}</a></td></tr>'
        )
    body.append("</table>")
    return _page("Screenshot trails", body)


def write_trail_pages(
    choices: Sequence[TrailChoice], store: ArtifactStore, report_dir: Path
) -> tuple[TrailLink, ...]:
    """Writes each chosen episode's page and screenshots, and the index, under
    ``report_dir/trails``; returns the pages written (a trail that cannot be read is logged and
    left out). Nothing is written when no page is."""
    folder = report_dir / TRAILS_FOLDER
    if folder.is_dir() and not folder.is_symlink():
        shutil.rmtree(folder)  # an earlier report's pages: this one chooses anew
    links: list[TrailLink] = []
    numbers: dict[str, int] = {}
    for choice in choices:
        try:
            raw = store.read_bytes(choice.url)
            if len(raw) > MAX_TRAIL_BYTES:
                raise ValueError(f"{len(raw)} bytes, more than {MAX_TRAIL_BYTES}")
            trail = json.loads(raw)
            if not isinstance(trail, dict):
                raise ValueError("not a JSON object")
        except Exception as exc:  # the store's errors, or a file that is no trail
            log.warning("GUI trail %s left out of the report: %s", choice.url, exc)
            continue
        model = _slug(choice.model)
        number = numbers[model] = numbers.get(model, 0) + 1
        name = f"{number}-{_slug(choice.task_id)}"
        steps = trail.get("steps")
        steps = [s for s in steps if isinstance(s, Mapping)] if isinstance(steps, list) else []
        shots = folder / model / name
        images = [
            f"{name}/{copied}"
            if (copied := _copy_screenshot(store, choice.url, step.get("screenshot"), shots))
            else None
            for step in steps
        ]
        page = folder / model / f"{name}.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(
            render_trail_page(trail, choice.model, images, "../index.html"), encoding="utf-8"
        )
        links.append(
            TrailLink(
                model=choice.model,
                task_id=choice.task_id,
                harness=choice.harness,
                reward=choice.reward,
                resolved=choice.resolved,
                steps=len(steps),
                page=f"{TRAILS_FOLDER}/{model}/{name}.html",
            )
        )
    if links:
        (folder / "index.html").write_text(_index_page(links), encoding="utf-8")
    return tuple(links)


def report_trails(
    evaluate_dir: Path,
    models: Sequence[str],
    mark: float,
    report_dir: Path,
    *,
    store: ArtifactStore | None,
    per_model: int = PER_MODEL,
) -> tuple[TrailLink, ...]:
    """What the pipeline calls: the trail pages of a few evaluated GUI episodes per model (see
    the module docstring), none when the evaluation kept no trails or there is no ``store``."""
    choices = evaluated_trails(evaluate_dir, models, mark, per_model)
    if not choices:
        return ()
    if store is None:
        log.warning("the evaluation kept GUI trails but the stack names no artifact store")
        return ()
    return write_trail_pages(choices, store, report_dir)

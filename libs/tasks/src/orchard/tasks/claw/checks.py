"""A Claw task's checks as the reward service runs them: shell commands that exit 0 to pass.

Each check is a self-contained Python script (the standard library only) fed to ``python3``
through a here-document: the source of the helpers and of one check kind of
`orchard.tasks.claw.apps.verify`, and the check's settings as JSON. It reads the state folder
(``$CLAW_HOME``, default ``/srv/claw``), prints what it found and exits 1 on a problem. Nothing
it runs comes from the sandbox, so an agent cannot change how it is scored, only what it did.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from typing import Any, Literal

from orchard.tasks.claw.apps import verify

__all__ = ["Check", "Part", "check_script"]

Part = Literal["completion", "safety", "robustness"]

_FOOTER = """
def _main():
    home = Path(os.environ.get("CLAW_HOME") or "/srv/claw")
    problems = {function}(home, json.loads({settings!r}))
    for problem in problems:
        print("FAIL:", problem)
    if not problems:
        print("ok: {name}")
    sys.exit(1 if problems else 0)


_main()
"""

_HEADER = (
    "import csv\nimport datetime as dt\nimport hashlib\nimport io\nimport json\nimport os\n"
    "import re\nimport sys\nfrom pathlib import Path\nfrom typing import Any\n\n"
)

_DELIMITER = "CLAW_CHECK_END"


@dataclass(frozen=True, slots=True)
class Check:
    """One check of a task: its part of the score, a name for the evidence, its kind and
    settings (see `orchard.tasks.claw.apps.verify.KINDS`)."""

    part: Part
    name: str
    kind: str
    settings: dict[str, Any]

    def script(self) -> str:
        return check_script(self.kind, self.settings, self.name)

    def command(self) -> str:
        """The shell command: ``python3`` reading the script from a here-document."""
        return f"python3 - <<'{_DELIMITER}'\n{self.script()}{_DELIMITER}\n"

    def config(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """The check in the reward service's form (``CheckConfig``)."""
        return {"name": self.name, "command": self.command(), "timeout_s": timeout_s}


def check_script(kind: str, settings: dict[str, Any], name: str = "") -> str:
    """The Python source that runs check ``kind`` with ``settings``."""
    function = verify.KINDS.get(kind)
    if function is None:
        raise ValueError(f"unknown check kind {kind!r}; kinds: {', '.join(verify.KINDS)}")
    parts = [inspect.getsource(helper) for helper in verify.HELPERS]
    parts.append(inspect.getsource(function))
    body = "\n\n".join(parts)
    footer = _FOOTER.format(
        function=function.__name__,
        settings=json.dumps(settings, sort_keys=True),
        name=(name or kind).replace('"', "'"),
    )
    script = _HEADER + body + footer
    if _DELIMITER in script:  # a setting that would end the here-document early
        raise ValueError(f"check settings must not contain {_DELIMITER!r}")
    return script

"""The GUI domain: a browser driven through 13 atomic tools, and offline websites to drive it on.

- `actions`: the tools' names and JSON schemas (`tool_schemas()` in OpenAI function format) and
  the checking of a call's arguments;
- `browser`: `BrowserSession`, one Playwright-driven Chromium that runs the tools and returns
  an `Observation` (screenshot, viewport, tabs) after each, never hanging on a bad page;
- `browser_server`: the same tools as an MCP server (stdio or streamable HTTP), the process a
  browser sandbox runs;
- `sites`: the offline websites (shop, multi-step form, widget playground) and their server,
  with each site's state readable by a task's check.

`browser` and `browser_server` need the extra ``gui`` (playwright) and Debian's ``chromium``;
`sites` and `actions` need only the standard library.
"""

from .actions import TOOL_NAMES, ToolArgumentError, tool_schemas, validate_arguments
from .observation import DialogRecord, ErrorKind, Observation, TabInfo

__all__ = [
    "TOOL_NAMES",
    "DialogRecord",
    "ErrorKind",
    "Observation",
    "TabInfo",
    "ToolArgumentError",
    "tool_schemas",
    "validate_arguments",
]

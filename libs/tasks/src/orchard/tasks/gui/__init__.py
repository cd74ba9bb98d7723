"""The GUI domain: a browser driven through 13 atomic tools, and offline websites to drive it on.

- `actions`: the tools' names and JSON schemas (`tool_schemas()` in OpenAI function format) and
  the checking of a call's arguments;
- `browser`: `BrowserSession`, one Playwright-driven Chromium that runs the tools and returns
  an `Observation` (screenshot, viewport, tabs) after each, never hanging on a bad page;
- `browser_server`: the same tools as an MCP server (stdio or streamable HTTP), the process a
  browser sandbox runs;
- `page_text`: the active page as compact text (elements, names, values, the centres a click
  hits), which observations carry for students that cannot see pixels;
- `sites`: the offline websites (shop, multi-step form, widget playground, room booking, wiki,
  a portal whose codes open in new tabs) and their server, each seeded per task with a world
  and with its state readable by a task's check;
- `suite`: the built-in task suite (`generate_suite`, `split_suite`, `GuiTask.check`);
- `teacher`: a scripted teacher that plans each task in semantic steps and turns them into
  tool calls from the page text, optionally with mistakes.

`browser` and `browser_server` need the extra ``gui`` (playwright) and Debian's ``chromium``;
`sites`, `suite`, `actions` and `page_text`'s parsing need only the standard library.
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

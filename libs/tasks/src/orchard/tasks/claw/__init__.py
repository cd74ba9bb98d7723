"""The Claw (personal-assistant) task domain: apps that run inside the sandbox, the built-in
suite generated in code, its checks, and how both reach a sandbox.

| module | what |
|---|---|
| `apps` | the in-sandbox apps (stdlib only): state folder, operations, CLI and MCP front ends |
| `world` | a task's seed state |
| `checks` | checks as self-contained scripts, in the reward service's form |
| `suite` | the families, `generate_suite`, `split_suite`, `task_by_id` |
| `bundle` | the tools and MCP archives, the setup commands |
| `specs` | `TaskSpec` values a rollout job carries |
| `synthesis` | generate, validate in a sandbox, keep what passes |
"""

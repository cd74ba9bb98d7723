"""The Claw apps as they run inside a sandbox: mail, calendar, contacts, notes and documents.

Standard library only and relative imports only, so the host's ``python3`` runs this package
from any folder it is copied to (`orchard.tasks.claw.bundle` ships it as ``clawapps``).
`store` holds the state folder, the audit log and the seeded faults; `ops` every operation of
every app; `cli` and `mcp_server` are the two front ends over the same operations.
"""

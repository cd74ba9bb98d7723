"""Rebuild the captured calls of one rollout into a prefix tree over tokens, and its trajectories.

Each call becomes a node whose history is its prompt followed by its output. A call attaches to
the node whose history is the longest prefix of its prompt (the root has the empty history);
the prompt tokens past that history are the call's observation tokens (loss mask 0). Every
root-to-leaf path of main-line calls is one trajectory.

- Retries: siblings with the same prompt are attempts at one step. Attempts that led nowhere
  (leaves) are dead and removed while another attempt of the same step is kept; when every
  attempt is a leaf, the one with the longest valid continuation stays.
- Auxiliary calls (`CallRecord.branch` set: compaction, sub-agents) attach to main-line nodes or
  to calls of their own branch, never the other way round. Their paths are kept as trajectories
  marked with the branch, every turn out of the loss.
- An unmodified agent program names no branch, so one is inferred (`infer_branches`): the main
  line speaks under the system prompt of the rollout's first call; a call under another system
  prompt is a sub-agent's (or a side task's: a title, a summary), branch ``subagent:<digest of
  its system prompt>``, unless its last message asks for a summary of the conversation, which
  is a compaction (``compaction``). Calls without a system prompt are left as they are.
- A node shared by several trajectories is trained once per rollout: only the first trajectory
  that holds it keeps its loss mask.
- A rollout whose tree still has more main-line leaves under one root than the limit after
  pruning is discarded with the reason; the caller excludes it from training.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from google.protobuf import duration_pb2, timestamp_pb2

from orchard.rollout.capture import CallRecord
from orchard.types.v1 import trajectory_pb2

VALID_FINISH_REASONS = frozenset({"stop", "tool_calls"})
"""Finish reasons of a complete turn; "length" (cut off) is not a valid continuation."""


@dataclass(frozen=True, slots=True)
class TreeLimits:
    """How much branching a rollout may have and still be trained on."""

    max_main_leaves: int = 8
    """Most main-line trajectories that fork from one context (one root of the tree) after retry
    pruning. Past it the harness is searching, not acting, and the rollout is discarded. Fresh
    contexts do not count against it: a program that rebuilds its prompt on every call (OpenClaw
    drops the block it appended last time) starts a root per call."""

    def __post_init__(self) -> None:
        if self.max_main_leaves < 1:
            raise ValueError(f"max_main_leaves must be at least 1, got {self.max_main_leaves}")


@dataclass(slots=True, eq=False)
class CallNode:
    """One call in the tree."""

    call: CallRecord
    parent: CallNode | None
    children: list[CallNode] = field(default_factory=list)

    @property
    def history(self) -> tuple[int, ...]:
        return self.call.prompt_token_ids + self.call.output_token_ids

    @property
    def observation_token_ids(self) -> tuple[int, ...]:
        """The prompt tokens past the parent's history: what the harness added before the call."""
        start = len(self.parent.history) if self.parent is not None else 0
        return self.call.prompt_token_ids[start:]

    @property
    def is_auxiliary(self) -> bool:
        return bool(self.call.branch)

    def main_children(self) -> list[CallNode]:
        return [c for c in self.children if not c.is_auxiliary]


@dataclass(frozen=True, slots=True)
class TreePath:
    """One root-to-leaf path: a trajectory before it becomes a proto."""

    nodes: tuple[CallNode, ...]
    branch: str
    """Empty for a main-line path, else the auxiliary branch of its last call."""
    trained: tuple[bool, ...]
    """Per node: whether this path is the one that trains it (False for shared and auxiliary
    nodes)."""


@dataclass(frozen=True, slots=True)
class TrajectoryTree:
    """The tree of one rollout, after pruning."""

    rollout_id: str
    roots: tuple[CallNode, ...]
    paths: tuple[TreePath, ...]
    """Main-line paths first, in order of their first call; then auxiliary paths."""
    pruned_call_ids: tuple[str, ...]
    """Calls removed as retry dead-leaves, in arrival order."""
    discard_reason: str
    """Empty when the rollout may be trained on; else why not."""
    unique_token_count: int
    """Tokens of the tree counted once however many paths share them."""
    path_token_count: int
    """Tokens summed over every path (shared prefixes counted once per path)."""

    @property
    def main_paths(self) -> tuple[TreePath, ...]:
        return tuple(p for p in self.paths if not p.branch)

    @property
    def auxiliary_paths(self) -> tuple[TreePath, ...]:
        return tuple(p for p in self.paths if p.branch)


def _is_prefix(prefix: tuple[int, ...], of: tuple[int, ...]) -> bool:
    return len(prefix) <= len(of) and of[: len(prefix)] == prefix


def _attach(call: CallRecord, nodes: Sequence[CallNode]) -> CallNode | None:
    """The node whose history is the longest prefix of the call's prompt, None for the root."""
    best: CallNode | None = None
    for node in nodes:
        if node.is_auxiliary and node.call.branch != call.branch:
            continue
        if not _is_prefix(node.history, call.prompt_token_ids):
            continue
        # Longest history wins; on a tie (identical histories) the later call.
        if best is None or len(node.history) >= len(best.history):
            best = node
    return best


def _depth_tokens(node: CallNode) -> tuple[bool, int]:
    """Rank of the continuation below (and including) a node: whether its best path ends in a
    valid turn, then how many tokens that path adds."""
    own = len(node.observation_token_ids) + len(node.call.output_token_ids)
    below = [_depth_tokens(c) for c in node.main_children()]
    if not below:
        return (node.call.finish_reason in VALID_FINISH_REASONS, own)
    valid, tokens = max(below)
    return (valid, own + tokens)


def _prune_retries(siblings: list[CallNode], pruned: list[CallNode]) -> list[CallNode]:
    """Drop dead retry leaves among the main-line children of one node."""
    by_prompt: dict[tuple[int, ...], list[CallNode]] = {}
    for node in siblings:
        if not node.is_auxiliary:
            by_prompt.setdefault(node.call.prompt_token_ids, []).append(node)
    dead: set[int] = set()
    for attempts in by_prompt.values():
        if len(attempts) < 2:
            continue
        alive = [n for n in attempts if n.children]
        if alive:
            dead.update(id(n) for n in attempts if not n.children)
            continue
        keep = max(attempts, key=lambda n: (*_depth_tokens(n), n.call.seq))
        dead.update(id(n) for n in attempts if n is not keep)
    pruned.extend(n for n in siblings if id(n) in dead)
    return [n for n in siblings if id(n) not in dead]


def _unique_tokens(sequences: Sequence[tuple[int, ...]]) -> int:
    """Nodes of a token trie holding the sequences: each prefix shared by several counts once."""
    ordered = sorted(set(sequences))
    total = 0
    previous: tuple[int, ...] = ()
    for seq in ordered:
        common = 0
        for a, b in zip(previous, seq, strict=False):
            if a != b:
                break
            common += 1
        total += len(seq) - common
        previous = seq
    return total


_COMPACTION = re.compile(
    r"\b(summari[sz]e|summary of|compact)\b.{0,80}\b(conversation|context|session|so far)\b",
    re.IGNORECASE | re.DOTALL,
)


def _system_text(call: CallRecord) -> str | None:
    """The call's leading system (or developer) message, None without one."""
    if not call.request_messages:
        return None
    first = call.request_messages[0]
    if first.get("role") not in ("system", "developer"):
        return None
    content = first.get("content")
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def _last_text(call: CallRecord) -> str:
    if not call.request_messages:
        return ""
    content = call.request_messages[-1].get("content")
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def infer_branches(calls: Sequence[CallRecord]) -> list[CallRecord]:
    """``calls`` (in arrival order) with the branch of each undeclared auxiliary call filled in;
    see the module's notes. Declared branches stay as they are."""
    ordered = sorted(calls, key=lambda c: c.seq)
    main = next((_system_text(c) for c in ordered if not c.branch), None)
    if main is None:
        return ordered
    out = []
    for call in ordered:
        system = _system_text(call)
        if call.branch or system is None or system == main:
            out.append(call)
            continue
        if _COMPACTION.search(_last_text(call)):
            branch = "compaction"
        else:
            branch = "subagent:" + hashlib.sha256(system.encode()).hexdigest()[:8]
        out.append(
            dataclasses.replace(
                call, branch=branch, metadata={**call.metadata, "branch_inferred": "true"}
            )
        )
    return out


def build_tree(
    calls: Sequence[CallRecord],
    limits: TreeLimits | None = None,
    *,
    infer: bool = True,
) -> TrajectoryTree:
    """The pruned tree of one rollout's calls (any order; arrival order is `seq`); with
    ``infer``, undeclared auxiliary calls get a branch first (`infer_branches`).

    Raises ValueError when the calls belong to several rollouts or repeat a call id.
    """
    limits = limits or TreeLimits()
    ordered = infer_branches(calls) if infer else sorted(calls, key=lambda c: c.seq)
    rollout_ids = {c.rollout_id for c in ordered}
    if len(rollout_ids) > 1:
        raise ValueError(f"calls of several rollouts in one tree: {sorted(rollout_ids)}")
    ids = [c.call_id for c in ordered]
    if len(set(ids)) != len(ids):
        raise ValueError("a call id appears twice in one rollout's calls")
    rollout_id = ordered[0].rollout_id if ordered else ""

    nodes: list[CallNode] = []
    roots: list[CallNode] = []
    for call in ordered:
        parent = _attach(call, nodes)
        node = CallNode(call=call, parent=parent)
        (parent.children if parent is not None else roots).append(node)
        nodes.append(node)

    # Prune bottom-up so a retry whose only continuation was pruned becomes a dead leaf too.
    pruned: list[CallNode] = []

    def prune(children: list[CallNode]) -> list[CallNode]:
        for child in children:
            child.children = prune(child.children)
        return _prune_retries(children, pruned)

    roots = prune(roots)

    main_paths: list[tuple[CallNode, ...]] = []
    aux_paths: list[tuple[CallNode, ...]] = []

    def walk(node: CallNode, prefix: tuple[CallNode, ...]) -> None:
        path = (*prefix, node)
        main_kids = node.main_children()
        aux_kids = [c for c in node.children if c.is_auxiliary]
        # An auxiliary node continues its branch through children of the same branch only.
        if node.is_auxiliary:
            same = [c for c in node.children if c.call.branch == node.call.branch]
            if not same:
                aux_paths.append(path)
            for child in same:
                walk(child, path)
            return
        if not main_kids:
            main_paths.append(path)
        for child in main_kids + aux_kids:
            walk(child, path)

    for root in roots:
        walk(root, ())
    main_paths.sort(key=lambda p: p[0].call.seq)
    aux_paths.sort(key=lambda p: p[-1].call.seq)

    trained_once: set[int] = set()
    paths: list[TreePath] = []
    for path in [*main_paths, *aux_paths]:
        flags = []
        for node in path:
            first = not node.is_auxiliary and id(node) not in trained_once
            trained_once.add(id(node))
            flags.append(first)
        branch = path[-1].call.branch
        paths.append(TreePath(nodes=path, branch=branch, trained=tuple(flags)))

    sequences = [path[-1].history for path in [*main_paths, *aux_paths]]
    discard = ""
    per_root: dict[int, int] = {}
    for path in main_paths:
        per_root[id(path[0])] = per_root.get(id(path[0]), 0) + 1
    widest = max(per_root.values(), default=0)
    if widest > limits.max_main_leaves:
        discard = (
            f"the rollout branches into {widest} main-line trajectories from one context after "
            f"retry pruning, more than the limit of {limits.max_main_leaves}"
        )
    pruned.sort(key=lambda n: n.call.seq)
    return TrajectoryTree(
        rollout_id=rollout_id,
        roots=tuple(roots),
        paths=tuple(paths),
        pruned_call_ids=tuple(n.call.call_id for n in pruned),
        discard_reason=discard,
        unique_token_count=_unique_tokens(sequences),
        path_token_count=sum(len(s) for s in sequences),
    )


Decoder = Callable[[Sequence[int]], str]


def _messages_text(messages: Sequence[dict[str, object]]) -> str:
    parts = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):  # OpenAI content parts
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"{message.get('role', '?')}: {content if content is not None else ''}")
    return "\n".join(parts)


def _observation_text(node: CallNode, decode: Decoder | None) -> str:
    if decode is not None:
        return decode(node.observation_token_ids)
    messages = node.call.request_messages
    if node.parent is not None and node.parent.call.request_messages:
        # The parent's messages, then the assistant message it produced, then what is new.
        messages = messages[len(node.parent.call.request_messages) + 1 :]
    return _messages_text(messages)


def _turn(index: int, node: CallNode, trained: bool, decode: Decoder | None) -> trajectory_pb2.Turn:
    call = node.call
    start = timestamp_pb2.Timestamp()
    start.FromNanoseconds(int(call.started_at * 1e9))
    latency = duration_pb2.Duration()
    latency.FromNanoseconds(int(call.latency_s * 1e9))
    kind = (
        trajectory_pb2.TURN_KIND_AUXILIARY if node.is_auxiliary else trajectory_pb2.TURN_KIND_POLICY
    )
    return trajectory_pb2.Turn(
        index=index,
        kind=kind,
        input_token_ids=node.observation_token_ids,
        output_token_ids=call.output_token_ids,
        output_logprobs=call.output_logprobs,
        output_loss_mask=[trained] * len(call.output_token_ids),
        weight_version=call.weight_version,
        finish_reason=call.finish_reason,
        output_text=call.output_text,
        tool_calls=[
            trajectory_pb2.ToolCall(
                id=str(tc.get("id", "")),
                name=str(tc.get("function", {}).get("name", "")),
                arguments_json=str(tc.get("function", {}).get("arguments", "")),
            )
            for tc in call.tool_calls
        ],
        start_time=start,
        latency=latency,
        input_text=_observation_text(node, decode),
    )


def tree_trajectories(
    tree: TrajectoryTree,
    *,
    task_id: str,
    harness: str,
    outcome: trajectory_pb2.TrajectoryOutcome.ValueType,
    decode: Decoder | None = None,
) -> list[trajectory_pb2.Trajectory]:
    """The tree's paths as Trajectory protos (reward and group are the caller's to set).

    Each path's turns start at the root, so a trajectory's tokens are complete on their own;
    `metadata["branch"]` names an auxiliary path, `metadata["call_ids"]` lists its calls.
    """
    out = []
    for i, path in enumerate(tree.paths):
        trajectory = trajectory_pb2.Trajectory(
            id=f"{tree.rollout_id}/{i}",
            rollout_id=tree.rollout_id,
            task_id=task_id,
            harness=harness,
            outcome=outcome,
            turns=[
                _turn(j, node, trained, decode)
                for j, (node, trained) in enumerate(zip(path.nodes, path.trained, strict=True))
            ],
        )
        trajectory.metadata["call_ids"] = ",".join(n.call.call_id for n in path.nodes)
        if path.branch:
            trajectory.metadata["branch"] = path.branch
        out.append(trajectory)
    return out

"""`after:`: which jobs run once for each occurrence of another, and the refusals a schema cannot state.

An entry of `after:` is a job name (on: success) or `{job: NAME, on: success|failure|always}`. The graph
the entries draw must be a forest of chains and fan-outs without a loop: a cycle would make one occurrence
run forever, so it is refused at load, at the entry that closes it, with the loop spelled out.
"""

from __future__ import annotations

import difflib

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    from typing import Any, Callable

ON_VALUES = ("success", "failure", "always")


def entries(raw: Any) -> list[tuple[int, str, str]]:
    """(index, parent, on) for each well-formed entry of a job's `after:` (the schema reports the others)."""
    out = []
    for i, item in enumerate(raw if isinstance(raw, list) else []):
        if isinstance(item, str):
            out.append((i, item, "success"))
        elif isinstance(item, dict) and isinstance(item.get("job"), str):
            on = item.get("on", "success")
            out.append((i, item["job"], on if on in ON_VALUES else "success"))
    return out


MAX_CHILDREN = 32  # jobs after one parent: with pruning and the health check, well under Consul's 128 ops


def parents(raw: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """The job's (parent, on) pairs, in the manifest's order."""
    return tuple((parent, on) for _, parent, on in entries(raw.get("after")))


def _path(jpath: tuple[Any, ...], raw: Any, i: int) -> tuple[Any, ...]:
    return jpath + ("after", i) + (("job",) if isinstance(raw[i], dict) else ())


def check(jobs: dict[str, Any], defaults: dict[str, Any], add: Callable[[tuple[Any, ...], str], None]) -> None:
    """Every refusal about `after:` and `schedule:` together: each job needs one of them; an entry names a job
    of this manifest, not the job itself nor one twice, and no entries make a cycle; a chain joins occurrences,
    which a job with several holders at once (lock.concurrency > 1) does not have."""
    graph: dict[str, list[tuple[str, tuple[Any, ...]]]] = {}
    for name, job in jobs.items():
        if not isinstance(job, dict):
            continue
        jpath = ("jobs", name)
        raw = job.get("after")
        if "schedule" not in job and "after" not in job:
            add(jpath, "missing required key 'schedule'")
            continue
        seen: set[str] = set()
        for i, parent, _ in entries(raw):
            where = _path(jpath, raw, i)
            if parent == name:
                add(where, f"job {name!r} cannot run after itself")
            elif parent not in jobs:
                hint = difflib.get_close_matches(parent, [str(j) for j in jobs], n=1)
                add(where, f"unknown job {parent!r}" + (f" (did you mean {hint[0]!r}?)" if hint else ""))
            elif parent in seen:
                add(where, f"names job {parent!r} twice")
            else:
                graph.setdefault(name, []).append((parent, where))
                for who, label in ((name, "it"), (parent, f"its parent {parent!r}")):
                    if isinstance(jobs.get(who), dict) and jobs[who].get("mode") == "each-node":
                        add(where, f"{label} is mode: each-node, whose occurrence is run by every node: a chain "
                                   "joins one run to one run")
                    elif _concurrency(jobs.get(who), defaults) > 1:
                        add(where, f"{label} runs with lock.concurrency above 1: its runs are no occurrences, and a "
                                   "chain joins occurrences (it needs lock.concurrency: 1)")
            seen.add(parent)
    _cycles(graph, add)
    children: dict[str, list[tuple[Any, ...]]] = {}
    for child, edges in graph.items():
        for parent, where in edges:
            children.setdefault(parent, []).append(where)
    for parent, wheres in children.items():  # each child's request rides in the parent's result transaction
        if len(wheres) > MAX_CHILDREN:
            add(wheres[MAX_CHILDREN], f"job {parent!r} has more than {MAX_CHILDREN} jobs after it: their requests go "
                                      "in its result's one transaction, which Consul caps at 128 operations")


def _concurrency(job: Any, defaults: dict[str, Any]) -> int:
    blocks = [b for b in (defaults.get("lock"), job.get("lock") if isinstance(job, dict) else None)
              if isinstance(b, dict)]
    value = {k: v for b in blocks for k, v in b.items()}.get("concurrency", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def _cycles(graph: dict[str, list[tuple[str, tuple[Any, ...]]]], add: Callable[[tuple[Any, ...], str], None]) -> None:
    """Report each cycle once, at the entry that closes it (depth-first, jobs and entries in manifest order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in graph:
        if start in state:
            continue
        path, todo = [start], [iter(graph.get(start, []))]  # iterative: a chain of thousands of jobs is no stack
        state[start] = 1
        while todo:
            step = next(todo[-1], None)
            if step is None:
                state[path.pop()] = 2
                todo.pop()
                continue
            parent, where = step
            if state.get(parent) == 1:
                loop = path[path.index(parent):] + [parent]
                add(where, "a cycle: " + " runs after ".join(repr(n) for n in loop)
                    + "; each occurrence would start the next forever")
            elif parent not in state:
                state[parent] = 1
                path.append(parent)
                todo.append(iter(graph.get(parent, [])))


def children(jobs: Any, name: str) -> tuple[tuple[str, str], ...]:
    """(child, on) for every job of `jobs` (loader.Job records) that runs after `name`, sorted by child."""
    return tuple(sorted((job.name, on) for job in jobs for parent, on in job.after if parent == name))

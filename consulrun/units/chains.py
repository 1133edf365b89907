"""The units of job chains (`after:`): the run options that join parent and child, and the child's watcher.

A parent's `consulrun run` gets `--then CHILD:ON` for each job chained after it (its final result writes
their requests); a child's gets `--after PARENT` for each of its parents; and each child gets
`<unit_prefix>-after@<job>.service` on every node it is installed on, a long-running `consulrun chain-watch`
that starts its unit for each request (docs/chains.md). A child with no schedule of its own gets no timer.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing's own flag without importing typing on every run
if TYPE_CHECKING:
    import jinja2

    from consulrun.manifest.loader import Job, Manifest

TEMPLATE = "chainwatch.j2"
WATCHER_INFIX = "-after@"  # no job name holds an `@`: the name cannot be another job's unit


def run_args(manifest: Manifest, job: Job) -> list[str]:
    from consulrun.manifest.chains import children

    argv: list[str] = []
    for parent, _ in job.after:
        argv += ["--after", parent]
    for child, on in children(manifest.jobs, job.name):
        argv += ["--then", f"{child}:{on}"]
    return argv


def watcher_name(manifest: Manifest, job: Job) -> str:
    return f"{manifest.unit_prefix}{WATCHER_INFIX}{job.name}.service"


def is_watcher(unit: str) -> bool:
    """A chain watcher is enabled and started like a timer (install.py)."""
    return WATCHER_INFIX in unit and unit.endswith(".service")


def watcher_argv(manifest: Manifest, job: Job, consulrun_path: str, service: str) -> list[str]:
    return [consulrun_path, "chain-watch", "--prefix", manifest.kv_prefix, "--unit", service,
            *(job.placement.argv() if job.placement else []), job.name]


def units(env: jinja2.Environment, manifest: Manifest, job: Job, consulrun_path: str,
          context: dict[str, object]) -> dict[str, str]:
    """The watcher unit of `job`, if it runs after another job."""
    if not job.after:
        return {}
    argv = watcher_argv(manifest, job, consulrun_path, str(context["service_name"]))
    return {watcher_name(manifest, job): env.get_template(TEMPLATE).render({**context, "watch_argv": argv})}

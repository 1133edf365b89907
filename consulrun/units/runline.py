"""The `consulrun run` command line a job's unit runs (its ExecStart=), from the job's manifest entry.

Apart from render.py, which holds the templates and their files: this is what
the wrapper is told, option by option, and grows with every option `run` gets.
"""

from __future__ import annotations

from consulrun.manifest.durations import format_duration
from consulrun.manifest.loader import Job, Manifest
from consulrun.units import chains

WATCHDOG_JOB = "_watchdog"  # consulrun.protocol.health.WATCHDOG_JOB: a name no manifest job can have


def run_argv(manifest: Manifest, job: Job, consulrun_path: str) -> list[str]:
    """The `consulrun run` command line a unit's ExecStart= carries for `job`."""
    lock = job.lock
    argv = [consulrun_path, "run", "--prefix", manifest.kv_prefix,
            "--ttl", format_duration(lock.ttl_ms), "--lock-delay", format_duration(lock.lock_delay_ms),
            "--wait", format_duration(lock.wait_ms), "--concurrency", str(lock.concurrency),
            "--skip-exit-code", str(lock.skip_exit_code)]
    for check in lock.checks:
        argv += ["--check", check]
    each_node = job.mode == "each-node"
    if lock.concurrency == 1 or each_node:  # one run per occurrence (per node for each-node); else per firing
        for spec in job.schedules:
            argv += ["--schedule", spec]
        argv += ["--on-holder-loss", job.on_holder_loss, "--history", str(job.history)]
        argv += ["--each-node"] if each_node else []
        if job.retries.attempts > 1:
            argv += ["--attempts", str(job.retries.attempts), "--retry-backoff",
                     format_duration(job.retries.backoff_ms), "--retry-max-backoff",
                     format_duration(job.retries.max_backoff_ms)]
        argv += ["--start-deadline", format_duration(job.start_deadline_ms)] if job.start_deadline_ms else []
        argv += chains.run_args(manifest, job)
    if job.ping_url:
        argv += ["--ping-url", job.ping_url]
        argv += ["--ping-output-lines", str(job.ping_output_lines)] if job.ping_output_lines else []
    if manifest.health_checks and job.name != WATCHDOG_JOB:
        argv += ["--health-check"]
    if job.pass_consul_token:
        argv += ["--pass-consul-token"]
    if job.timeout_ms:
        argv += ["--timeout", format_duration(job.timeout_ms)]
    if job.placement:
        argv += job.placement.argv()
    argv += ["--skip-when-stopped"]  # a standby stopped is no failure: it ran nothing (no OnFailure=)
    return argv + [job.name, "--", *job.command]

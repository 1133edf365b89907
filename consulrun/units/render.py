"""Rendering a manifest into unit files, and writing them all or nothing.

Templates get data, never pre-formatted unit text, so an overriding template
can rearrange settings; every manifest value still passes through the escaping
filters, which are the only way into the file.
"""

from __future__ import annotations

import contextlib
import os
from importlib import resources
from pathlib import Path

import jinja2

from consulrun.errors import OutputError, UsageError
from consulrun.manifest import hardening, unitescape, unitsettings
from consulrun.manifest.durations import format_duration
from consulrun.manifest.loader import Job, LockSettings, Manifest, TimerSettings
from consulrun.protocol.fencing import stop_timeout_ms
from consulrun.units import chains, shared
from consulrun.units.guarantees import start_timeout_ms
from consulrun.units.owner import GENERATED_MARKER, OWNED_SUFFIXES, SHARED_MARKER, Identity
from consulrun.units.owner import check_folder, identity, is_ours, is_shared, recorded
from consulrun.units.runline import WATCHDOG_JOB, run_argv  # noqa: F401 - run_argv: render's callers use it here

HEADER = (f"{GENERATED_MARKER} from a job manifest. Do not edit: change the manifest and run\n"
          "# `consulrun generate` (or `consulrun install`) again.")
TEMPLATE_NAMES = ("service.j2", "timer.j2", "onfailure.j2")


def header(manifest: Manifest, ident: Identity | None = None) -> str:
    return f"{HEADER}\n{(ident or identity(manifest, None, writing=False)).header_lines()}"


def shared_header(manifest: Manifest) -> str:
    """The watchdog unit's header names no manifest (units.shared): the same whoever writes it."""
    return (f"{HEADER}\n{SHARED_MARKER}the watchdog of every manifest with a "
            f"{shared.jobs_glob(manifest.unit_prefix)} file beside it")


def shipped_templates() -> Path:
    """The templates inside the installed package, or the source tree's top-level folder."""
    packaged = Path(str(resources.files("consulrun"))) / "templates"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "templates"


def _environment(override: Path | None) -> jinja2.Environment:
    search = [str(override)] if override else []
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(search + [str(shipped_templates())]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["exec_line"] = unitescape.exec_line
    env.filters["env_assignment"] = lambda v: unitescape.escape(v, unitescape.Context.ENV_ASSIGNMENT)
    env.filters["unit_value"] = lambda v: unitescape.escape(v, unitescape.Context.PLAIN)
    env.filters["setting_value"] = lambda v, name: unitsettings.escape(name, v)
    env.filters["duration"] = format_duration
    return env


def unit_names(manifest: Manifest, job: Job) -> tuple[str, str]:
    base = f"{manifest.unit_prefix}-{job.name}"
    return f"{base}.service", f"{base}.timer"


def on_failure_unit(manifest: Manifest, job: Job) -> str:
    """The unit OnFailure= starts for `job`: an instance file of the `<unit_prefix>-onfailure@` template name.

    One file per job (systemd reads an instance's own file before any
    template), so each job carries its own command while every name still
    reads as "on failure of <job>".
    """
    return f"{manifest.unit_prefix}-onfailure@{job.name}.service"


def on_failure_argv(manifest: Manifest, job: Job, consulrun_path: str) -> list[str]:
    """The on-failure unit's ExecStart=: consulrun gathers what happened, then runs the manifest's command."""
    service, _ = unit_names(manifest, job)
    return [consulrun_path, "on-failure", "--unit", service, "--skip-exit-code", str(job.lock.skip_exit_code),
            job.name, "--", *job.on_failure]




def watchdog_jobs_name(manifest: Manifest, ident: Identity) -> str:
    """The file beside the units with what the watchdog judges: the manifest's schedules, timers and timeouts."""
    return shared.jobs_file_name(manifest.unit_prefix, ident.name)


def watchdog_jobs_text(manifest: Manifest, ident: Identity, consulrun_path: str) -> str:
    """That file's text: the generated-by header (so it is the manifest's to replace and remove),
    what the shared watchdog unit must run with (`units.shared`), then one JSON line.

    Not in the unit's command line: a single argument may be at most 128 KiB
    (Linux's MAX_ARG_STRLEN) and a unit-file line 1 MiB (systemd), which a
    manifest of about a thousand jobs already passes.
    """
    from consulrun.report.watchdog import Watched

    settings = {"kv_prefix": manifest.kv_prefix, "consulrun": consulrun_path,
                **{f"consul.{k}": v for k, v in sorted(vars(manifest.consul).items())}}
    return (f"{header(manifest, ident)}\n{shared.settings_line(settings)}\n"
            f"{Watched.from_manifest(manifest).to_json()}\n")


def watchdog_job(manifest: Manifest, consulrun_path: str) -> Job:
    """The watchdog as a job of its own: once a minute, on one node (its own lock), judging every job's check.

    The manifest's schedules and timeouts travel in a file written beside the
    units (`watchdog_jobs_name`), one for each manifest sharing the unit,
    which the unit finds with systemd's `%Y` (the directory of the unit file
    itself), so the watchdog needs no copy of a manifest on the node,
    wherever the units are installed.
    """
    from consulrun.protocol.health import WATCHDOG_SCHEDULE

    command = (consulrun_path, "watchdog", "--prefix", manifest.kv_prefix, "--jobs-glob")
    return Job(name=WATCHDOG_JOB, command=command, schedules=(WATCHDOG_SCHEDULE,),
               description=f"consulrun watchdog: the health checks of the jobs under {manifest.kv_prefix}/",
               user=None, group=None, working_directory=None, environment=(), environment_file=None,
               timeout_ms=50_000, lock=LockSettings(), timer=TimerSettings(), history=1)


def reap_argv(manifest: Manifest, job: Job, consulrun_path: str) -> list[str]:
    """`ExecStopPost=`: after a run that did not end cleanly, free a dead wrapper's lock at once.

    A shell tests systemd's $SERVICE_RESULT first, so a clean run (or a skip)
    costs a shell, not a Python start-up. Where reap runs as root to read the
    token file (`hardening.reap_as_root`), it gets only the agent's settings
    for an environment: the job's (LD_PRELOAD, PYTHONPATH, an environment
    file's) must not reach a root process.
    """
    command = [consulrun_path]
    token: list[str] = []
    if manifest.consul.token_file and hardening.reap_as_root(manifest, job):
        command = ["/usr/bin/env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
                   *(f"{name}={value}" for name, value in _consul_environment(manifest)), consulrun_path]
        token = ["--token-file", manifest.consul.token_file]
    return ["/bin/sh", "-c", 'test "$SERVICE_RESULT" = success || exec "$@"', "sh", *command, "reap",
            "--prefix", manifest.kv_prefix, "--concurrency", str(job.lock.concurrency), *token, job.name]


def _consul_environment(manifest: Manifest) -> list[tuple[str, str]]:
    consul = manifest.consul
    pairs = [("CONSUL_HTTP_ADDR", consul.address), ("CONSUL_CACERT", consul.ca_file),
             ("CONSUL_CLIENT_CERT", consul.cert_file), ("CONSUL_CLIENT_KEY", consul.key_file),
             ("CONSUL_TLS_SERVER_NAME", consul.tls_server_name)]
    return [(name, value) for name, value in pairs if value]


def render(manifest: Manifest, consulrun_path: str, templates: Path | None = None,
           ident: Identity | None = None) -> dict[str, str]:
    """Map each unit file name to its text; same inputs, same bytes. `ident`: which manifest
    the headers name (`owner.identity` for the folder written; without it, the name alone)."""
    if not os.path.isabs(consulrun_path):
        raise UsageError(f"the consulrun path in units must be absolute, not {consulrun_path!r}")
    env = _environment(templates)
    try:
        service_t, timer_t, failure_t = (env.get_template(name) for name in TEMPLATE_NAMES)
        units: dict[str, str] = {}
        ident = ident or identity(manifest, None, writing=False)
        watchdog = (watchdog_job(manifest, consulrun_path),) if manifest.health_checks else ()
        if watchdog:
            jobs_text = watchdog_jobs_text(manifest, ident, consulrun_path)
            units[watchdog_jobs_name(manifest, ident)] = jobs_text
        for job in (*manifest.jobs, *watchdog):
            service, timer = unit_names(manifest, job)
            # The watchdog's last word is its job lists' pattern, with a specifier (`%Y`), which
            # escaping would make literal; it is made of the unit prefix's characters, `*` and `.`.
            is_watchdog = job.name == WATCHDOG_JOB
            path_word = f" %Y/{shared.jobs_glob(manifest.unit_prefix)}" if is_watchdog else ""
            head = shared_header(manifest) if is_watchdog else header(manifest, ident)
            context = {"header": head, "manifest": manifest, "job": job, "service_name": service,
                       "timer_name": timer, "run_argv": run_argv(manifest, job, consulrun_path),
                       "run_argv_suffix": path_word,
                       "consul_environment": _consul_environment(manifest),
                       "stop_timeout_ms": stop_timeout_ms(job.lock.lock_delay_ms),
                       "start_timeout_ms": start_timeout_ms(job),
                       "reap_argv": reap_argv(manifest, job, consulrun_path),
                       "hardening_settings": hardening.service_lines(manifest, job, consulrun_path),
                       "reap_prefix": "-!" if hardening.reap_as_root(manifest, job) else "-",
                       "on_failure_name": on_failure_unit(manifest, job) if job.on_failure else None,
                       "on_failure_argv": on_failure_argv(manifest, job, consulrun_path)}
            units[service] = service_t.render(context)
            if job.schedules:  # a job that only runs after others has no timer; its watcher starts it
                units[timer] = timer_t.render(context)
            units.update(chains.units(env, manifest, job, consulrun_path, context))
            if job.on_failure:
                units[context["on_failure_name"]] = failure_t.render(context)
    except jinja2.TemplateError as exc:
        where = f"{exc.filename}:{exc.lineno}: " if isinstance(exc, jinja2.TemplateSyntaxError) else ""
        raise UsageError(f"template error: {where}{exc.message or exc}") from None
    return dict(sorted(units.items()))


def is_generated(path: Path) -> bool:
    """True for a file consulrun wrote: it starts with the generated-by marker."""
    try:
        with path.open("r", encoding="utf-8", errors="replace") as handle:
            return handle.readline().startswith(GENERATED_MARKER)
    except OSError:
        return False


def _umask() -> int:
    """The process's umask, read without setting it (umask(2) would, for a moment, for every thread)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o777  # unknown: always chmod


_UMASK = _umask()


def stage(target: Path, text: str, sync: bool = True) -> Path:
    """Write `text` to a temporary file beside `target` (mode 0644), ready to be renamed over it.

    With `sync`, the file is on disk before this returns; a caller staging many
    files passes `sync=False` and calls `sync_filesystem` once before renaming.
    On any failure the temporary file is gone before the exception leaves.
    """
    tmp = target.parent / f".{target.name}.{os.getpid()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o644)
    except FileExistsError:  # left by a killed process that had our pid: nobody else can be writing it
        tmp.unlink()
        fd = os.open(tmp, flags, 0o644)
    try:
        try:
            data = memoryview(text.encode("utf-8"))
            while data:
                data = data[os.write(fd, data):]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if _UMASK & 0o644:
            os.chmod(tmp, 0o644)  # what the umask took away
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def sync_filesystem(folder: Path) -> None:
    """Flush everything written to `folder`'s filesystem (syncfs(2)): one call instead of one fsync a file."""
    import ctypes  # only the writers need it

    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(folder))
    finally:
        os.close(fd)


def _sync_folder(folder: Path) -> None:
    """Make the renames in `folder` durable (fsync of the directory)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomic(target: Path, text: str) -> None:
    """Put `text` at `target` in one rename; if the rename fails, the staged file is removed too."""
    tmp = stage(target, text)
    try:
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def stale_units(folder: Path, keep: dict[str, str] | set[str], ident: Identity) -> list[str]:
    """The generated files in `folder` that manifest `ident` owns and no longer makes, then the
    shared watchdog units no manifest's job list is left for; another manifest's are never
    among them, nor files that name no manifest."""
    names = shared.listing(folder)
    own = [n for n in names if n.endswith(OWNED_SUFFIXES) and n not in keep
           and is_ours(recorded(folder / n), ident)]
    return own + shared.unused(dict.fromkeys(keep, ""), folder, names, set(own))


def unowned_units(folder: Path, keep: dict[str, str], unit_prefix: str) -> list[str]:
    """Generated files of `unit_prefix` that name no manifest (an older consulrun wrote them) and that this
    manifest does not make: no manifest can prove them its own, so they are left, and said so."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:  # no folder (yet), or not one: nothing in it to leave or remove
        return []
    return [n for n in names if n.startswith(f"{unit_prefix}-") and n.endswith(OWNED_SUFFIXES) and n not in keep
            and is_generated(folder / n) and recorded(folder / n) is None
            and not is_shared(folder / n)]


def unowned_warning(folder: Path, names: list[str]) -> str:
    return (f"left in place in {folder}: {', '.join(names)}: made by an older consulrun, they name no manifest "
            "(remove them by hand if no manifest makes them any more)")


def write_units(units: dict[str, str], outdir: Path,
                ident: Identity) -> tuple[list[Path], list[Path]]:
    """Make `outdir` hold exactly `units` among manifest `ident`'s generated files; on failure
    nothing changes.

    Every file is first written beside its target, then all are renamed into
    place; earlier units of `name` that the manifest no longer has are
    removed. Files consulrun did not generate, and another manifest's, are
    left alone; one in the way of a unit, or another manifest of the same
    name (`owner.check_identity`), is refused. If a rename fails, the
    files already renamed get their old text back (or go, if they are new) and
    no staged file is left behind. Returns (written, removed).
    """
    if outdir.is_dir():
        check_folder(units, outdir, ident)
    created_dir = not outdir.exists()
    staged: list[tuple[Path, Path]] = []
    previous: dict[Path, str | None] = {}
    try:
        outdir.mkdir(parents=True, exist_ok=True)
        existing = set(os.listdir(outdir))  # one listing, not a stat per unit
        for unit, text in units.items():
            target = outdir / unit
            if unit in existing and not is_generated(target):
                raise OutputError(f"{target}: exists and was not generated by consulrun; refusing to overwrite it")
            previous[target] = target.read_text(encoding="utf-8") if unit in existing else None
            staged.append((stage(target, text, sync=False), target))
        sync_filesystem(outdir)  # every staged file on disk before the first rename
        renamed: list[Path] = []
        try:
            for tmp, target in staged:
                os.replace(tmp, target)
                renamed.append(target)
        except OSError:
            _put_back(renamed, previous)
            raise
        _sync_folder(outdir)
    except (OSError, OutputError) as exc:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        if created_dir:
            with contextlib.suppress(OSError):  # only if empty: the folder was made for these units
                outdir.rmdir()
        if isinstance(exc, OutputError):
            raise
        where = getattr(exc, "filename", None) or outdir
        raise OutputError(f"cannot write units to {outdir}: {where}: {exc.strerror or exc}; nothing changed") from None
    stale = [outdir / n for n in stale_units(outdir, units, ident)]
    for path in stale:
        path.unlink()
    return [target for _, target in staged], stale


def _put_back(renamed: list[Path], previous: dict[Path, str | None]) -> None:
    """Undo renames already done: old text back, new files removed (best effort: the write already failed)."""
    for target in renamed:
        restore_file(target, previous[target])


def restore_file(target: Path, old: str | None) -> None:
    """Put `old` back at `target` (remove it if there was none); best effort: the caller is undoing a failure."""
    with contextlib.suppress(OSError):
        target.unlink(missing_ok=True) if old is None else replace_atomic(target, old)

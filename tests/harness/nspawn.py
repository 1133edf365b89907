"""Real systemd as PID 1 of a container: systemd-nspawn --boot on an overlay of the host's root.

The container sees the host's own files (so the same Python, consulrun and
Consul binary), writes into a throw-away upper layer, lives in its own network
namespace and its own cgroup, and is driven with `nsenter ... systemctl`.
Host device nodes are never bound in.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

CGROUP_ROOTS = [Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified")]
# Units the host image enables that a test container has no use for; masked to keep boots fast.
MASKED = ["postgresql.service", "postgresql@.service", "apt-daily.timer", "apt-daily-upgrade.timer",
          "man-db.timer", "e2scrub_all.timer", "fstrim.timer", "dpkg-db-backup.timer", "e2scrub_reap.service",
          "systemd-timesyncd.service", "console-getty.service", "getty@.service", "avahi-daemon.service",
          "avahi-daemon.socket", "cron.service", "exim4.service", "rsync.service",
          "prometheus.service"]  # installed for the exporter tests; enabled by its package, never wanted in a container


def _cgroup_dirs(name: str) -> list[Path]:
    roots = [r for r in CGROUP_ROOTS if r.is_dir()] or [Path("/sys/fs/cgroup")]
    return [root / f"consulrun-test-{name}" for root in roots]


class Container:
    """One booted container; `shared` on the host is `/shared` inside."""

    def __init__(self, name: str, workdir: Path, netns: str | None = None, binds: list[Path] | None = None) -> None:
        self.name = name
        self.binds = [p for p in (binds or []) if p.exists()]  # host paths visible at the same path inside
        self.bind_at: dict[str, Path] = {}  # path inside -> host path (e.g. a chaos run's directory at /chaos)
        self.dir = workdir / f"ctr-{name}"
        self.netns = netns
        self.shared = self.dir / "shared"
        self.merged = self.dir / "merged"
        self.console = self.dir / "console.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.powering_off = False
        self.pid1: int | None = None

    def _prepare(self) -> None:
        upper, work = self.dir / "upper", self.dir / "work"
        for path in (upper / "dev", upper / "run", upper / "etc" / "systemd" / "system", work, self.merged,
                     self.shared):
            path.mkdir(parents=True, exist_ok=True)
        for unit in MASKED:  # a container booted again (a reboot, a cold boot) has its upper layer still
            masked = upper / "etc" / "systemd" / "system" / unit
            if not masked.is_symlink():
                masked.symlink_to("/dev/null")
        (upper / "etc" / "hostname").write_text(f"{self.name}\n")
        # Nobody reads the console of a --console=passive container: once its pty's buffer is full, PID 1 blocks on
        # its next status line or console log (a power-off then hangs until killed). The journal has it all anyway.
        (upper / "etc" / "systemd" / "system.conf.d").mkdir(parents=True, exist_ok=True)
        (upper / "etc" / "systemd" / "system.conf.d" / "harness-console.conf").write_text(
            "[Manager]\nShowStatus=no\nLogTarget=journal\n")
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir=/,upperdir={upper},workdir={work}", str(self.merged)], check=True)

    def start(self, timeout: float = 90) -> "Container":
        """Boot, and return once systemd says it is up; again after `stop`, with what the node wrote before (its
        upper layer is kept: a powered-off node boots with its own disk)."""
        if not shutil.which("systemd-nspawn"):
            raise RuntimeError("systemd-nspawn is missing (Debian package systemd-container)")
        self._prepare()
        self.powering_off, self.pid1 = False, None
        cgroups = _cgroup_dirs(self.name)
        for path in cgroups:
            path.mkdir(exist_ok=True)

        def enter_cgroup() -> None:
            for path in cgroups:
                (path / "cgroup.procs").write_text(str(os.getpid()))

        cmd = ["systemd-nspawn", "--boot", "--register=no", "--keep-unit", "--quiet", "-D", str(self.merged),
               "-M", self.name, f"--bind={self.shared}:/shared", "--console=passive"]
        cmd += [f"--bind={path}:{path}" for path in self.binds]
        cmd += [f"--bind={host}:{inside}" for inside, host in sorted(self.bind_at.items())]
        if self.netns:
            cmd.append(f"--network-namespace-path=/run/netns/{self.netns}")
        with self.console.open("wb") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            preexec_fn=enter_cgroup)  # noqa: PLW1509 - no threads here
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"container {self.name} exited early:\n{self.console.read_text()[-3000:]}")
            children = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True)
            if children.stdout.strip():
                self.pid1 = int(children.stdout.split()[0])
                state = self.exec("systemctl", "is-system-running", "--wait", check=False, timeout=timeout)
                if state.stdout.strip() in ("running", "degraded"):
                    return self
            time.sleep(0.2)
        raise RuntimeError(f"container {self.name} did not boot in {timeout}s:\n{self.console.read_text()[-3000:]}")

    def exec(self, *cmd: str, check: bool = True, timeout: float = 60,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a command inside the container (all its namespaces)."""
        assert self.pid1 is not None, "container not started"
        prefix = ["nsenter", "-t", str(self.pid1), "-a", "--"]
        if env:
            prefix += ["env", *[f"{k}={v}" for k, v in env.items()]]
        result = subprocess.run(prefix + list(cmd), capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed in {self.name} ({result.returncode}): {result.stderr}")
        return result

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.exec("systemctl", *args, check=check)

    def ended(self, unit: str) -> bool:
        """Whether `unit` has no run under way and none queued. Not `is-active != active`: a oneshot is
        `activating` for its whole run and `deactivating` while its ExecStopPost= runs, never `active`."""
        if self.systemctl("show", "-P", "ActiveState", unit).stdout.strip() not in ("inactive", "failed"):
            return False
        return not self.systemctl("list-jobs", "--no-legend", "--plain", unit).stdout.strip()

    def spawn(self, *cmd: str, log: Path) -> subprocess.Popen[bytes]:
        """Start a long-running process inside the container (e.g. its Consul agent); stop it by PID."""
        assert self.pid1 is not None, "container not started"
        with log.open("wb") as out:
            return subprocess.Popen(["nsenter", "-t", str(self.pid1), "-a", "--", *cmd], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    @staticmethod
    def end_spawned(proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
        """Stop a process `spawn` started: SIGTERM to it and to nsenter's child (nsenter does not pass signals
        on), then wait; SIGKILL after `timeout`. A process left inside keeps the container from powering off."""
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        for pid in [proc.pid, *map(int, children)]:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in [proc.pid, *map(int, children)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(timeout=10)

    @property
    def unit_dir(self) -> Path:
        """The container's /etc/systemd/system, seen from the host."""
        return self.merged / "etc" / "systemd" / "system"

    def power_off(self) -> None:
        """Ask the container to power off and return at once (`stop` waits): several then shut down side by side."""
        if self.process and self.process.poll() is None and not self.powering_off:
            self.process.send_signal(signal.SIGTERM)  # nspawn asks the container's systemd to power off
            self.powering_off = True

    def stop(self) -> None:
        """Power the container off; whatever is still in its cgroup after that is killed. Never raises."""
        if self.process and self.process.poll() is None:
            self.power_off()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        cgroups = _cgroup_dirs(self.name)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            left = [int(pid) for path in cgroups if path.exists() for procs in path.rglob("cgroup.procs")
                    for pid in procs.read_text().split()]
            if not left:
                break
            for pid in left:  # processes of this container only: they are in its own cgroup
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        subprocess.run(["umount", "-l", str(self.merged)], capture_output=True)
        for path in cgroups:
            if not path.exists():
                continue
            for sub in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                try:
                    sub.rmdir()
                except OSError:
                    pass
            try:
                path.rmdir()
            except OSError:
                pass


def tear_down(ctr: "Container | None", agent: "subprocess.Popen[bytes] | None", network: Any) -> None:
    """The end of a one-node fixture: its agent first (really stopped, see `end_spawned`), then the node, then
    its network; each part only if it was made."""
    if agent:
        Container.end_spawned(agent)
    if ctr:
        ctr.stop()
    network.down()


def stop_nodes(nodes: "list[Container]", agents: "list[subprocess.Popen[bytes]]") -> None:
    """The end of a several-node fixture: every agent first (really stopped), then every node asked to power off
    at once (they shut down side by side), then each made sure of."""
    for proc in agents:
        Container.end_spawned(proc)
    for ctr in nodes:
        ctr.power_off()
    for ctr in nodes:
        ctr.stop()

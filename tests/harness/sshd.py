"""A real sshd on loopback (its own port, host key and authorized_keys); `install` in this process.

`sshd` is a module-scoped fixture (tests/conftest.py registers this module as a plugin).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from consulrun.cli import main
from tests.conftest import require_tool
from tests.harness.agents import free_port, wait_for


MANIFEST = "jobs:\n  tick:\n    command: [/bin/true]\n    schedule: daily\n"


@dataclass
class Sshd:
    port: int
    key: Path

    def options(self) -> list[str]:
        out: list[str] = []
        for opt in (f"Port={self.port}", f"IdentityFile={self.key}", "StrictHostKeyChecking=no",
                    "UserKnownHostsFile=/dev/null", "LogLevel=ERROR", "ConnectTimeout=5"):
            out += ["--ssh-option", opt]
        return out


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    require_tool("ssh")
    sshd_bin = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.access(sshd_bin, os.X_OK):
        pytest.fail("sshd is not installed (Debian: openssh-server)", pytrace=False)
    if os.geteuid() != 0:
        pytest.fail("the loopback sshd logs in as root, so the test needs root", pytrace=False)
    work = tmp_path_factory.mktemp("sshd")
    for name in ("host_key", "id_ed25519"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(work / name)], check=True)
    (work / "authorized_keys").write_text((work / "id_ed25519.pub").read_text())
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation folder
    port = free_port()
    config = work / "sshd_config"
    config.write_text(f"ListenAddress 127.0.0.1\nPort {port}\nHostKey {work / 'host_key'}\n"
                      f"AuthorizedKeysFile {work / 'authorized_keys'}\nPidFile none\nStrictModes no\nUsePAM no\n"
                      "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n")
    log = (work / "sshd.log").open("w")
    proc = subprocess.Popen([sshd_bin, "-D", "-e", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: socket.create_connection(("127.0.0.1", port), timeout=1).close() or True, 10,
                 "the loopback sshd to listen")
        yield Sshd(port, work / "id_ed25519")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def install_here(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["install", *args], input=stdin)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr

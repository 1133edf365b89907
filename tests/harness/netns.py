"""Network namespaces joined by a bridge with no uplink: the test cluster's private LAN.

The host end of the bridge has an address too, so the test process can reach
every node's agent directly; nothing is routed anywhere else.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
from pathlib import Path


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


OWNER_ALIAS = "consulrun-test:"


def _start_time(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def remove_if_stale(bridge: str) -> bool:
    """Remove what a killed test run left behind on `bridge`: True if it was ours and dead, False if live or foreign.

    A run killed before its teardown (a session's end, the CI's timeout) leaves
    its bridge, veths and namespaces behind, and the next run's subnet is taken.
    Ours is a `crbr<tag>` bridge; it is dead when the run that made it is gone
    (the owner in its alias) and no process lives in any of its namespaces.
    """
    if not bridge.startswith("crbr"):
        return False
    tag = bridge[len("crbr"):]
    alias = _ip("-o", "link", "show", "dev", bridge, check=False).stdout
    if f"alias {OWNER_ALIAS}" in alias:
        pid, _, started = alias.split(f"alias {OWNER_ALIAS}", 1)[1].split()[0].partition(":")
        if pid.isdigit() and _start_time(int(pid)) == started and started:
            return False
    namespaces = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines()
                  if line.split() and line.split()[0].endswith(f"-{tag}") and line.startswith("crn")]
    if any(_ip("netns", "pids", ns, check=False).stdout.strip() for ns in namespaces):
        return False
    for ns in namespaces:
        _ip("netns", "del", ns, check=False)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":", 2)[1].strip().split("@")[0] if line.count(":") >= 2 else ""
        if name.startswith("crv") and name.endswith(f"-{tag}"):
            _ip("link", "del", name, check=False)
    _ip("link", "del", bridge, check=False)
    return True


class Network:
    """`count` namespaces on `subnet`: node i gets host address .(11 + i), the bridge .1."""

    def __init__(self, count: int, subnet: str = "10.213.77.0/24", tag: str = "c") -> None:
        self.count = count
        # Several checkouts may run cluster tests at once on one machine; each can move its subnets.
        prefix = os.environ.get("CONSULRUN_TEST_NET_PREFIX")
        if prefix and subnet.startswith("10.213."):
            subnet = prefix + subnet[len("10.213."):]
        self.net = ipaddress.ip_network(subnet)
        self.tag = f"{tag}{os.getpid() % 100000}"
        self.bridge = f"crbr{self.tag}"
        self.names = [f"crn{i + 1}-{self.tag}" for i in range(count)]
        self.created: list[tuple[str, str]] = []

    def address(self, index: int) -> str:
        return str(self.net.network_address + 11 + index)

    def namespace(self, index: int) -> str:
        return self.names[index]

    def veth(self, index: int) -> str:
        return f"crv{index + 1}-{self.tag}"

    def up(self) -> "Network":
        routes = _ip("route", "show", str(self.net)).stdout.strip()
        if routes:
            device = routes.split(" dev ", 1)[1].split()[0] if " dev " in routes else ""
            if not remove_if_stale(device):
                raise RuntimeError(f"test subnet {self.net} is already routed on this machine: {routes}")
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self.created.append(("link", self.bridge))
            # Who owns it, so a later run can tell a leftover of a killed run from a live one.
            _ip("link", "set", "dev", self.bridge, "alias", f"{OWNER_ALIAS}{os.getpid()}:{_start_time(os.getpid())}")
            _ip("addr", "add", f"{self.net.network_address + 1}/{self.net.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for index, ns in enumerate(self.names):
                _ip("netns", "add", ns)
                self.created.append(("netns", ns))
                host_end = self.veth(index)
                # The node's end is made inside its namespace, as eth0: a name in the host's namespace (even for
                # a moment) would collide with another worker's network being made at the same time.
                _ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
                self.created.append(("link", host_end))
                _ip("link", "set", host_end, "master", self.bridge)
                _ip("link", "set", host_end, "up")
                inside = ["netns", "exec", ns, "ip"]
                _ip(*inside, "addr", "add", f"{self.address(index)}/{self.net.prefixlen}", "dev", "eth0")
                _ip(*inside, "link", "set", "eth0", "up")
                _ip(*inside, "link", "set", "lo", "up")
        except BaseException:
            self.down()
            raise
        return self

    def partition(self, index: int) -> None:
        """Cut node `index` off the LAN (its agent keeps running)."""
        _ip("link", "set", self.veth(index), "down")

    def heal(self, index: int) -> None:
        _ip("link", "set", self.veth(index), "up")

    def down(self) -> None:
        for kind, name in reversed(self.created):
            if kind == "netns":
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
        self.created.clear()

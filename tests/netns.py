"""Hosts on one machine: a network namespace per host, each with an address of its own
on a bridge (veth pairs), and the faults only a network makes, with packet filters
(iptables, in the host's namespace): a host cut off from some peers, or losing a share
of its packets to them. The bridge's own address is the machine's (the test runner's,
and PostgreSQL's). Needs root, iproute2 and iptables."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field

BRIDGE = "plbr0"
SUBNET = "10.77.0"


def run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


@dataclass
class Network:
    """``hosts``: name -> last octet of its address."""

    hosts: dict[str, int]
    made: list[str] = field(default_factory=list)

    @property
    def gateway_address(self) -> str:
        """The machine's own address on the bridge."""
        return f"{SUBNET}.1"

    def address(self, host: str) -> str:
        return f"{SUBNET}.{self.hosts[host]}"

    def namespace(self, host: str) -> str:
        return f"pl-{host}"

    def inside(self, host: str) -> list[str]:
        """The prefix that runs a command on ``host``."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def up(self) -> Network:
        for tool in ("ip", "iptables"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} is needed for the multi-host tests "
                                   "(make test installs it)")
        self.down()  # what a killed run left behind
        run("ip", "link", "add", BRIDGE, "type", "bridge")
        run("ip", "addr", "add", f"{self.gateway_address}/24", "dev", BRIDGE)
        run("ip", "link", "set", BRIDGE, "up")
        for host in self.hosts:
            ns, veth = self.namespace(host), f"v-{host}"[:15]
            run("ip", "netns", "add", ns)
            self.made.append(ns)
            run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            run("ip", "link", "set", veth, "master", BRIDGE, "up")
            run(*self.inside(host), "ip", "addr", "add", f"{self.address(host)}/24",
                "dev", "eth0")
            run(*self.inside(host), "ip", "link", "set", "eth0", "up")
            run(*self.inside(host), "ip", "link", "set", "lo", "up")
        return self

    def down(self) -> None:
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", self.namespace(host)], capture_output=True)
            subprocess.run(["ip", "link", "del", f"v-{host}"[:15]], capture_output=True)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)

    def cut(self, host: str, peers: list[str], loss: float = 1.0) -> None:
        """Drop ``loss`` of the packets between ``host`` and each of ``peers`` (both
        ways, in ``host``'s namespace): 1.0 is a partition."""
        chance = [] if loss >= 1.0 else ["-m", "statistic", "--mode", "random",
                                          "--probability", f"{loss:.4f}"]
        for peer in peers:
            address = self.address(peer)
            run(*self.inside(host), "iptables", "-A", "OUTPUT", "-d", address, *chance,
                "-j", "DROP")
            run(*self.inside(host), "iptables", "-A", "INPUT", "-s", address, *chance,
                "-j", "DROP")

    def heal(self, host: str) -> None:
        run(*self.inside(host), "iptables", "-F")

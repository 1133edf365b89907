"""The Consul ACL policies consulrun needs, as HCL: one per role, and one token for every command.

Consul grants session rights per node, not per session: `session "<node>"
write` lets a token create and destroy sessions on that node only, and a
session's lock is taken in KV. So a node's token can be held to its own
node (its sessions, its agent), which keeps it from listing or destroying
another application's sessions elsewhere (a Vault HA lock) or making
sessions on other nodes. `unlock` must destroy a holder's session on
whichever node it is, so the operator's policy cannot be narrower than
`session_prefix ""` write.
"""

from __future__ import annotations

import re

ROLES = ("all", "node", "operator")
# Node names as consulrun accepts them in a policy: what a host name holds, nothing HCL would have to escape.
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def node_name_problem(name: str) -> str | None:
    """Why `name` cannot be put into a policy as a node name, or None."""
    if _NODE_NAME.fullmatch(name):
        return None
    return (f"node name {name[:80]!r} must be 1 to 128 letters, digits, '_', '.' or '-', starting with a letter or "
            "digit (the name the node's agent has in Consul)")


def _rule(kind: str, name: str, policy: str) -> str:
    return f'{kind} "{name}" {{\n  policy = "{policy}"\n}}'


def policy_hcl(kv_prefix: str, service_checks: bool, health_checks: bool = False, *, role: str = "all",
               node: str | None = None) -> str:
    """The rules of `role`: "all" (one token for every command, on every node), "node" (what node `node` needs to
    run, skip, take over and reap, and to run the watchdog with health checks) or "operator" (status, the
    exporter, history, unlock, pause, resume, trigger, and the watchdog by hand).

    `run` reads its agent's node name (agent read), its checks and the
    cluster's members (node read; service read when a service check is bound);
    `status` reads every holder's session and the checks bound to it. With
    health checks, write on the prefix's external node and its service, by
    exact name: the finish sets a job's check (a service check: service
    write), the watchdog registers the node (node write).
    """
    from consulrun.protocol.health import node_name

    prefix = kv_prefix.strip("/") + "/"
    if role == "node":
        if node is None or node_name_problem(node):
            raise ValueError(f"a node's policy needs a valid node name, not {node!r}")
        rules = [f'# consulrun: what node "{node}" needs to run, skip, take over and reap jobs under "{prefix}"',
                 _rule("key_prefix", prefix, "write"),
                 "# sessions and the agent of this node only: no other node's, no other application's elsewhere",
                 _rule("session", node, "write"), _rule("agent", node, "read"),
                 "# the members of the cluster (turns) and this node's checks",
                 _rule("node_prefix", "", "read")]
    elif role == "operator":
        rules = [f'# consulrun: what an operator needs for status, history, logs, unlock, pause, resume, trigger, '
                 f'forget and the exporter under "{prefix}"',
                 _rule("key_prefix", prefix, "write"),
                 "# unlock destroys a holder's session on whichever node it is; status reads every holder's",
                 _rule("session_prefix", "", "write"),
                 "# a holder's checks; trigger names the node it runs on",
                 _rule("node_prefix", "", "read"), _rule("agent_prefix", "", "read")]
    elif role == "all":
        rules = [f'# consulrun: what nodes need to run, take over and report jobs under "{prefix}"',
                 "# (one token for every command on every node; least privilege per role: --node NAME, --operator)",
                 _rule("key_prefix", prefix, "write"), _rule("session_prefix", "", "write"),
                 _rule("agent_prefix", "", "read"), _rule("node_prefix", "", "read")]
    else:
        raise ValueError(f"no such role: {role!r}")
    if service_checks:
        rules.append(_rule("service_prefix", "", "read"))
    if health_checks:
        name = node_name(kv_prefix)
        if role == "node":
            rules += ["# the watchdog judges every holder: it reads sessions on every node (it cannot create or "
                      "destroy them)", _rule("session_prefix", "", "read")]
        rules += [f'# the jobs\' health checks: the external node "{name}" and its service',
                  _rule("node", name, "write"), _rule("service", name, "write")]
    return "\n".join(rules) + "\n"

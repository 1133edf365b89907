"""The run protocol, what makes one node run each occurrence: the session lock (`lock`), the claim
of a scheduled occurrence (`occurrence`), the nodes' turns (`turns`), fencing (`fencing`), the
supervised job process (`runner`, `child`, `procinfo`), job chains (`chain`, `chainwatch`), triggers, pauses and forgetting a job (`forget`), the run's pings and its
health-check write (`notify`, `health`), the ACL rules the protocol needs (`aclpolicy`), and the
deterministic test hooks (`testhook`).

May import: the foundation, `consulrun.consul`, `consulrun.manifest`.
Never click, `report`, `units` or `commands`: this is the hot path of every timer tick.
"""

"""Hook plugins and what they share (QoS model, rules, cgroup/resctrl executor).

Plugins depend on ``runtimeproxy.hookapi`` only, never on the server.
"""

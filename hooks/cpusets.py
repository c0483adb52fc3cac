"""CPU lists for hooks and collectors: re-exported from ``runtimeproxy.cpusets``.

The parser moved to the core because the core validates every hook patch
(``runtimeproxy.chain.validate``) with the same CPU-list rules the hooks apply to
annotations, and the core may not import ``hooks``. One implementation, two names.
"""

from runtimeproxy.cpusets import (
    MAX_CPU_ID,
    ONLINE_FILE,
    CpuListError,
    check_on_node,
    format_cpu_list,
    parse_cpu_list,
    parse_node_cpu_list,
    read_online_cpus,
    read_online_mems,
)

__all__ = [
    "MAX_CPU_ID",
    "ONLINE_FILE",
    "CpuListError",
    "check_on_node",
    "format_cpu_list",
    "parse_cpu_list",
    "parse_node_cpu_list",
    "read_online_cpus",
    "read_online_mems",
]

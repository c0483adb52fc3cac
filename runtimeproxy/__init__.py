"""koord-runtime-proxy: a CRI proxy that runs QoS hooks between kubelet and containerd.

The core (this package) serves kubelet, relays to containerd, keeps the pod store
and runs the hook chain. It never names a concrete hook: plugins live in ``hooks``
(and, for background work, ``metrics``) and are found through entry points.
Hook authors import only ``runtimeproxy.hookapi``.
"""

__version__ = "0.1.0"

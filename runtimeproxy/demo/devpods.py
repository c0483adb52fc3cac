"""Kubelet-like CRI request builders for demos and integration tests.

The shapes mirror what kubelet (kuberuntime) sends, so that the proxy and its
hooks see realistic requests: the ``io.kubernetes.*`` labels, host-network
namespace options (our private containerd has loopback-only CNI), and
cgroupfs-driver cgroup parents.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from criapi import cri_v1_pb2

QoSClass = Literal["guaranteed", "burstable", "besteffort"]

POD_NAME_LABEL = "io.kubernetes.pod.name"
POD_NAMESPACE_LABEL = "io.kubernetes.pod.namespace"
POD_UID_LABEL = "io.kubernetes.pod.uid"
CONTAINER_NAME_LABEL = "io.kubernetes.container.name"


def kube_cgroup_parent(prefix: str, qos: QoSClass, uid: str) -> str:
    """Pod cgroup parent as kubelet names it with the cgroupfs driver.

    Guaranteed pods sit directly under kubepods; the other classes get a QoS
    level in between.  ``prefix`` isolates test runs on a shared host.
    """
    base = prefix.rstrip("/") + "/kubepods"
    if qos == "guaranteed":
        return f"{base}/pod{uid}"
    return f"{base}/{qos}/pod{uid}"


def _host_namespaces() -> cri_v1_pb2.NamespaceOption:
    """Host network, private pid per container, shared pod ipc (kubelet's defaults for hostNetwork)."""
    return cri_v1_pb2.NamespaceOption(
        network=cri_v1_pb2.NODE, pid=cri_v1_pb2.CONTAINER, ipc=cri_v1_pb2.POD
    )


def sandbox_config(
    *,
    name: str,
    namespace: str,
    uid: str,
    cgroup_parent: str,
    log_dir: str,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    attempt: int = 0,
) -> cri_v1_pb2.PodSandboxConfig:
    """PodSandboxConfig for a host-network pod, kubelet style."""
    all_labels = {POD_NAME_LABEL: name, POD_NAMESPACE_LABEL: namespace, POD_UID_LABEL: uid}
    all_labels.update(labels or {})
    return cri_v1_pb2.PodSandboxConfig(
        metadata=cri_v1_pb2.PodSandboxMetadata(name=name, namespace=namespace, uid=uid, attempt=attempt),
        hostname="",
        log_directory=log_dir,
        labels=all_labels,
        annotations=dict(annotations or {}),
        linux=cri_v1_pb2.LinuxPodSandboxConfig(
            cgroup_parent=cgroup_parent,
            security_context=cri_v1_pb2.LinuxSandboxSecurityContext(
                namespace_options=_host_namespaces()
            ),
        ),
    )


def _env(envs: Mapping[str, str] | None) -> list[cri_v1_pb2.KeyValue]:
    """CRI env list; this proto declares KeyValue.value as bytes (wire-equal to string)."""
    return [cri_v1_pb2.KeyValue(key=k, value=v.encode()) for k, v in (envs or {}).items()]


def container_config(
    *,
    name: str,
    image: str,
    command: Sequence[str] = (),
    args: Sequence[str] = (),
    resources: cri_v1_pb2.LinuxContainerResources | None = None,
    envs: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    attempt: int = 0,
) -> cri_v1_pb2.ContainerConfig:
    """ContainerConfig as kubelet builds it (log path ``<name>/<attempt>.log``)."""
    linux = cri_v1_pb2.LinuxContainerConfig(
        security_context=cri_v1_pb2.LinuxContainerSecurityContext(
            namespace_options=_host_namespaces()
        )
    )
    if resources is not None:
        linux.resources.CopyFrom(resources)
    return cri_v1_pb2.ContainerConfig(
        metadata=cri_v1_pb2.ContainerMetadata(name=name, attempt=attempt),
        image=cri_v1_pb2.ImageSpec(image=image),
        command=list(command),
        args=list(args),
        envs=_env(envs),
        labels={CONTAINER_NAME_LABEL: name, **(labels or {})},
        annotations=dict(annotations or {}),
        log_path=f"{name}/{attempt}.log",
        linux=linux,
    )

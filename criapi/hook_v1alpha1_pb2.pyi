from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PodSandboxMetadata(_message.Message):
    __slots__ = ("name", "uid", "namespace", "attempt")
    NAME_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    name: str
    uid: str
    namespace: str
    attempt: int
    def __init__(self, name: _Optional[str] = ..., uid: _Optional[str] = ..., namespace: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class PodSandboxHookRequest(_message.Message):
    __slots__ = ("pod_meta", "runtime_handler", "labels", "annotations", "cgroup_parent", "overhead", "resources")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    POD_META_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_HANDLER_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    CGROUP_PARENT_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    pod_meta: PodSandboxMetadata
    runtime_handler: str
    labels: _containers.ScalarMap[str, str]
    annotations: _containers.ScalarMap[str, str]
    cgroup_parent: str
    overhead: LinuxContainerResources
    resources: LinuxContainerResources
    def __init__(self, pod_meta: _Optional[_Union[PodSandboxMetadata, _Mapping]] = ..., runtime_handler: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., annotations: _Optional[_Mapping[str, str]] = ..., cgroup_parent: _Optional[str] = ..., overhead: _Optional[_Union[LinuxContainerResources, _Mapping]] = ..., resources: _Optional[_Union[LinuxContainerResources, _Mapping]] = ...) -> None: ...

class PodSandboxHookResponse(_message.Message):
    __slots__ = ("labels", "annotations", "cgroup_parent", "resources")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    CGROUP_PARENT_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.ScalarMap[str, str]
    annotations: _containers.ScalarMap[str, str]
    cgroup_parent: str
    resources: LinuxContainerResources
    def __init__(self, labels: _Optional[_Mapping[str, str]] = ..., annotations: _Optional[_Mapping[str, str]] = ..., cgroup_parent: _Optional[str] = ..., resources: _Optional[_Union[LinuxContainerResources, _Mapping]] = ...) -> None: ...

class LinuxContainerResources(_message.Message):
    __slots__ = ("cpu_period", "cpu_quota", "cpu_shares", "memory_limit_in_bytes", "oom_score_adj", "cpuset_cpus", "cpuset_mems", "hugepage_limits", "unified", "memory_swap_limit_in_bytes")
    class UnifiedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CPU_PERIOD_FIELD_NUMBER: _ClassVar[int]
    CPU_QUOTA_FIELD_NUMBER: _ClassVar[int]
    CPU_SHARES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_IN_BYTES_FIELD_NUMBER: _ClassVar[int]
    OOM_SCORE_ADJ_FIELD_NUMBER: _ClassVar[int]
    CPUSET_CPUS_FIELD_NUMBER: _ClassVar[int]
    CPUSET_MEMS_FIELD_NUMBER: _ClassVar[int]
    HUGEPAGE_LIMITS_FIELD_NUMBER: _ClassVar[int]
    UNIFIED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SWAP_LIMIT_IN_BYTES_FIELD_NUMBER: _ClassVar[int]
    cpu_period: int
    cpu_quota: int
    cpu_shares: int
    memory_limit_in_bytes: int
    oom_score_adj: int
    cpuset_cpus: str
    cpuset_mems: str
    hugepage_limits: _containers.RepeatedCompositeFieldContainer[HugepageLimit]
    unified: _containers.ScalarMap[str, str]
    memory_swap_limit_in_bytes: int
    def __init__(self, cpu_period: _Optional[int] = ..., cpu_quota: _Optional[int] = ..., cpu_shares: _Optional[int] = ..., memory_limit_in_bytes: _Optional[int] = ..., oom_score_adj: _Optional[int] = ..., cpuset_cpus: _Optional[str] = ..., cpuset_mems: _Optional[str] = ..., hugepage_limits: _Optional[_Iterable[_Union[HugepageLimit, _Mapping]]] = ..., unified: _Optional[_Mapping[str, str]] = ..., memory_swap_limit_in_bytes: _Optional[int] = ...) -> None: ...

class HugepageLimit(_message.Message):
    __slots__ = ("page_size", "limit")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    page_size: str
    limit: int
    def __init__(self, page_size: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class ContainerMetadata(_message.Message):
    __slots__ = ("name", "attempt", "id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    attempt: int
    id: str
    def __init__(self, name: _Optional[str] = ..., attempt: _Optional[int] = ..., id: _Optional[str] = ...) -> None: ...

class ContainerResourceHookRequest(_message.Message):
    __slots__ = ("pod_meta", "container_meta", "container_annotations", "container_resources", "pod_resources", "pod_annotations", "pod_labels", "pod_cgroup_parent", "container_envs")
    class ContainerAnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class PodAnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class PodLabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class ContainerEnvsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    POD_META_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_META_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_RESOURCES_FIELD_NUMBER: _ClassVar[int]
    POD_RESOURCES_FIELD_NUMBER: _ClassVar[int]
    POD_ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    POD_LABELS_FIELD_NUMBER: _ClassVar[int]
    POD_CGROUP_PARENT_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_ENVS_FIELD_NUMBER: _ClassVar[int]
    pod_meta: PodSandboxMetadata
    container_meta: ContainerMetadata
    container_annotations: _containers.ScalarMap[str, str]
    container_resources: LinuxContainerResources
    pod_resources: LinuxContainerResources
    pod_annotations: _containers.ScalarMap[str, str]
    pod_labels: _containers.ScalarMap[str, str]
    pod_cgroup_parent: str
    container_envs: _containers.ScalarMap[str, str]
    def __init__(self, pod_meta: _Optional[_Union[PodSandboxMetadata, _Mapping]] = ..., container_meta: _Optional[_Union[ContainerMetadata, _Mapping]] = ..., container_annotations: _Optional[_Mapping[str, str]] = ..., container_resources: _Optional[_Union[LinuxContainerResources, _Mapping]] = ..., pod_resources: _Optional[_Union[LinuxContainerResources, _Mapping]] = ..., pod_annotations: _Optional[_Mapping[str, str]] = ..., pod_labels: _Optional[_Mapping[str, str]] = ..., pod_cgroup_parent: _Optional[str] = ..., container_envs: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ContainerResourceHookResponse(_message.Message):
    __slots__ = ("container_annotations", "container_resources", "pod_cgroup_parent", "container_envs")
    class ContainerAnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class ContainerEnvsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CONTAINER_ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_RESOURCES_FIELD_NUMBER: _ClassVar[int]
    POD_CGROUP_PARENT_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_ENVS_FIELD_NUMBER: _ClassVar[int]
    container_annotations: _containers.ScalarMap[str, str]
    container_resources: LinuxContainerResources
    pod_cgroup_parent: str
    container_envs: _containers.ScalarMap[str, str]
    def __init__(self, container_annotations: _Optional[_Mapping[str, str]] = ..., container_resources: _Optional[_Union[LinuxContainerResources, _Mapping]] = ..., pod_cgroup_parent: _Optional[str] = ..., container_envs: _Optional[_Mapping[str, str]] = ...) -> None: ...

"""A minimal hook, to show the hook API (see docs/hooks.md).

It gives containers a fixed ``cpu.shares`` (from ``args.cpu_shares``), or the value
of a pod annotation when the pod carries one. Real QoS hooks follow the same
shape: read the frozen context, validate the input, return a patch with a reason.
"""

from __future__ import annotations

from typing import Final

from runtimeproxy.config.configvalues import reject_unknown
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerPatch,
    HookConfigError,
    HookError,
    HookInit,
    ResourcesPatch,
)

ANNOTATION: Final = "example.koordinator.sh/cpu-shares"
MIN_SHARES: Final = 2
MAX_SHARES: Final = 262144


def _shares(value: object, where: str) -> int:
    try:
        shares = int(str(value))
    except ValueError:
        shares = -1
    if not MIN_SHARES <= shares <= MAX_SHARES:
        raise ValueError(f"{where} must be an integer in [{MIN_SHARES}, {MAX_SHARES}] (got {value!r})")
    return shares


class ExampleCpuShares:
    """Stages: PreCreateContainer and PreUpdateContainerResources."""

    def __init__(self, init: HookInit) -> None:
        reject_unknown(init.args, {"cpu_shares"}, f"{init.key_path}.")
        try:
            self.default = _shares(init.args.get("cpu_shares", 1024), "cpu_shares")
        except ValueError as exc:
            raise HookConfigError(f"{init.key_path}.cpu_shares", init.args.get("cpu_shares"), str(exc)) from exc

    def _patch(self, ctx: ContainerContext) -> ContainerPatch:
        raw = ctx.pod.annotations.get(ANNOTATION)
        if raw is None:
            return ContainerPatch(resources=ResourcesPatch(cpu_shares=self.default), reason="example default")
        try:
            shares = _shares(raw, f"pod annotation {ANNOTATION}")
        except ValueError as exc:
            raise HookError(f"pod {ctx.pod.meta.namespace}/{ctx.pod.meta.name}: {exc}") from exc
        return ContainerPatch(resources=ResourcesPatch(cpu_shares=shares), reason=f"annotation {ANNOTATION}")

    def pre_create_container(self, ctx: ContainerContext) -> ContainerPatch:
        return self._patch(ctx)

    def pre_update_container_resources(self, ctx: ContainerContext) -> ContainerPatch:
        return self._patch(ctx)

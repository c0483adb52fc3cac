"""Benchmark: the shipped chain's Pre hooks called inline, on fresh BE pods with real cgroups.

Run by hand as root: ``.venv/bin/python bench/bench_hooks.py [--pods N] [--profile]``.

For each pod: kubelet's pod cgroup is made under a unique test parent, then every hook of
PreRunPodSandbox and PreCreateContainer of ``systemd/config.yaml``'s chain is called
directly (no thread hand-off, no event loop) on a BE pod with batch resources, as
``bench/bench_proxy.py``'s lifecycle makes it. It prints each hook's median µs per call
(the first 20 pods are warm-up): the hooks' own work. Each pod's cgroup is new, so the
kernel's first touch of its files is in it (most of batch-resource's time). Compare with a
real lifecycle's ``koord_runtime_proxy_hook_duration_seconds`` (docs/benchmarks.md, session
16: 536 µs there for batch-resource's PreRunPodSandbox, ~630 µs here).
``--profile`` adds cProfile's top functions by cumulative time. The cgroups are removed at the end.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import bench_proxy as bp
import yaml

from runtimeproxy.chain import patching, plugins
from runtimeproxy.chain.hookchain import HookPools
from runtimeproxy.config import settings as config
from runtimeproxy.demo import embeddedcgroup
from runtimeproxy.demo.scenario import DEFAULT_CONFIG, kubelet_creates_pod_cgroup
from runtimeproxy.hookapi import ContainerContext, Context, PodContext, Stage

WARMUP = 20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", type=int, default=300)
    ap.add_argument("--profile", action="store_true", help="print cProfile's top 40 functions")
    args = ap.parse_args()
    shipped = yaml.safe_load(DEFAULT_CONFIG.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "config.yaml"
        cfg.write_text(yaml.safe_dump({"hooks": shipped["hooks"], "rules": shipped["rules"],
                                       "hookserver_dir": "", "state_dir": ""}))
        chain = plugins.build_chain(config.load(cfg), pools=HookPools())
    prefix = embeddedcgroup.unique_test_parent()
    profile = cProfile.Profile() if args.profile else None
    seconds: dict[tuple[str, str], list[float]] = {}

    def run(ctx: Context, warm: bool) -> None:
        for hook in chain.for_stage(ctx.stage):
            method = getattr(hook.impl, ctx.stage.method_name)
            if profile is not None and warm:
                profile.enable()
            start = time.perf_counter()
            method(ctx)
            elapsed = time.perf_counter() - start
            if profile is not None and warm:
                profile.disable()
            seconds.setdefault((ctx.stage.value, hook.name), []).append(elapsed)

    try:
        for i in range(args.pods + WARMUP):
            parent, sandbox, container_config = bp.be_pod(prefix, Path("/tmp"))
            kubelet_creates_pod_cgroup(parent)
            pod = patching.pod_info(sandbox, runtime_handler="")
            container = patching.container_info(container_config)
            run(PodContext(Stage.PRE_RUN_POD_SANDBOX, pod), i >= WARMUP)
            run(ContainerContext(Stage.PRE_CREATE_CONTAINER, pod, container), i >= WARMUP)
    finally:
        embeddedcgroup.remove_cgroup_tree(prefix)
    print(f"\n### Pre hooks inline, shipped chain, BE pod with batch resources, {args.pods} pods (median µs)\n")
    print("| stage | hook | µs per call |")
    print("|---|---|---:|")
    for (stage, hook), values in seconds.items():
        print(f"| {stage} | {hook} | {statistics.median(values[WARMUP:]) * 1e6:.0f} |")
    if profile is not None:
        pstats.Stats(profile, stream=sys.stdout).sort_stats("cumulative").print_stats(40)
    return 0


if __name__ == "__main__":
    sys.exit(main())

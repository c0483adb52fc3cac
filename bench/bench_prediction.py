"""Benchmark: the peak predictor's cost at ``--pods`` pods (default 110).

Run by hand (not part of the test suite): ``.venv/bin/python bench/bench_prediction.py``.
Fills a real store (in a temp dir) with one minute of 1 s node and pod samples per step
and runs ``--steps`` training steps (what the agent does once a minute), then writes and
restores the checkpoint. Prints a Markdown table: per step the store read alone
(``aggregate_many`` of the same series: the anchor, measured in the same run), the whole
training step, the Prod estimate, the checkpoint's write/restore time and size, and the
models' Python heap (tracemalloc over a restore: what the restored models keep).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hooks.qos import QoSClass
from metrics.analysis.prediction import PeakPredictor, PodDemand, PredictionSettings, prod_reclaimable
from metrics.model import (
    NO_LABELS,
    NODE_CPU_USAGE,
    NODE_MEMORY_USED,
    POD_CPU_USAGE,
    POD_MEMORY_USED,
    POD_UID,
    PodView,
    Sample,
    labels,
)
from metrics.store.tsdb import TSDB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=110)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    pods = [PodView(uid=f"uid-{i}", namespace="ns", name=f"p{i}", sandbox_id=f"sb{i}", qos=QoSClass.LS,
                    priority=9500, priority_class="koord-prod" if i % 2 else "koord-batch",
                    cgroup_dir=f"kubepods/pod{i}") for i in range(args.pods)]
    t0 = 1_700_000_000.0
    clock = [t0]
    with tempfile.TemporaryDirectory() as tmp:
        db = TSDB(Path(tmp) / "m.db", clock=lambda: clock[0])
        predictor = PeakPredictor(PredictionSettings(), Path(tmp) / "p.json")
        series = [(NODE_CPU_USAGE, NO_LABELS), (NODE_MEMORY_USED, NO_LABELS)]
        series += [(m, labels(**{POD_UID: p.uid})) for p in pods for m in (POD_CPU_USAGE, POD_MEMORY_USED)]
        reads: list[float] = []
        steps: list[float] = []
        estimates: list[float] = []
        demands = [PodDemand(p.uid, p.priority_class, 1.0, 2**30, t0 - 2 * 86400) for p in pods]
        for step in range(1, args.steps + 1):
            end = t0 + 60 * step
            samples: list[Sample] = []
            for k in range(60):
                ts = end - 59.5 + k
                samples += [Sample(NODE_CPU_USAGE, 8.0, (), ts), Sample(NODE_MEMORY_USED, 64 * 2**30, (), ts)]
                for i, p in enumerate(pods):
                    lbl = labels(**{POD_UID: p.uid})
                    samples += [Sample(POD_CPU_USAGE, 0.05 * (i % 7) + 0.01 * (k % 5), lbl, ts),
                                Sample(POD_MEMORY_USED, (100 + i) * 2**20, lbl, ts)]
            clock[0] = end
            db.write(samples, end)
            db.flush()
            started = time.perf_counter()
            db.aggregate_many(series, end - 60, end)
            reads.append(time.perf_counter() - started)
            started = time.perf_counter()
            predictor.train(db, pods, end)
            steps.append(time.perf_counter() - started)
            started = time.perf_counter()
            prod_reclaimable(predictor.prediction, lambda _k: None, demands, (64.0, 256 * 2**30), end,
                             predictor.settings)
            estimates.append(time.perf_counter() - started)
        started = time.perf_counter()
        predictor.save(clock[0])
        save = time.perf_counter() - started
        size = (Path(tmp) / "p.json").stat().st_size
        again = PeakPredictor(PredictionSettings(), Path(tmp) / "p.json")
        started = time.perf_counter()
        again.restore(clock[0])
        restore = time.perf_counter() - started
        # the models' heap: what a restore allocates and keeps
        tracemalloc.start()
        third = PeakPredictor(PredictionSettings(), Path(tmp) / "p.json")
        third.restore(clock[0])
        heap = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        db.close()

    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1000:.1f} (max {max(values) * 1000:.1f})"

    print(f"| {args.pods} pods, {args.steps} steps, {len(predictor.models)} models | ms |")
    print("|---|---|")
    print(f"| store read alone (anchor), median | {ms(reads)} |")
    print(f"| training step (read + histograms + GC), median | {ms(steps)} |")
    print(f"| Prod estimate, median | {ms(estimates)} |")
    print(f"| checkpoint write | {save * 1000:.1f} |")
    print(f"| checkpoint restore | {restore * 1000:.1f} |")
    print(f"| checkpoint size | {size / 1024:.0f} KiB |")
    print(f"| models' heap (after restore) | {heap / 1024:.0f} KiB |")


if __name__ == "__main__":
    main()

"""How the kernel benchmark times a call: device time under CUDA-graph replay, host time per call.

- Device time (CUDA): the calls are captured once into one `torch.cuda.CUDAGraph`
  (`inner` calls, rotating over the input copies), the graph is replayed, and
  CUDA events around each replay give the time per call; the median over
  replays is reported. The host's launch cost is absent by construction, as it
  is when an engine replays its step's graph. Should capture fail (a call that
  synchronises), the figure falls back to events around one call launched
  behind queued GPU work, and the row says so.
- Host time (CUDA): `host_calls` back-to-back calls (300 by default), one
  synchronisation at the end; the figure is the wall time up to the last call's
  return divided by the calls: what the step loop pays on the CPU. When the
  device is slower than the host the launch queue fills and the host waits, so
  for large inputs host time tends to device time.
- A step (the writes row): host wall time of the whole step with one
  synchronisation at its end, median over steps.
- CPU (Triton's interpreter): device and host time are the same wall-clock
  median of single calls.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

_BUSY_CYCLES = 200_000  # ~100 us of GPU sleep queued ahead of a fallback-timed call
_MAX_SETS = 8  # rotated input copies, at most


def median_us(seconds: Sequence[float]) -> float:
    return statistics.median(seconds) * 1e6


@dataclass(frozen=True)
class TimingPlan:
    host_calls: int  # back-to-back calls per host figure
    graph_calls: int  # calls captured in one graph (device figure)
    graph_replays: int  # timed replays of that graph
    steps: int  # timed steps of the writes row


@dataclass
class Timing:
    device_us: float
    host_us: float
    method: str  # "graph", "events" or "wall"


class Timer:
    """Times callables on one device (see the module's docstring)."""

    def __init__(self, device: torch.device, plan: TimingPlan) -> None:
        self.device = device
        self.plan = plan
        self.cuda = device.type == "cuda"
        self.l2_bytes = 0
        if self.cuda:
            props = torch.cuda.get_device_properties(device)
            self.l2_bytes = int(getattr(props, "L2_cache_size", 50 << 20))

    def num_sets(self, set_bytes: int) -> int:
        """Input copies to rotate: enough to pass twice the L2 on CUDA, within `_MAX_SETS`."""
        if not self.cuda:
            return 1
        return max(2, min(_MAX_SETS, math.ceil(2 * self.l2_bytes / max(set_bytes, 1))))

    def time(
        self, calls: Sequence[Callable[[], object]], host: bool = True, graph: bool = True
    ) -> Timing:
        """Device and host time of one call, rotating over `calls` (one per input copy).

        `graph=False` for calls that synchronise: a refused capture can leave the
        CUDA generator's capture state behind, and the next random op then fails."""
        for call in calls:  # compile, fill caches, write every output once
            call()
        if not self.cuda:
            wall = []
            for call in itertools.islice(itertools.cycle(calls), max(self.plan.host_calls, 1)):
                t0 = time.perf_counter()
                call()
                wall.append(time.perf_counter() - t0)
            us = median_us(wall)
            return Timing(us, us, "wall")
        torch.cuda.synchronize(self.device)
        try:
            if not graph:
                raise RuntimeError("not captured: the call synchronises")
            device_us, method = self._graph_us(calls), "graph"
        except Exception:  # noqa: BLE001 - capture is refused by calls that synchronise
            torch.cuda.synchronize(self.device)
            device_us, method = self._events_us(calls), "events"
        host_us = self._host_us(calls) if host else math.nan
        return Timing(device_us, host_us, method)

    def _graph_us(self, calls: Sequence[Callable[[], object]]) -> float:
        inner = self.plan.graph_calls
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up on the side stream, as capture requires
            for call in calls:
                call()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for call in itertools.islice(itertools.cycle(calls), inner):
                call()
        graph.replay()
        torch.cuda.synchronize(self.device)
        times = []
        for _ in range(self.plan.graph_replays):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3 / inner)
        del graph
        return median_us(times)

    def _events_us(self, calls: Sequence[Callable[[], object]]) -> float:
        sleep = getattr(torch.cuda, "_sleep", None)
        times = []
        for call in itertools.islice(itertools.cycle(calls), self.plan.graph_replays * 4):
            if sleep is not None:
                sleep(_BUSY_CYCLES)
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        return median_us(times)

    def _host_us(self, calls: Sequence[Callable[[], object]]) -> float:
        n = self.plan.host_calls
        sequence = list(itertools.islice(itertools.cycle(calls), n))
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        for call in sequence:
            call()
        t1 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        return (t1 - t0) / n * 1e6

    def steps(
        self,
        stage: Callable[[int], None],
        apply: Callable[[], None],
        num_calls: int,
    ) -> dict[str, float]:
        """Medians per step of host wall times: staging (per call), apply, and the whole step.

        `stage(i)` makes `num_calls` calls; the step ends with one synchronisation.
        """
        warm = 2
        staging, applying, whole = [], [], []
        sync = torch.cuda.synchronize if self.cuda else (lambda _device: None)
        for i in range(warm + self.plan.steps):
            sync(self.device)
            t0 = time.perf_counter()
            stage(i)
            t1 = time.perf_counter()
            apply()
            sync(self.device)
            t3 = time.perf_counter()
            if i >= warm:
                staging.append((t1 - t0) / max(num_calls, 1))
                applying.append(t3 - t1)
                whole.append(t3 - t0)
        return {
            "call_us": median_us(staging),
            "apply_us": median_us(applying),
            "step_us": median_us(whole),
        }

"""A timeline of every rank: compute phases and collectives, written as one Chrome / Perfetto trace.

    tracer = Tracer(rank)                       # one per rank; hand it to the Comms (comm.tracer = tracer)
    with tracer.span("backward", "compute"):    # a compute phase
        ...
    tracer.write(world, "trace.json")           # collective: rank 0 writes the file for all ranks

Open the file at ui.perfetto.dev or chrome://tracing. Each rank is a process with three tracks: "compute"
(forward, backward, optimizer, ...), "comm" (every blocking collective, with its communicator and payload bytes
in its arguments) and "async" (non-blocking calls such as Iallreduce, each from its start to its Wait, so that
their overlap with the compute track is visible; several may be in flight at once). Times are microseconds
since a Barrier that all ranks pass at the start (the ranks of one machine share a clock; across machines the
alignment is as good as that Barrier).
"""
import json
import time
from contextlib import contextmanager, nullcontext

TRACKS = {"compute": 0, "comm": 1, "async": 2}


class NullTracer:
    """A stand-in tracer that records nothing (what the trainer holds without --trace or --plot)."""

    def span(self, *args, **kwargs):
        return nullcontext()


class Tracer:
    def __init__(self, rank, world=None, enabled=True):
        self.rank = rank
        self.enabled = enabled
        self.events = []                     # (name, track, start s, end s, args)
        if world is not None:
            world.Barrier()                  # a common time origin for all ranks
        self.t0 = time.perf_counter()

    def add(self, name, track, start, end, **args):
        if self.enabled:
            self.events.append((name, track, start - self.t0, end - self.t0, args))

    @contextmanager
    def span(self, name, track="compute", **args):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, track, start, time.perf_counter(), **args)

    def clear(self):
        self.events.clear()

    def chrome_events(self):
        """This rank's events in the Chrome trace-event format (complete events, 'X')."""
        out = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
        out += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": track}}
                for track, tid in TRACKS.items()]
        for name, track, start, end, args in self.events:
            out.append({"name": name, "cat": track, "ph": "X", "pid": self.rank, "tid": TRACKS[track],
                        "ts": round(start * 1e6, 3), "dur": round((end - start) * 1e6, 3), "args": args})
        return out

    def write(self, world, path):
        """Collective: gather every rank's events to rank 0, which writes `path`. Returns the events on rank 0."""
        everyone = world.gather(self.chrome_events(), root=0)
        if world.Get_rank() != 0:
            return None
        events = [e for rank_events in everyone for e in rank_events]
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        return events


def spans_of(events, rank, track):
    """(name, start s, end s) of one rank's track, from Chrome events (for plots and tests)."""
    tid = TRACKS[track]
    return [(e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in events
            if e.get("ph") == "X" and e["pid"] == rank and e["tid"] == tid]


def _union(intervals):
    """Merge (start, end) intervals into disjoint ones."""
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


WAITING = ("dp sync", "straggler delay")                   # compute-track spans that are not computation


def overlap_seconds(events, rank, comm_names=("Iallreduce",)):
    """Seconds during which at least one of the rank's non-blocking collectives was in flight while the rank was
    computing (forward, backward, optimizer, pipeline actions; not while it waited in "dp sync", and not counting
    the enclosing "step N" spans)."""
    compute = _union([(s, e) for name, s, e in spans_of(events, rank, "compute")
                      if name not in WAITING and not name.startswith("step ")])
    flight = _union([(s, e) for name, s, e in spans_of(events, rank, "async") if name in comm_names])
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in flight for c, d in compute)

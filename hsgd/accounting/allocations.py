"""Memory per category over one training step, measured by a real allocation tracker (hsgd.train --memory).

On the CPU NumPy reports every array's data buffer to Python's `tracemalloc`, in a domain of its own
(np.lib.tracemalloc_domain), with the stack that allocated it. A traced allocation belongs to a category
decided by that stack: walk its frames from the innermost outward; the first frame that lies in a function of
CATEGORY_TABLE decides (an entry may also name a word the allocating line must contain, where one function
allocates two kinds of buffer). Frames carry only a file and a line, so each hsgd module is parsed once with
`ast` to find the innermost function around a line. What no entry claims is "other" (it should be ~0).

    params       the exchange's parameter buffer (ZeRO: its chunks), ZeRO-3's gathered groups, and in bfloat16 and
                 float16 the model's rounded copy of the weights (hsgd.model.precision.Numerics.weights)
    grads        the gradient buffers (ZeRO: chunks and per-group buckets), the sequence scheme's partial
                 gradients of the replicated parameters
    optimizer    the optimizer's state (hsgd.model.optim) and its per-element masks (weight decay, tensor-sharded)
    activations  what a forward pass keeps (allocated under Stage.forward), and the backward pass's working arrays
                 under Stage.backward. The gradients of activations are not a category of their own: at the
                 moments sampled (between gradient groups) the only one alive is the dL/dx handed from group to
                 group, one (B, T~, C) array; the large ones (dlogits, dqkv, the attention's dS) live and die
                 inside a group and show only in the tracker's true peak
    comm         receive buffers (Stage.recv_activation), the exchanges' own send / receive buffers, staging
    recompute    what --recompute computes again in the backward pass (recompute_block, recompute_attention)

A `MemoryProbe` samples at every gradient group's forward exit, backward exit and "recomputed" point (its
`hooks`, an hsgd.tp.hooks.Hooks, are chained after the exchange's by HybridTrainer.hooks), and at the step's start and
end: bytes per category, a time, a label ("F0 h.1", "B0 head", "B0 h.1 recomputed"). Between two samples it
also reads tracemalloc's true peak, so that the transient working memory (the true peak minus the largest
sample) shows too. tracemalloc's counts include Python's own objects; they are taken as constant between two
samples and subtracted (the arrays are MBs, the objects KBs).

On a GPU (CuPy) there are no stacks: the probe reads the memory pool's used bytes at the same moments, one number
("device") per sample, which the report puts next to the formula's total.

Tracing costs time: hsgd.train starts it before the trainer is built (so that the parameters and the optimizer
state, allocated once, are traced), samples one step and stops. The measured step runs unthreaded (a
ThreadedStage gives hooks the plain Stage.run) and traced.
"""
import ast
import bisect
import functools
import linecache
import os
import time
import tracemalloc
from contextlib import contextmanager

import numpy as np

from hsgd.tp.hooks import Hooks

CATEGORIES = ("params", "grads", "optimizer", "activations", "comm", "recompute", "other")
NFRAMES = 14              # frames kept per allocation: the deciding frame is at most the 5th from the allocation in
                          # the runs measured (every scheme and recompute, ZeRO-3); a miss would show as "other"

# (module, function, word or None, category): the first entry matching a frame decides; frames are tried from the
# innermost outward. function "*": any function of the module; word: the allocating line must contain it.
CATEGORY_TABLE = [
    ("dp/exchange.py", "AllreduceExchange.new_buffer", None, "grads"),   # buf, the stale exchange's spares
    ("dp/exchange.py", "AllreduceExchange.__init__", None, "params"),    # pbuf
    ("dp/exchange.py", "AllreduceExchange.mask", None, "optimizer"),
    ("dp/average.py", "FlatBuffer.mask", None, "optimizer"),            # per-element weight-decay / sharded flags
    ("dp/zero1.py", "Zero1Exchange.__init__", "p_send", "comm"),        # the Allgather's send buffer
    ("dp/zero1.py", "Zero1Exchange.__init__", None, "grads"),           # g_chunk
    ("dp/hierarchical.py", "hier_buffers", None, "comm"),
    ("dp/zero3.py", "Zero3Exchange.gather_group", None, "params"),
    ("dp/sharded.py", "ShardedExchange.grad_bucket", None, "grads"),
    ("dp/sharded.py", "ShardedExchange.start_reduce_scatter", None, "comm"),
    ("dp/sharded.py", "ShardedExchange.mask", None, "optimizer"),
    ("dp/sharded.py", "ShardedExchange.__init__", "g_owned", "grads"),
    ("dp/sharded.py", "ShardedExchange.__init__", None, "params"),     # master_ (stage 2: whole too)
    ("model/precision.py", "Numerics.weights", None, "params"),        # bfloat16 / float16: the model's rounded copy
    ("tp/schemes.py", "Sequence.replicated_grads", None, "grads"),
    ("model/optim.py", "*", None, "optimizer"),
    ("tp/model.py", "TPSetup.rope", None, "other"),                   # the rotary tables, kept for the run
    ("tp/model.py", "recompute_block", None, "recompute"),
    ("tp/model.py", "recompute_attention", None, "recompute"),
    ("pp/stage.py", "Stage.recv_activation", None, "comm"),
    ("grid/comm.py", "*", None, "comm"),
    ("pp/stage.py", "Stage.forward", None, "activations"),
    ("pp/stage.py", "Stage.backward", None, "activations"),
]
HSGD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))      # the hsgd package


# ------------------------------------------------------------------------------------------------ attribution

class FunctionMap:
    """(file, line) -> the qualified name of the innermost function around it ("Stage.forward", "rows" nested in
    layernorm_forward is "layernorm_forward.rows"), for the files of the hsgd package; None elsewhere."""

    def module(self, path):
        """The module's path inside hsgd ("pp/stage.py"), or None for a file outside the package."""
        rel = os.path.relpath(os.path.abspath(path), HSGD_DIR)
        return None if rel.startswith("..") else rel.replace(os.sep, "/")

    def function(self, path, line):
        starts, spans = function_spans(path)
        best = None
        for start, end, name in spans[:bisect.bisect_right(starts, line)]:
            if start <= line <= end:
                best = name                    # later starts lie inside earlier ones: the innermost wins
        return best


@functools.lru_cache(maxsize=None)
def function_spans(path):
    """(sorted starts, [(start, end, qualname)]) of the functions of a source file, parsed once per process (the
    source of a running program does not change; every probe of a test run shares them)."""
    spans = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    spans.append((child.lineno, child.end_lineno, name))
                walk(child, name + ".")
            elif isinstance(child, ast.stmt):                 # functions live only under statements
                walk(child, prefix)
    with open(path) as f:
        walk(ast.parse(f.read()), "")
    spans.sort()
    return [start for start, _, _ in spans], spans


class Attributor:
    """The category of a traced allocation from its stack (CATEGORY_TABLE), cached per stack."""

    def __init__(self, table=CATEGORY_TABLE):
        self.table, self.map, self.cache = table, FunctionMap(), {}

    def frame_category(self, path, line):
        module = self.map.module(path)
        if module is None:
            return None
        func = None
        for mod, fn, word, cat in self.table:
            if mod != module:
                continue
            func = func or self.map.function(path, line)
            if (fn == "*" or fn == func) and (word is None or word in linecache.getline(path, line)):
                return cat
        return None

    def category(self, frames):
        """frames: ((file, line), ...) of one allocation, the innermost first (tracemalloc's raw order)."""
        if frames not in self.cache:
            found = "other"
            for path, line in frames:
                cat = self.frame_category(path, line)
                if cat is not None:
                    found = cat
                    break
            self.cache[frames] = found
        return self.cache[frames]


# ------------------------------------------------------------------------------------------------ the probe

class ProbeHooks(Hooks):
    """Samples on leaving each group's forward and backward, and at hooks.point (inside a block's backward)."""

    def __init__(self, probe):
        self.probe = probe

    @contextmanager
    def forward(self, group):
        yield
        self.probe.sample(f"F{self.probe.n_forward} {group}")
        if group == self.probe.last_forward_group:
            self.probe.n_forward += 1

    @contextmanager
    def backward(self, group):
        yield
        self.probe.sample(f"B{self.probe.n_backward} {group}")
        if group == self.probe.last_backward_group:
            self.probe.n_backward += 1

    def point(self, group, what):
        self.probe.sample(f"B{self.probe.n_backward} {group} {what}")


class MemoryProbe:
    """Bytes per category over one step. start() before the trainer exists; begin_step(groups) with the stage's
    gradient groups {group: [names]} in backward order, then the step with `hooks`; end_step(); result()."""

    def __init__(self, device="cpu"):
        self.gpu = device not in ("cpu", None)
        self.attributor = Attributor()
        self.hooks = ProbeHooks(self)
        self.samples = []                     # [(label, seconds since begin_step, {category: bytes}, true peak)]
        self.n_forward = self.n_backward = 0
        self.last_forward_group = self.last_backward_group = None
        self.python_bytes, self.t0 = 0, 0.0

    def start(self):
        if not self.gpu and not tracemalloc.is_tracing():
            for module in {m for m, *_ in CATEGORY_TABLE}:            # the map of hsgd's functions (ast), built
                function_spans(os.path.join(HSGD_DIR, module))      # untraced: under tracing it is ~10x slower
            tracemalloc.start(NFRAMES)

    def stop(self):
        if not self.gpu and tracemalloc.is_tracing():
            tracemalloc.stop()

    def begin_step(self, groups):
        order = list(groups)                                           # backward order: head ... embedding
        self.last_forward_group, self.last_backward_group = order[0], order[-1]
        self.samples, self.n_forward, self.n_backward = [], 0, 0
        self.measure()                                                 # the peak from here on
        self.t0 = time.perf_counter()
        self.sample("start")

    def end_step(self):
        self.sample("end")

    def measure(self):
        """({category: bytes} now, the true peak of array bytes since the last call)."""
        if self.gpu:
            import cupy
            used = int(cupy.get_default_memory_pool().used_bytes())
            return {"device": used}, used
        current, peak = tracemalloc.get_traced_memory()                # all domains: arrays and Python objects
        snap, numpy_domain = tracemalloc.take_snapshot(), np.lib.tracemalloc_domain
        cats = dict.fromkeys(CATEGORIES, 0)
        # the snapshot's raw traces (domain, size, frames innermost first, total frames), as Snapshot.filter_traces
        # reads them: the public Trace objects cost ~15 us each, and Python's own objects are most of the traces
        category = self.attributor.category
        for trace in snap.traces._traces:
            if trace[0] == numpy_domain:
                cats[category(trace[2])] += trace[1]
        true_peak = peak - self.python_bytes                           # objects taken as constant since the last
        self.python_bytes = current - sum(cats.values())
        del snap
        tracemalloc.reset_peak()                                       # (after the snapshot's own objects are gone)
        return cats, max(true_peak, sum(cats.values()))

    def sample(self, label):
        cats, true_peak = self.measure()
        self.samples.append((label, time.perf_counter() - self.t0, cats, true_peak))

    def result(self):
        """{"peak": {category: the largest sample}, "total": the largest sample's sum, "true_peak": the tracker's,
        "at": the largest sample's label, "samples": [(label, t, {category: bytes})]}."""
        cats = list(self.samples[0][2])
        totals = [sum(c.values()) for _, _, c, _ in self.samples]
        top = max(range(len(totals)), key=totals.__getitem__)
        return {"peak": {c: max(s[2][c] for s in self.samples) for c in cats}, "total": totals[top],
                "true_peak": max(s[3] for s in self.samples), "at": self.samples[top][0],
                "samples": [(label, t, c) for label, t, c, _ in self.samples]}


def measure_step(build, batch_of, device="cpu"):
    """(the probe's result, the trainer) of step 2 of the trainer that build() makes, traced from before it exists
    (its parameters, and after step 1 its optimizer state, are traced). batch_of(step) -> (idx, targets)."""
    probe = MemoryProbe(device)
    probe.start()
    try:
        trainer = build()
        trainer.step(*batch_of(1), 1)
        batch = batch_of(2)                                            # made before the step: not part of it
        traced_step(trainer, probe, lambda: trainer.step(*batch, 2))
    finally:
        probe.stop()
    return probe.result(), trainer


def traced_step(trainer, probe, run_step):
    """run_step() (one training step of `trainer`) with the probe's hooks in the trainer's chain; returns what it
    returns. The probe samples at the start, at every group's exits and points, and after the update."""
    probe.begin_step(trainer.stage.groups())
    trainer.probe = probe
    try:
        out = run_step()
    finally:
        trainer.probe = None
    probe.end_step()
    return out

"""The schedules whose stages hold two chunks each, placed in a V or from both ends (hsgd.pp.placement), as lists of
actions (hsgd.pp.schedules: F, B, W and the overlapped Pair F&B):

    zb-v       ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6): the V placement, every backward
               split into B and W; on stage s, 2(p-s)-1 forwards of chunk 0, then s pairs F chunk 1, F chunk 0,
               then p-s times F B W of chunk 1, then the steady state F B W of chunk 0 and of chunk 1 in turn, then
               the backwards of both chunks and the W's left. With F = B = W its stages hold 1F1B's activations
               (2p chunk pairs, p micro-batches of a whole stage on stage 0) and it leaves no bubble but the fill and
               drain of the V. m >= 1; where m < 2p-1 the pattern's micro-batches past m are left out.
    dualpipev  DualPipeV (the V-shaped half of DualPipe; DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", and the
               deepseek-ai/DualPipe repository): the V placement, the steady state of overlapped pairs, a forward of
               one chunk with the (whole) backward of the other; B and W split at the fill and the drain. m >= 2p.
    dualpipe   DualPipe: the dual placement, half the micro-batches from each end; stage s runs DualPipeV's list for
               its position h = min(s, p-1-s) in a pipeline of p/2 stages and m/2 micro-batches, its "chunk 0" the
               direction in which it comes first (down for s < p/2, up after), its "chunk 1" the other one. Every
               stage holds the parameters of two pieces, each piece being on two stages: the gradients of the two
               copies are summed after the backward passes (hsgd.pp.dual). p even, m even, m >= 2p.

DualPipeV's and DualPipe's steps for stage (or half-position) r of p stages and m micro-batches, in DeepSeek's
order (f0, f1: the next forward of chunk 0, 1; b: the next backward, "zb" split, its W queued; w: the oldest
queued W; f&b: an overlapped pair):
    1  2(p-r-1) x f0                  2  (r+1) x (f0 f1)              3  (p-r-1) x (b1 zb, w, f1)
    4  m-2p+r+1 x (f0&b1, f1&b0)  (on the last stage the first f0, b1 apart)
    5  (p-r-1) x (b1, f1&b0)          6  (r+1) x (b1 b0), split from the middle one on
    7  (p-r-1) x (w, b0 zb)           8  (r+1) x w
A pair F&B (hsgd.pp.actions.Pair) receives both inputs, runs its F, then its B, and sends each output as soon as it
is made: hsgd schedules the pair as one unit, as DualPipe does, but on a CPU rank the two run one after the other.
What DeepSeek gains from it (one micro-batch's all-to-all and pipeline messages hidden behind the other's
computation, on separate GPU streams) is the simulator's F&B cost (costs[3]), not something hsgd's ranks obtain.
Idle time per stage (DeepSeek-V3's Table 2, B being a whole backward, F&B an overlapped pair; equal for every
stage's timeline when the simulator runs it, tests/test_vshape.py): 1F1B (p-1)(F+B); ZB1P (zb-h1) (p-1)(F+B-2W);
DualPipe (p/2-1)(F&B+B-3W).
"""
from collections import deque

from hsgd.errors import ConfigError
from hsgd.pp.actions import Action, Pair


def zb_v(m, p, s):
    """Stage s's ZB-V list (the module docstring): the pattern for n = max(m, 2p-1) micro-batches, without those
    past m."""
    n, out, cnt = max(m, 2 * p - 1), [], {}

    def act(kind, c):
        j = cnt.get((kind, c), 0)
        cnt[kind, c] = j + 1
        if j < m:
            out.append(Action(kind, j, c))

    for _ in range(2 * (p - s) - 1):
        act("F", 0)
    for _ in range(s):
        act("F", 1), act("F", 0)
    for _ in range(p - s):
        act("F", 1), act("B", 1), act("W", 1)
    while cnt.get(("F", 1), 0) < cnt[("F", 0)] or cnt[("F", 0)] < n:
        if cnt[("F", 0)] < n:
            act("F", 0)
        act("B", 0), act("W", 0), act("F", 1), act("B", 1), act("W", 1)
    for _ in range(s):
        act("B", 0), act("B", 1)
    for _ in range(p - s):
        act("B", 0), act("W", 0)
    for c in (1, 0):
        while cnt.get(("W", c), 0) < n:
            act("W", c)
    return out


def dual_steps(m, p, r):
    """DualPipeV's steps for stage r of p and m micro-batches (the module docstring), as ("f", c), ("b", c, split),
    ("w",) and ("f&b", c_forward, c_backward) in order."""
    ops = [("f", 0)] * (2 * (p - r - 1)) + [("f", 0), ("f", 1)] * (r + 1)
    ops += [("b", 1, True), ("w",), ("f", 1)] * (p - r - 1)
    for i in range(m - 2 * p + r + 1):
        ops += [("f", 0), ("b", 1, False)] if i == 0 and r == p - 1 else [("f&b", 0, 1)]
        ops += [("f&b", 1, 0)]
    ops += [("b", 1, False), ("f&b", 1, 0)] * (p - r - 1)
    split = False
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        ops.append(("b", 1, split))
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        ops.append(("b", 0, split))
    return ops + [("w",), ("b", 0, True)] * (p - r - 1) + [("w",)] * (r + 1)


def from_steps(ops, chunk=(0, 1), first=(0, 0)):
    """The Actions of dual_steps's ops: phase c is chunk chunk[c], its micro-batches counted from first[c]; W's in
    the order of their split B's."""
    nxt, queue, out = {}, deque(), []

    def take(kind, c):
        j = nxt.get((kind, c), first[c])
        nxt[kind, c] = j + 1
        return Action(kind, j, chunk[c])

    for op in ops:
        if op[0] == "f":
            out.append(take("F", op[1]))
        elif op[0] == "b":
            out.append(take("B", op[1]))
            if op[2]:
                queue.append(Action("W", out[-1].mb, out[-1].chunk))
        elif op[0] == "w":
            out.append(queue.popleft())
        else:
            out.append(Pair(take("F", op[1]), take("B", op[2])))
    return out


def dualpipe_v(m, p, s):
    """Stage s's DualPipeV list."""
    return from_steps(dual_steps(m, p, s))


def dualpipe(m, p, s):
    """Stage s's DualPipe list: DualPipeV's for its position h = min(s, p-1-s) of p/2 stages and m/2 micro-
    batches; phase 0 is chunk 0 (micro-batches 0 .. m/2-1, going down) on the upper half of the stages, chunk 1
    (m/2 .. m-1, going up) on the lower half, phase 1 the other."""
    h, half = min(s, p - 1 - s), m // 2
    down = s < p // 2
    return from_steps(dual_steps(half, p // 2, h), chunk=(0, 1) if down else (1, 0),
                      first=(0, half) if down else (half, 0))


def check_counts(kind, m, p):
    """Raise ConfigError where `kind`'s pattern does not exist for m micro-batches on p stages."""
    if kind == "dualpipe" and p % 2:
        raise ConfigError(f"schedule='dualpipe' sends half the micro-batches down and half up the stages, the two "
                          f"halves meeting in the middle: pp={p} must be even, e.g. {p - 1 or 2} or {p + 1}")
    need = 2 * p
    if kind in ("dualpipe", "dualpipev") and (m < need or (kind == "dualpipe" and m % 2)):
        even = " (an even number: half from each end)" if kind == "dualpipe" else ""
        raise ConfigError(f"schedule={kind!r} fills its steady state of overlapped pairs with at least 2 pp = {need} "
                          f"micro-batches{even}; micro_batches={m} is too few, use --micro-batches {need} or more")


def build(kind, m, p, v=2):
    """[[Action or Pair] per stage] of `kind` (zb-v, dualpipev, dualpipe), m micro-batches, p stages of 2 chunks."""
    if v != 2:
        raise ConfigError(f"schedule={kind!r} places 2 chunks on every stage; virtual_stages={v} does not fit, use "
                          "--virtual-stages 2 (or leave it out)")
    check_counts(kind, m, p)
    make = {"zb-v": zb_v, "dualpipev": dualpipe_v, "dualpipe": dualpipe}[kind]
    return [make(m, p, s) for s in range(p)]

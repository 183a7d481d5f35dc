"""The actions of a pipeline schedule (hsgd.pp.schedules, hsgd.pp.vshape): what one stage runs, in order.

    Action(kind, mb, chunk)   F, B or W of micro-batch mb through the stage's model chunk `chunk`
    Pair(f, b)                an F and a B of two micro-batches run as one (DualPipe's overlapped F&B)
"""
from collections import namedtuple


class Action(namedtuple("Action", "kind mb chunk")):
    """One step of a stage (what F, B and W do: hsgd.pp.schedules). str: F3, B3, W3 (chunk 0), F3.1 (chunk 1)."""
    __slots__ = ()

    def __new__(cls, kind, mb, chunk=0):
        return super().__new__(cls, kind, mb, chunk)

    def __str__(self):
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


class Pair(namedtuple("Pair", "f b")):
    """A forward and a backward of two different micro-batches run as one action (DualPipe's overlapped F&B,
    DeepSeek-AI 2024): both inputs are received before it starts. The static check and the simulator send both
    outputs when it ends; hsgd.pp.stage sends the F's as soon as it is made (earlier: nothing can wait longer). In
    the simulation it costs the pair's own time (costs[3]: less than the two apart where one's communication hides
    behind the other's computation). str: F5&B2.1."""
    __slots__ = ()
    kind = "F&B"

    def __str__(self):
        return f"{self.f}&{self.b}"


def flat(actions):
    """One stage's list with every Pair as its F and its B, in that order."""
    return [x for a in actions for x in ((a.f, a.b) if isinstance(a, Pair) else (a,))]

"""Which pipeline stage holds each piece of the model: a schedule's placement, as data.

The layers are cut into p v pieces, k = 0 .. p v - 1 (hsgd.pp.chunks.chunk_layers); piece 0 holds the embedding,
piece p v - 1 the final norm, the LM head and the loss. Each of the p stages holds v of them, its chunks c = 0 ..
v - 1. Two placements:

    loop   chunk c of stage s is piece k = c p + s: a micro-batch goes stage 0, 1, .., p-1, then back to stage 0
           for chunk 1 (the plain pipeline, v = 1, and Megatron-LM's interleaved schedule; Narayanan et al. 2021)
    v      v = 2, chunk 0 of stage s is piece s and chunk 1 is piece 2p - 1 - s: down the stages and back up, so
           stage p-1 holds pieces p-1 and p and hands the activation to itself, and stage 0 holds the first and the
           last piece, the loss among them (ZB-V: Qi et al. 2024, "Pipeline Parallelism with Controllable Memory";
           DualPipeV, the V-shaped half of DeepSeek-AI 2024's DualPipe)

A piece hands its activation to piece k + 1 and receives its gradient from there; when both pieces are on one
stage the hand-off is a local copy, not a message (Stage.forward and Stage.backward, and pp_formula's count).

    pl = placement("loop", p, v)       pl.piece(s, c) -> k      pl.holder(k) -> (s, c)     pl.stage(k) -> s
"""
from hsgd.errors import ConfigError

SHAPES = ("loop", "v")


class Placement:
    """Piece k of the model on (stage, chunk) as `shape` places it (the module docstring); p stages, v chunks each."""

    def __init__(self, shape, p, v):
        if shape not in SHAPES:
            raise ConfigError(f"placement {shape!r} is not known; use one of {', '.join(SHAPES)}")
        if shape == "v" and v != 2:
            raise ConfigError(f"the V placement puts 2 chunks on every stage (down and back up), not {v}; use "
                              "virtual_stages 2")
        self.shape, self.p, self.v, self.K = shape, p, v, p * v
        self.where = [None] * self.K                          # piece k -> (stage, chunk)
        for s in range(p):
            for c in range(v):
                self.where[self.piece(s, c)] = (s, c)

    def piece(self, s, c):
        """The piece chunk c of stage s holds."""
        if self.shape == "v":
            return s if c == 0 else 2 * self.p - 1 - s
        return c * self.p + s

    def holder(self, k):
        """(stage, chunk) of piece k."""
        return self.where[k]

    def stage(self, k):
        """The stage that holds piece k."""
        return self.where[k][0]

    def local_handoffs(self, s):
        """How many of stage s's pieces hand their activation to a piece of the same stage (k and k + 1 both on
        s): 0 in a loop of p > 1 stages, 1 on the V's last stage."""
        return sum(1 for k in range(self.K - 1) if self.stage(k) == s == self.stage(k + 1))

    def __eq__(self, other):
        return isinstance(other, Placement) and (self.shape, self.p, self.v) == (other.shape, other.p, other.v)

    def __repr__(self):
        return f"placement({self.shape!r}, {self.p}, {self.v})"


def placement(shape, p, v=1):
    """The Placement of `shape` ("loop" or "v") for p stages of v chunks each."""
    return Placement(shape, p, v)

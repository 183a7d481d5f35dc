"""The crosscheck dump: one training step of any system, in a neutral format (hsgd/crosscheck/FORMAT.md).

    DIR/layout.json        the model (its sizes, family and experts), what every tensor is (its global shape, its
                           mapping to the reference's parameters: a name, a transpose, a fused q|k|v or gate|up) and
                           where its gradient's pieces are (per rank: axis, offset, length, padding; several ranks
                           with one slice are replicas; a tensor may live on some ranks only: a stage's, an expert's)
    DIR/params.npz         the whole parameters before the step, as the system stores them
    DIR/batch.npz          idx, targets (B, T): the step's global batch
    DIR/grads-rank{r}.npz  rank r's gradient pieces
    DIR/dump.json          written last: the run and every file's size and sha256 (hsgd.crosscheck.manifest)

Here: what a dump is once read (Dump, its Tensors and their Shards); `Tensor.to_reference` / `from_reference` map a
stored tensor to the reference parameters it holds and back. Reading and checking a folder: hsgd.crosscheck.read
(`load(DIR)`, DumpError for anything that does not fit); writing one: hsgd.crosscheck.write.
"""
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from hsgd.model.config import FAMILY, ModelConfig, SIZES
from hsgd.errors import UsageError

FORMAT, VERSION = "hsgd-crosscheck", 1
DTYPES = ("float64", "float32", "bfloat16", "float16")
PARALLEL = ("dp", "tp", "pp", "cp", "micro_batches", "ep")
MODEL_KEYS = SIZES                       # layout.json's "model": these it must give,
FAMILY_KEYS = ("arch",) + FAMILY         # and these it may (absent: the arch's preset; no arch: gpt2, format 1's model)
MOE_KEYS = ("moe_top_k", "moe_gates", "moe_capacity_factor", "moe_balance", "moe_balance_domain",
            "moe_balance_layers", "moe_z_loss", "moe_bias_rate")     # and, with experts, these (absent: the default)
INTERLEAVES = ("block", "head", "groups")


class DumpError(UsageError):
    """A dump that cannot be checked: a missing or unreadable file, a layout that does not describe the arrays."""


def integer(value, what, low=0):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise DumpError(f"layout.json: {what} = {value!r} must be an integer >= {low}")
    return value


def grads_file(r):
    return f"grads-rank{r}.npz"


# ------------------------------------------------------------------------------------------------ sizes

@lru_cache(maxsize=4)
def reference_shapes(cfg):
    """cfg.param_shapes(), made once per model: a dump's tensors are checked against it one by one, and building it
    afresh for each would cost layers x tensors (read-only: do not change the dict)."""
    return cfg.param_shapes()


def check_sizes(ranks, parallel):
    """DumpError unless the ranks and the parallel sizes of layout.json are ones a job can have (at most MAX_RANKS),
    checked before a list of ranks is made or a file per rank is looked for."""
    from hsgd.step.settings import MAX_RANKS
    for what, n in [("ranks", ranks)] + [(f"parallel.{k}", v) for k, v in parallel.items()]:
        if n > MAX_RANKS:
            raise DumpError(f"layout.json: {what} = {n} is more than a job has (at most {MAX_RANKS}); a dump "
                            f"describes one step of a real run")


def reference_bytes(cfg, batch_shape=None):
    """Bytes the float64 reference run (hsgd.model.serial) needs at least: the parameters and their gradients, and
    with the batch's (B, T) what its forward keeps per token: each block's normalized inputs, q, k, v, the attention's
    output and probabilities, the MLP's hidden layers (6 C + 2 K + 2 F, or 3 F with SwiGLU, + NH T; K = NKV hs), and
    the logits and their probabilities (2 V)."""
    need = 2 * cfg.n_params() * 8
    if batch_shape is not None:
        B, T = batch_shape
        C, F, K = cfg.d_model, cfg.d_ff, cfg.kv_width
        hidden = (2 if cfg.mlp == "gelu" else 3) * F
        need += B * T * 8 * (cfg.n_layers * (6 * C + 2 * K + hidden + cfg.n_heads * T) + 2 * cfg.vocab_size)
    return need


def check_reference_fits(cfg, batch_shape=None, memory=None):
    """DumpError when the reference run of this model (and batch) could not fit in this machine's memory (`memory`
    bytes, default what it has available: hsgd.run.preflight.available_memory()): checked from layout.json before
    params.npz is read, and from batch.npz's shape before the reference runs."""
    from hsgd.run.preflight import available_memory
    memory = available_memory() if memory is None else memory
    need = reference_bytes(cfg, batch_shape)
    if memory and need > memory:
        what = "model" if batch_shape is None else f"model and batch (B, T) = {tuple(batch_shape)}"
        raise DumpError(f"the dump's {what} need at least {need / 2**30:.4g} GiB for hsgd's float64 reference, more "
                        f"than this machine's {memory / 2**30:.4g} GiB; crosscheck a smaller model or batch")


# ------------------------------------------------------------------------------------------------ a tensor

@dataclass
class Shard:
    """One rank's piece of a tensor's gradient: a box of the full tensor, cut along the axes of `slices` (none: the
    whole tensor; two: FSDP x TP, dimension 0 over data-parallel ranks and another over tensor-parallel ones). Along
    each cut axis the rank's array holds `length` real entries, then `padding` entries that stand for none."""
    rank: int
    slices: tuple         # ((axis, offset, length, padding), ...), by axis; (): the whole tensor
    key: str

    @property
    def axis(self):
        """The axis of a shard cut along one (None: whole; a shard cut along two has no one axis)."""
        return self.slices[0][0] if len(self.slices) == 1 else None

    @property
    def offset(self):
        return self.slices[0][1] if len(self.slices) == 1 else 0

    @property
    def length(self):
        return self.slices[0][2] if len(self.slices) == 1 else 0

    @property
    def padding(self):
        """Padding entries along any cut axis (0: none)."""
        return max((p for *_, p in self.slices), default=0)

    def box(self):
        """((axis, offset, length), ...): the part of the full tensor it holds, the same for its replicas."""
        return tuple((a, o, n) for a, o, n, _ in self.slices)

    def where(self, ndim):
        """The index of this shard's real entries in the full tensor."""
        index = [slice(None)] * ndim
        for a, o, n, _ in self.slices:
            index[a] = slice(o, o + n)
        return tuple(index)

    def stored_shape(self, shape):
        """The shape of the rank's array: the tensor's, each cut axis length + padding long."""
        out = list(shape)
        for a, _, n, p in self.slices:
            out[a] = n + p
        return tuple(out)

    def split(self, a):
        """(real entries, padding entries flattened) of the rank's array a: along each cut axis in turn, the entries
        past `length` (of the rows still real along the axes before) are padding."""
        pads = []
        for ax, _, n, _ in self.slices:
            lead = (slice(None),) * ax
            pads.append(a[lead + (slice(n, None),)].ravel())
            a = a[lead + (slice(0, n),)]
        return a, (np.concatenate(pads) if pads else a.ravel()[:0])


@dataclass
class Tensor:
    name: str
    shape: tuple
    transposed: bool
    parts: list           # the reference parameters it holds (one, or the fused ones)
    fuse_axis: int
    interleave: str       # "block", "head" or "groups" (fused only)
    group: int            # "head": entries per piece (hs)
    shards: list
    lengths: tuple = ()   # each part's length along the fused axis (fused only)
    groups: int = 0       # "groups": pieces per part
    rotary: int = 0       # layout.json's "rotary": "interleaved": the head size hs (q's and k's output features
    #                       in rotary-pair order within each head); 0: the reference's order ("halves")

    def n_pieces(self):
        """How many pieces each part is cut into along the fused axis: 1 ("block"), its length / group ("head"),
        groups ("groups")."""
        if self.interleave == "head":
            return self.lengths[0] // self.group
        return self.groups if self.interleave == "groups" else 1

    def part_shapes(self, ref_shapes):
        """Each part's shape as stored (transposed where the tensor is)."""
        return [tuple(reversed(ref_shapes[p])) if self.transposed else tuple(ref_shapes[p]) for p in self.parts]

    def stored_shape(self, ref_shapes):
        """The full stored shape its reference parameters give."""
        shapes = self.part_shapes(ref_shapes)
        if len(self.parts) == 1:
            return shapes[0]
        out = list(shapes[0])
        out[self.fuse_axis] = sum(s[self.fuse_axis] for s in shapes)
        return tuple(out)

    def to_reference(self, x):
        """{reference name: array in the reference's orientation} from the stored full tensor x. A fused tensor is,
        along its axis, n pieces of (a piece of each part in turn): [p0_0 p1_0 p2_0 | p0_1 p1_1 p2_1 | ...], part j's
        pieces lengths[j] / n long (n = n_pieces(): 1 is [p0 | p1 | p2])."""
        if len(self.parts) == 1:
            pieces = [x]
        else:
            moved = np.moveaxis(x, self.fuse_axis, 0)                      # (fused axis, the rest)
            n, rest = self.n_pieces(), moved.shape[1:]
            widths = [L // n for L in self.lengths]                        # one piece of each part
            cut = moved.reshape((n, sum(widths)) + rest)                   # (n, sum widths, ...)
            within = np.split(cut, np.cumsum(widths[:-1]), axis=1)         # part j: (n, widths[j], ...)
            pieces = [np.moveaxis(c.reshape((n * w,) + rest), 0, self.fuse_axis) for c, w in zip(within, widths)]
        out = {p: (a.T if self.transposed else a) for p, a in zip(self.parts, pieces)}
        return {p: a[..., self.pair_order(p, a.shape[-1])] for p, a in out.items()}

    def pair_order(self, part, width):
        """The index that puts part's output features (its last axis in the reference's orientation) in the
        reference's order. The reference turns the rotary pairs (i, i + hs/2) of a head (Hugging Face's halves); a
        system that turns the adjacent pairs (2i, 2i + 1) (torchtitan's llama3, Meta's original Llama code) stores
        q's and k's features so ("rotary": "interleaved"): its feature h hs + 2i + j is the reference's
        h hs + j hs/2 + i (hs = self.rotary). slice(None) for every other part or layout."""
        if not self.rotary or not any(f".attn.{m}." in part for m in "qk"):
            return slice(None)
        hs = self.rotary
        h, j, i = np.meshgrid(np.arange(width // hs), np.arange(2), np.arange(hs // 2), indexing="ij")
        order = np.empty(width, np.int64)
        order[(h * hs + j * (hs // 2) + i).ravel()] = (h * hs + 2 * i + j).ravel()
        return order

    def from_reference(self, ref):
        """The stored full tensor from the reference's arrays {name: array} (the inverse of to_reference)."""
        undo = {p: np.argsort(o) for p in self.parts if not isinstance(o := self.pair_order(p, ref[p].shape[-1]),
                                                                         slice)}
        ref = {p: ref[p][..., undo[p]] if p in undo else ref[p] for p in self.parts}
        pieces = [ref[p].T if self.transposed else ref[p] for p in self.parts]
        if len(pieces) == 1:
            return np.ascontiguousarray(pieces[0])
        moved = [np.moveaxis(p, self.fuse_axis, 0) for p in pieces]
        n, rest = self.n_pieces(), moved[0].shape[1:]
        cut = [m.reshape((n, m.shape[0] // n) + rest) for m in moved]     # part j: (n, widths[j], ...)
        out = np.concatenate(cut, axis=1).reshape((-1,) + rest)
        return np.ascontiguousarray(np.moveaxis(out, 0, self.fuse_axis))


@dataclass
class Dump:
    path: str
    meta: dict
    cfg: ModelConfig
    dtype: str
    loss: float
    ranks: int
    parallel: dict
    tensors: dict         # {name: Tensor}
    params: dict          # {tensor name: stored full array}
    idx: np.ndarray
    targets: np.ndarray
    grads: list           # [{key: array}] per rank
    biases: dict = None   # {"h.{i}.moe": (E,) selection bias} of the step (auxiliary-loss-free balancing), or None

    def reference_params(self):
        """{reference name: float64 array}: the parameters before the step, as hsgd.model.serial names them."""
        out = {}
        for t in self.tensors.values():
            for name, a in t.to_reference(self.params[t.name].astype(np.float64)).items():
                out[name] = np.ascontiguousarray(a)
        return out

"""The model's shape (ModelConfig), and `flag`: how a field of a settings dataclass becomes a command-line flag.

`ModelConfig` fixes the GPT-2-style model that every hsgd implementation (serial, tensor-, data- and
pipeline-parallel) computes. Validation errors name the field, the value and what would work.

A field made with `flag(default, help_text, ...)` is also a command-line flag (and a TOML key): its metadata holds the
help text and argparse's keywords, from which hsgd.step.settings builds the parsers, so a default and its help are
written once.

Legend used across hsgd: B batch, T sequence length, C d_model, NH heads, hs = C/NH head size,
F d_ff, V vocabulary size, L layers.
"""
from dataclasses import dataclass, field, fields

from hsgd.errors import ConfigError


def divisors(n):
    """The divisors of n, ascending (for error messages that say what would work). Trial division up to sqrt(n):
    each d <= sqrt(n) that divides n brings its partner n // d, so n = 10^12 costs 10^6 steps, not 10^12."""
    small, large, d = [], [], 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


# The largest model hsgd takes, whatever it is for (training, the planner, a checkpoint, a dump): every size is
# checked against these before a loop or an array depends on it (n_layers is walked one block at a time; a width is
# an array's side). The planner prices far bigger models than a machine could train: Narayanan et al. (2021)'s
# largest has L=128, C=25600, F=102400, V=51200, T=2048. Training checks what a rank would hold against the
# machine's memory as well (hsgd.run.preflight.check_memory).
MAX_SIZES = {"vocab_size": 2**20, "seq_len": 2**20, "d_model": 2**20, "n_heads": 2**20, "n_layers": 4096,
             "d_ff": 2**22}


def check_at_most(name, value, limit, what_works):
    """Raise ConfigError unless value <= limit (a stated maximum, checked before any work depends on the value)."""
    if value > limit:
        raise ConfigError(f"{name}={value} is more than hsgd takes (at most {limit}); {what_works}")


def check_positive_int(name, value):
    """Raise ConfigError unless `value` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer (1, 2, 3, ...)")


def check_nonnegative_int(name, value):
    """Raise ConfigError unless `value` is an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name}={value!r} must be an integer >= 0")


def flag(default, help_text, shown=None, **argparse_keywords):
    """A dataclass field that is also the flag --field-name: help_text and the default (or `shown`, a description
    of it) make its help text; argparse_keywords (metavar, choices, ...) go to ArgumentParser.add_argument."""
    return field(default=default, metadata=dict(help=help_text, shown=shown, **argparse_keywords))


def flag_names(config_class):
    """The fields of a config dataclass that are flags, in order."""
    return tuple(f.name for f in fields(config_class) if "help" in f.metadata)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256  # V: tokens are bytes (not a flag)
    seq_len: int = flag(64, "T: context length in bytes, also the rows of the position table wpe (at most "
                            f"{MAX_SIZES['seq_len']})")
    d_model: int = flag(128, f"C: width of the residual stream (at most {MAX_SIZES['d_model']})")
    n_heads: int = flag(4, "NH: attention heads; they divide d_model (head size hs = C / NH) and tp divides them")
    n_layers: int = flag(4, f"L: Transformer blocks (at most {MAX_SIZES['n_layers']})")
    d_ff: int = flag(512, "F: hidden width of the MLP, divisible by tp; GPT-2 uses 4 * C (at most "
                          f"{MAX_SIZES['d_ff']})")

    def __post_init__(self):
        for f in fields(self):
            check_positive_int(f.name, getattr(self, f.name))
            check_at_most(f.name, getattr(self, f.name), MAX_SIZES[f.name],
                          f"give {f.name} from 1 to {MAX_SIZES[f.name]}")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                f"n_heads must divide d_model, e.g. one of {divisors(self.d_model)[:12]}")

    def param_shapes(self):
        """Every parameter's name and shape, in the canonical order. Weights are stored (in, out): y = x @ W + b."""
        V, T, C, F = self.vocab_size, self.seq_len, self.d_model, self.d_ff
        shapes = {"wte": (V, C), "wpe": (T, C)}
        for i in range(self.n_layers):
            h = f"h.{i}."
            shapes[h + "ln1.weight"] = (C,)
            shapes[h + "ln1.bias"] = (C,)
            for m in ("q", "k", "v"):
                shapes[h + f"attn.{m}.weight"] = (C, C)
                shapes[h + f"attn.{m}.bias"] = (C,)
            shapes[h + "attn.proj.weight"] = (C, C)
            shapes[h + "attn.proj.bias"] = (C,)
            shapes[h + "ln2.weight"] = (C,)
            shapes[h + "ln2.bias"] = (C,)
            shapes[h + "mlp.fc.weight"] = (C, F)
            shapes[h + "mlp.fc.bias"] = (F,)
            shapes[h + "mlp.proj.weight"] = (F, C)
            shapes[h + "mlp.proj.bias"] = (C,)
        shapes["ln_f.weight"] = (C,)
        shapes["ln_f.bias"] = (C,)
        shapes["lm_head.weight"] = (C, V)
        return shapes

    def n_params(self):
        total = 0
        for shape in self.param_shapes().values():
            n = 1
            for s in shape:
                n *= s
            total += n
        return total

    def step_flops(self, batch_size, recompute="none"):
        """Floating-point operations of one training step (forward + backward) on B sequences of length T
        (gpt_step_flops of this model's sizes; recompute: what --recompute runs again)."""
        return gpt_step_flops(batch_size, self.seq_len, self.d_model, self.d_ff, self.vocab_size, self.n_layers,
                              recompute)


def gpt_step_flops(B, T, C, F, V, L, recompute="none"):
    """Matmul FLOPs of one training step on B sequences of T tokens (2 flops per multiply-add), backward = 2 x
    forward; plain arithmetic, so that it also takes symbols (tests/test_plan.py checks it with sympy):
      per layer, per token: q, k, v, proj (4 C^2) and fc, proj (2 C F)  -> 6 * (4C^2 + 2CF)
      attention, per layer, per sequence: q k^T and att v, full T x T (the causal half is computed too)
                                                                         -> 3 * 2 * 2 * T^2 * C
      LM head, per token: 6 * C * V
    --recompute full runs every block's forward again (+ 2 (4C^2 + 2CF) per token and 4 T^2 C per sequence and
    layer); selective runs the attention's again (+ 4 T^2 C). With F = 4C and full recomputation this is Narayanan
    et al. (2021)'s 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) (s = T, h = C, l = L)."""
    tokens = B * T
    per_layer = 6 * tokens * (4 * C * C + 2 * C * F) + 12 * B * T * T * C
    again = {"none": 0, "selective": 4 * B * T * T * C,
             "full": 2 * tokens * (4 * C * C + 2 * C * F) + 4 * B * T * T * C}[recompute]
    return L * (per_layer + again) + 6 * tokens * C * V

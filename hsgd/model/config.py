"""The model's shape (ModelConfig), and `flag`: how a field of a settings dataclass becomes a command-line flag.

`ModelConfig` fixes the model that every hsgd implementation (serial, tensor-, data- and pipeline-parallel)
computes: its sizes and its family (GPT-2's block, Llama's, or a mix of their fields; ARCHS). Validation errors name
the field, the value and what would work.

A field made with `flag(default, help_text, ...)` is also a command-line flag (and a TOML key): its metadata holds the
help text and argparse's keywords, from which hsgd.step.settings builds the parsers, so a default and its help are
written once.

Legend used across hsgd: B batch, T sequence length, C d_model, NH heads, hs = C/NH head size, NKV key/value heads,
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


# The model families: a preset for each field of the block's family that --arch sets, and the flags that override
# one field at a time. gpt2 is today's model (Radford et al. 2019): LayerNorm with biases, learned positions, GELU MLP,
# every head its own keys and values, biases on the linears, an untied LM head. llama is the block of Touvron et al.
# (2023) and Dubey et al. (2024): RMSNorm, rotary positions (Su et al. 2021), SwiGLU (Shazeer 2020), grouped-query
# attention (Ainslie et al. 2023; here two query heads per key/value head), no biases, untied.
ARCHS = {
    "gpt2": dict(norm="layernorm", positions="learned", rope_theta=10000.0, mlp="gelu", n_kv_heads=None, bias=True,
                 tied=False),
    "llama": dict(norm="rmsnorm", positions="rope", rope_theta=10000.0, mlp="swiglu", n_kv_heads="half", bias=False,
                  tied=False),
}
FAMILY = ("norm", "positions", "rope_theta", "mlp", "n_kv_heads", "bias", "tied", "moe_experts", "moe_every")
SIZES = ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "d_ff")


@dataclass(frozen=True)
class ModelConfig:
    """The model's sizes and family. arch fills the family fields that are None (not given); a field given wins. A
    built ModelConfig holds every field resolved, so dataclasses.replace(cfg, arch="llama") keeps cfg's family:
    build a new one, ModelConfig(arch="llama", <sizes>), to change families."""
    vocab_size: int = 256  # V: tokens are bytes (not a flag)
    seq_len: int = flag(64, "T: context length in bytes, also the rows of the position table wpe (at most "
                            f"{MAX_SIZES['seq_len']})")
    d_model: int = flag(128, f"C: width of the residual stream (at most {MAX_SIZES['d_model']})")
    n_heads: int = flag(4, "NH: attention heads; they divide d_model (head size hs = C / NH) and tp divides them")
    n_layers: int = flag(4, f"L: Transformer blocks (at most {MAX_SIZES['n_layers']})")
    d_ff: int = flag(512, "F: hidden width of the MLP, divisible by tp; GPT-2 uses 4 * C (at most "
                          f"{MAX_SIZES['d_ff']})")
    arch: str = flag("gpt2", "the model family, a preset of the seven flags below (each flag overrides its field):\n"
                             "gpt2: layernorm, learned positions, gelu, n_kv_heads = n_heads, biases, untied;\n"
                             "llama: rmsnorm, rope, swiglu, n_kv_heads = n_heads/2 (n_heads when odd), no biases, "
                             "untied", choices=tuple(ARCHS))
    norm: str = flag(None, "normalization: layernorm (weight and bias) or rmsnorm (weight only)", shown="--arch's",
                     choices=("layernorm", "rmsnorm"))
    positions: str = flag(None, "learned (a table wpe added to the embedding) or rope (q and k rotated by their "
                                "position; no wpe)", shown="--arch's", choices=("learned", "rope"))
    rope_theta: float = flag(None, "RoPE's base: pair i of a head turns by position * theta^(-2i/hs)",
                             shown="--arch's: 10000")
    mlp: str = flag(None, "gelu (fc, GELU, proj) or swiglu (SiLU(x W_gate) * (x W_up), then proj)",
                    shown="--arch's", choices=("gelu", "swiglu"))
    n_kv_heads: int = flag(None, "NKV: key/value heads, each shared by n_heads/NKV query heads (= n_heads: "
                                 "multi-head; 1: multi-query)", shown="--arch's")
    bias: bool = flag(None, "biases on the linears (q, k, v, the projections, fc or gate and up)", shown="--arch's")
    tied: bool = flag(None, "the LM head is the token embedding transposed (no lm_head.weight)", shown="--arch's")
    # mixture of experts (hsgd.model.moe, the layer; hsgd.model.balance, its auxiliary losses over their domain)
    moe_experts: int = flag(0, "E: experts in place of the MLP of every MoE block (their MLP: --mlp, their biases: "
                               "--bias); 0: dense blocks only")
    moe_top_k: int = flag(2, "k: the experts each token is sent to, 1 <= k <= moe_experts")
    moe_every: int = flag(1, "the MoE blocks: 0, n, 2n, ... (1: every block; Megatron-LM's --moe-layer-freq)")
    moe_gates: str = flag("renormalized", "how the k chosen scores become gates\n"
                          "renormalized: softmax over the experts, the k chosen rescaled to sum 1 (Mixtral; GShard's "
                          "top-2)\nprobabilities: the softmax probabilities as they are (Switch, k = 1)\n"
                          "sigmoid: sigmoid scores, the k chosen rescaled to sum 1 (DeepSeek-V3)",
                          choices=("renormalized", "probabilities", "sigmoid"))
    moe_capacity_factor: float = flag(None, "c: each expert takes ceil(c N k / E) of the N rows a rank routes at "
                                            "once (a micro-batch's rows on one rank); slots beyond are dropped in "
                                            "token order", shown="none: nothing dropped")
    moe_balance: float = flag(0.01, "alpha of the load-balancing loss alpha E sum_i f_i P_i (Switch: 0.01; "
                                    "uniform routing gives alpha); 0: none")
    moe_balance_domain: str = flag("micro-batch", "the tokens f and P are counted over\n"
                                   "micro-batch: the sequences one pipeline pass of a DP group carries (what the "
                                   "loss changes with when micro-batches change)\n"
                                   "sequence: each sequence alone (DeepSeek-V3's sequence-wise loss)\n"
                                   "global: the whole global batch (one micro-batch per step)",
                                   choices=("micro-batch", "sequence", "global"))
    moe_balance_layers: str = flag("each", "each: every MoE block has its own loss, summed (Switch, Megatron-LM); "
                                           "pooled: one f and one P over the rows of all MoE blocks (Hugging Face's "
                                           "Mixtral)", choices=("each", "pooled"))
    moe_z_loss: float = flag(0.0, "beta of the router z-loss beta mean(logsumexp(logits)^2) (ST-MoE: 0.001)")
    moe_bias_rate: float = flag(0.0, "gamma of auxiliary-loss-free balancing: after each step every expert's "
                                     "selection bias moves by gamma toward the mean load (DeepSeek-V3: 0.001); "
                                     "0: off")

    def __post_init__(self):
        for name in SIZES:
            check_positive_int(name, getattr(self, name))
            check_at_most(name, getattr(self, name), MAX_SIZES[name], f"give {name} from 1 to {MAX_SIZES[name]}")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                f"n_heads must divide d_model, e.g. one of {divisors(self.d_model)[:12]}")
        if self.arch not in ARCHS:
            raise ConfigError(f"arch={self.arch!r} is not a model family hsgd has; use one of {list(ARCHS)}")
        for name, value in ARCHS[self.arch].items():             # the preset fills what was not given
            if getattr(self, name) is None:
                if name == "n_kv_heads":
                    value = self.n_heads // 2 if value == "half" and self.n_heads % 2 == 0 else self.n_heads
                object.__setattr__(self, name, value)
        for name, choices in (("norm", ("layernorm", "rmsnorm")), ("positions", ("learned", "rope")),
                              ("mlp", ("gelu", "swiglu"))):
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name}={getattr(self, name)!r} is not one hsgd has; use one of {list(choices)}")
        for name in ("bias", "tied"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be true or false")
        check_positive_int("n_kv_heads", self.n_kv_heads)
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}: each "
                              f"key/value head serves n_heads/n_kv_heads query heads; use n_kv_heads in "
                              f"{divisors(self.n_heads)[:12]}")
        theta = self.rope_theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 1.0 < theta < 1e12:
            raise ConfigError(f"rope_theta={theta!r} must be a number above 1 and below 1e12 (10000 in Llama 2, 500000 "
                              f"in Llama 3)")
        object.__setattr__(self, "rope_theta", float(theta))
        if self.positions == "rope" and self.head_size % 2:
            raise ConfigError(f"head size d_model/n_heads = {self.d_model}/{self.n_heads} = {self.head_size} is odd: "
                              f"rotary positions turn a head's dimensions in pairs; use an even head size (e.g. "
                              f"n_heads in {[h for h in divisors(self.d_model) if (self.d_model // h) % 2 == 0][:8]})"
                              f" or --positions learned")
        self.check_moe()

    def check_moe(self):
        """The mixture-of-experts fields: one line each that says what would work."""
        check_nonnegative_int("moe_experts", self.moe_experts)
        check_at_most("moe_experts", self.moe_experts, 4096, "give moe_experts from 0 (dense) to 4096")
        check_positive_int("moe_every", self.moe_every)
        check_positive_int("moe_top_k", self.moe_top_k)
        if self.moe_experts and self.moe_top_k > self.moe_experts:
            raise ConfigError(f"moe_top_k={self.moe_top_k} is above moe_experts={self.moe_experts}: a token picks k of "
                              f"the E experts; use moe_top_k from 1 to {self.moe_experts}")
        c = self.moe_capacity_factor
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < 1e6):
            raise ConfigError(f"moe_capacity_factor={c!r} must be a number above 0 (1.0: an even share each; 1.25 "
                              f"is common), or not given: nothing dropped")
        for name in ("moe_balance", "moe_z_loss", "moe_bias_rate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e6:
                raise ConfigError(f"{name}={v!r} must be a number >= 0 (0: off)")
        for name, choices in (("moe_gates", ("renormalized", "probabilities", "sigmoid")),
                              ("moe_balance_domain", ("micro-batch", "sequence", "global")),
                              ("moe_balance_layers", ("each", "pooled"))):
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name}={getattr(self, name)!r} is not one hsgd has; use one of {list(choices)}")

    def is_moe(self, i):
        """Whether block i has experts in place of its MLP (blocks 0, n, 2n, ... with moe_every n)."""
        return self.moe_experts > 0 and i % self.moe_every == 0

    def moe_layers(self):
        """The MoE blocks, ascending."""
        return [i for i in range(self.n_layers) if self.is_moe(i)]

    def moe_settings(self):
        """The layer's MoESettings (hsgd.model.moe), or None for a dense model."""
        if not self.moe_experts:
            return None
        from hsgd.model.moe import MoESettings
        return MoESettings(experts=self.moe_experts, top_k=self.moe_top_k, mlp=self.mlp, gates=self.moe_gates,
                           capacity_factor=self.moe_capacity_factor, balance_coef=self.moe_balance,
                           z_coef=self.moe_z_loss)

    @property
    def head_size(self):
        """hs = C / NH."""
        return self.d_model // self.n_heads

    @property
    def kv_width(self):
        """The columns of k and v: NKV * hs (= C with multi-head attention)."""
        return self.n_kv_heads * self.head_size

    def describe_family(self):
        """The family in words, e.g. 'llama: rmsnorm, rope (theta 500000), swiglu, NKV=8, no biases, untied' (and
        ', 8 experts top-2 in every block' with experts)."""
        pos = f"rope (theta {self.rope_theta:g})" if self.positions == "rope" else "learned positions"
        moe = ""
        if self.moe_experts:
            where = "every block" if self.moe_every == 1 else f"blocks 0, {self.moe_every}, ..."
            moe = f", {self.moe_experts} experts top-{self.moe_top_k} in {where}"
        return (f"{self.arch}: {self.norm}, {pos}, {self.mlp}, NKV={self.n_kv_heads}, "
                f"{'biases' if self.bias else 'no biases'}, {'tied' if self.tied else 'untied'}{moe}")

    def family(self):
        """The fields that make the block what it is (hsgd.checkpoint refuses a resume into another family)."""
        return {name: getattr(self, name) for name in FAMILY}

    def param_shapes(self):
        """Every parameter's name and shape, in the canonical order. Weights are stored (in, out): y = x @ W + b.
        The family decides which exist: wpe with learned positions; LayerNorm biases with layernorm; the linears'
        biases with bias; mlp.fc with gelu, mlp.gate and mlp.up with swiglu; lm_head.weight unless tied. k and v
        have NKV * hs columns. A MoE block (is_moe) has h.{i}.moe.router.weight (C, E) and each expert's MLP,
        h.{i}.moe.experts.{e}.fc|gate|up|proj.*, in place of h.{i}.mlp.* (hsgd.model.moe.moe_param_shapes)."""
        V, T, C, F, K = self.vocab_size, self.seq_len, self.d_model, self.d_ff, self.kv_width
        shapes = {"wte": (V, C)}
        if self.positions == "learned":
            shapes["wpe"] = (T, C)
        norm_bias, bias = self.norm == "layernorm", self.bias

        def norm(prefix):
            shapes[prefix + ".weight"] = (C,)
            if norm_bias:
                shapes[prefix + ".bias"] = (C,)

        def linear(prefix, cin, cout):
            shapes[prefix + ".weight"] = (cin, cout)
            if bias:
                shapes[prefix + ".bias"] = (cout,)

        for i in range(self.n_layers):
            h = f"h.{i}."
            norm(h + "ln1")
            for m, width in (("q", C), ("k", K), ("v", K)):
                linear(h + f"attn.{m}", C, width)
            linear(h + "attn.proj", C, C)
            norm(h + "ln2")
            if self.is_moe(i):                                     # the router and E experts in place of mlp.*
                from hsgd.model.moe import moe_param_shapes
                shapes.update(moe_param_shapes(h + "moe", C, F, self.moe_experts, self.mlp, bias))
                continue
            for m in (("fc",) if self.mlp == "gelu" else ("gate", "up")):
                linear(h + f"mlp.{m}", C, F)
            linear(h + "mlp.proj", F, C)
        norm("ln_f")
        if not self.tied:
            shapes["lm_head.weight"] = (C, V)
        return shapes

    def n_params(self):
        return sum(self.param_counts().values())

    def n_active_params(self):
        """The parameters one token's forward reads: n_params less the (E - k) experts it skips in each MoE block."""
        if not self.moe_experts:
            return self.n_params()
        first = f"h.{self.moe_layers()[0]}.moe.experts.0."
        per_expert = sum(n for name, n in self.param_counts().items() if name.startswith(first))
        return self.n_params() - len(self.moe_layers()) * (self.moe_experts - self.moe_top_k) * per_expert

    def param_counts(self):
        """{name: elements} of every parameter."""
        out = {}
        for name, shape in self.param_shapes().items():
            n = 1
            for s in shape:
                n *= s
            out[name] = n
        return out

    def step_flops(self, batch_size, recompute="none"):
        """Floating-point operations of one training step (forward + backward) on B sequences of length T
        (gpt_step_flops of this model's sizes and family; recompute: what --recompute runs again). A MoE block's
        MLP term is its k active experts' (each token runs k expert MLPs) plus the router's 6 C E per token, the
        dispatch's copies not counted; capacity drops are not subtracted."""
        mats = 2 if self.mlp == "gelu" else 3
        total = gpt_step_flops(batch_size, self.seq_len, self.d_model, self.d_ff, self.vocab_size, self.n_layers,
                               recompute, K=self.kv_width, mlp_mats=mats)
        n_moe, tokens = len(self.moe_layers()), batch_size * self.seq_len
        if n_moe:                                                  # (k - 1) more MLPs per token, and the router
            again = 2 if recompute == "full" else 0
            total += n_moe * (6 + again) * tokens * ((self.moe_top_k - 1) * mats * self.d_model * self.d_ff
                                                     + self.d_model * self.moe_experts)
        return total


def gpt_step_flops(B, T, C, F, V, L, recompute="none", K=None, mlp_mats=2):
    """Matmul FLOPs of one training step on B sequences of T tokens (2 flops per multiply-add), backward = 2 x
    forward; plain arithmetic, so that it also takes symbols (tests/test_plan.py checks it with sympy):
      per layer, per token: q, proj (2 C^2), k, v (2 C K, K = NKV hs = C without grouped-query attention) and the
      MLP's mlp_mats C x F matrices (2: fc, proj; 3 with SwiGLU: gate, up, proj)   -> 6 * (2C^2 + 2CK + m CF)
      attention, per layer, per sequence: q k^T and att v, full T x T (the causal half is computed too)
                                                                         -> 3 * 2 * 2 * T^2 * C
      LM head, per token: 6 * C * V
    --recompute full runs every block's forward again (+ 2 (2C^2 + 2CK + m CF) per token and 4 T^2 C per sequence
    and layer); selective runs the attention's again (+ 4 T^2 C). With K = C, m = 2, F = 4C and full recomputation
    this is Narayanan et al. (2021)'s 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) (s = T, h = C, l = L)."""
    K = C if K is None else K
    tokens = B * T
    dense = 2 * C * C + 2 * C * K + mlp_mats * C * F
    per_layer = 6 * tokens * dense + 12 * B * T * T * C
    again = {"none": 0, "selective": 4 * B * T * T * C,
             "full": 2 * tokens * dense + 4 * B * T * T * C}[recompute]
    return L * (per_layer + again) + 6 * tokens * C * V

# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 1: serial SGD, and a Transformer's backward pass by hand
#
# hsgd implements a lecture, *Parallel SGD in parallel and distributed systems: the algorithm that combines model
# parallelism and data parallelism* (summarized in `tutorials/00_the_lecture.md`, with the chapter that carries out
# each step), cited from here on as "the lecture". Everything later in hsgd is checked against one program, the
# serial model in `hsgd/model/serial.py`; this chapter checks that program: mini-batch SGD as the lecture writes it,
# the backward pass of a GPT-style block derived layer by layer, finite-difference checks in float64, and a short
# training run.
#
# Run it as a script (about 5 s on a quiet 2-core machine; it exits non-zero if any check fails), or as a notebook
# (`jupytext --to ipynb`). It draws two pictures into `$HSGD_FIGURES` (default `tutorials/figures/`):
#
#     python tutorials/01_serial_sgd.py
#
# Legend: B batch, T sequence, C d_model, NH heads, hs = C/NH head size, F d_ff, V vocabulary, N = B*T rows.

# %%
import inspect

from hsgd.model.config import ModelConfig   # hsgd before NumPy: it sets OpenBLAS's thread timeout first
from hsgd.model import gradcheck, layers, serial
from hsgd.model.gradcheck import FLOOR, H, fd_error
from hsgd.model.optim import SGD
from hsgd.train import train
from hsgd.step.settings import TrainConfig

import numpy as np
from threadpoolctl import threadpool_limits

import pictures                      # tutorials/pictures.py: where the PNGs go
from checks import Checks            # tutorials/checks.py: the check every chapter uses

threadpool_limits(1)                 # tiny matrices: extra BLAS threads only add overhead
rng = np.random.default_rng(0)
TOL = 1e-6                           # every finite-difference check must come out below this
check = Checks(tol=TOL, width=38)    # check(what, err, tol): print err, record it, stop unless err < tol

# A tiny float64 model for all the checks. The parameters get noise on top of init_params, so that
# LayerNorm weights are not all 1 and biases not all 0 (a backward that forgot a "* w" would pass at w = 1).
cfg = ModelConfig(vocab_size=11, seq_len=6, d_model=8, n_heads=2, n_layers=2, d_ff=16)
params = serial.init_params(cfg, seed=0, dtype="float64")
for p in params.values():
    p += rng.normal(0.0, 0.1, p.shape)
print(f"tiny model: {cfg.n_params()} parameters in {len(params)} arrays")

# %% [markdown]
# ## 1. SGD and mini-batch SGD
#
# The lecture's section 1 starts from serial SGD: for one example $(x_i, y_i)$ and learning rate $\eta$,
#
# $$w \leftarrow w - \eta\, \nabla L(f(x_i; w), y_i),$$
#
# and in practice the steadier mean over a mini-batch of $B$ examples,
#
# $$w \leftarrow w - \eta\, \frac{1}{B} \sum_{j=1}^{B} \nabla L(f(x_j; w), y_j).$$
#
# In hsgd an example is a sequence of T bytes, and the loss is the next-byte cross-entropy averaged over all
# N = B*T positions. Every sequence has T positions, so
#
# $$\text{loss} = \frac{1}{BT}\sum_{j=1}^{B}\sum_{t=1}^{T} \ell_{j,t} = \frac{1}{B}\sum_{j=1}^{B} L_j,
# \qquad L_j = \frac{1}{T}\sum_{t} \ell_{j,t},$$
#
# and by linearity $\nabla\,\text{loss} = \frac{1}{B}\sum_j \nabla L_j$: the gradient of `loss_and_grads` already
# *is* the lecture's average, and `hsgd.model.optim.SGD` just does `w -= lr * g`. (This is also why data
# parallelism works, chapter 4: the batch mean is the mean of the means over equal shards.) Checked on 4 sequences:

# %%
B = 4
idx = rng.integers(0, cfg.vocab_size, (B, cfg.seq_len))       # (B, T) input bytes
targets = rng.integers(0, cfg.vocab_size, (B, cfg.seq_len))   # (B, T) next bytes

loss_batch, grads_batch = serial.loss_and_grads(params, idx, targets, cfg)
per_example = [serial.loss_and_grads(params, idx[j:j + 1], targets[j:j + 1], cfg) for j in range(B)]
loss_mean = sum(lj for lj, _ in per_example) / B
grads_mean = {name: sum(gj[name] for _, gj in per_example) / B for name in params}

check("|batch loss - mean of L_j|", abs(loss_batch - loss_mean), 1e-12)
check("max |batch grad - mean of grad_j|",
      max(float(np.max(np.abs(grads_batch[n] - grads_mean[n]))) for n in params), 1e-12)

# %% [markdown]
# One step of `SGD` without momentum is exactly that formula:

# %%
lr = 0.1
stepped = {name: p.copy() for name, p in params.items()}
SGD(lr, momentum=0.0).step(stepped, grads_batch)
check("max |SGD step - (w - lr * g)|",
      max(float(np.max(np.abs(stepped[n] - (params[n] - lr * grads_batch[n])))) for n in params), 1e-15)

# %% [markdown]
# ## 2. The backward pass, layer by layer
#
# Every layer in `hsgd/model/layers.py` is a pair
#
#     out, cache = X_forward(inputs..., params...)
#     dinputs    = X_backward(dout, cache, dparams...)     # dparams += ...
#
# with `dout` = $\partial \text{loss} / \partial \text{out}$ from the layer above. The backward returns the input
# gradient and *adds* (`+=`) the parameter gradients into arrays the caller owns, so uses, micro-batches and
# shards accumulate.
#
# **Linear**, $y = xW + b$, $x$: (N, Cin), $W$: (Cin, Cout): the only products whose shapes fit,
#
# $$dx = dy\, W^\top, \qquad dW = x^\top dy, \qquad db = \textstyle\sum_n dy_{n,:}.$$
#
# **LayerNorm** over the last axis (size C): $\hat x = (x - \mu)\, r$, $r = 1/\sqrt{\sigma^2 + \epsilon}$ (biased
# variance), $y = \hat x \odot w + b$; $dw = \sum \text{dout} \odot \hat x$, $db = \sum \text{dout}$ over rows. With
# $g = \text{dout} \odot w$ and $\partial \hat x_j / \partial x_i = r\,(\delta_{ij} - \tfrac1C - \tfrac1C \hat x_i
# \hat x_j)$, row by row
#
# $$dx = r\,\big(g - \text{mean}(g) - \hat x\, \text{mean}(g \odot \hat x)\big):$$
#
# the parts of $g$ LayerNorm cannot see (a common shift, a scaling along $\hat x$) are removed, so each row of
# $dx$ sums to zero.
#
# **GELU**, tanh approximation: $y = \tfrac12 x (1 + t)$, $t = \tanh u$, $u = \sqrt{2/\pi}\,(x + 0.044715 x^3)$;
# elementwise, $dx = \text{dout} \odot y'(x)$ with
#
# $$y'(x) = \tfrac12 (1 + t) + \tfrac12 x\, (1 - t^2)\, \sqrt{2/\pi}\, (1 + 3 \cdot 0.044715\, x^2).$$
#
# **Causal attention**, per head, q, k, v of shape (T, hs): $S = q k^\top/\sqrt{hs} + M$, the mask $M$ being
# $-\infty$ above the diagonal and 0 elsewhere; $P = \text{softmax}(S)$ by rows; $y = P v$. Backward:
#
# $$dv = P^\top dy, \quad dP = dy\, v^\top, \quad dS = P \odot \big(dP - \text{rowsum}(dP \odot P)\big), \quad
# dq = dS\, k / \sqrt{hs}, \quad dk = dS^\top q / \sqrt{hs},$$
#
# the softmax line from $\partial P_{ij} / \partial S_{ik} = P_{ij}(\delta_{jk} - P_{ik})$. The mask needs no
# backward: where it is $-\infty$, $P = 0$ exactly, so $dS = 0$, and the backward is as causal as the forward.
# q, k and v are three linear layers of the same input, so their input gradients add.
#
# **Residual**, $x_{\text{out}} = x + f(x)$: $dx = dx_{\text{out}} + (\partial f/\partial x)^\top dx_{\text{out}}$,
# the rule that a value used twice receives the sum of both gradients.
#
# **Embedding**, $x_{b,t} = \text{wte}[\text{idx}_{b,t}] + \text{wpe}[t]$: $d\,\text{wpe}[t]$ sums over the batch,
# $d\,\text{wte}[v]$ over all positions holding token $v$ (a scatter-add).
#
# **Cross-entropy**, logits $z$: (N, V), targets $t_n$, $\text{loss} = \frac1N \sum_n \big(\log\sum_v e^{z_{nv}} -
# z_{n t_n}\big)$:
#
# $$dz = \big(\text{softmax}(z) - \text{onehot}(t)\big) / N,$$
#
# where the lecture's $\frac1B\sum_j$ enters the backward.
#
# A block is `x = x + Attn(LN1(x))` then `x = x + MLP(LN2(x))`; `serial.block_backward` is `block_forward` read
# from the bottom up, each `*_backward` consuming its partner's cache:

# %%
print(inspect.getsource(serial.block_backward))

# %% [markdown]
# ## 3. Finite-difference checks
#
# A central difference approximates one coordinate of the gradient:
#
# $$\frac{L(w + h e_i) - L(w - h e_i)}{2h} = \frac{\partial L}{\partial w_i} + O(h^2),$$
#
# with truncation error about $h^2 L'''/6$ and rounding error about $\varepsilon |L| / h$: both near $10^{-10}$ in
# float64 at $h = 10^{-5}$ (in float32 rounding alone is near $10^{-2}$, hence float64). The error measure is
#
# $$\text{err} = \frac{|fd - an|}{\max(|fd| + |an|,\ \text{floor})},$$
#
# with a floor because a $10^{-10}$ error on a tiny gradient says nothing. The attention k-bias shows why: adding
# $b$ to every key adds $q_t \cdot b$ to all of row t's scores, which softmax ignores, so its gradient is exactly
# zero and the computed values are $10^{-18}$ noise; noise over noise is near 1. With a floor of $10^{-3}$ a
# coordinate below it must match to $10^{-9}$ absolute, still far tighter than a real bug (off by about the
# gradient itself).
#
# For one layer the scalar is $L = \sum \text{out} \odot R$ with a fixed random $R$, so
# $\partial L / \partial \text{out} = R$ and `X_backward(R, cache)` must give $\partial L / \partial \text{inputs}$;
# a random $R$ probes every direction of the Jacobian. The checker, `hsgd.model.gradcheck.fd_error`, is the one
# hsgd's tests use: it perturbs each coordinate in place, calls `central_difference` and keeps the worst
# `disagreement` (printed below).

# %%
print(f"gradcheck's defaults: h = {H:g}, floor = {FLOOR:g}")
print(inspect.getsource(gradcheck.central_difference))
print(inspect.getsource(gradcheck.disagreement))


def layer_check(name, forward, backward, arrays):
    """forward(*arrays) -> (out, cache); backward(dout, cache) -> gradients of arrays, in the same order."""
    out, cache = forward(*arrays)
    R = rng.standard_normal(np.shape(out))                   # dL/dout of the probe L = sum(out * R)
    grads = backward(R, cache)
    probe = lambda: float(np.sum(forward(*arrays)[0] * R))
    check(f"{name}: max rel err", fd_error(probe, arrays, grads))
    return grads


def randn(*shape):
    return rng.standard_normal(shape)


# %% [markdown]
# Every coordinate of every input and parameter, layer by layer (the `+=` targets are fresh zeros):

# %%
def linear_backward(dy, cache):
    dW, db = np.zeros(cache[1].shape), np.zeros(cache[1].shape[1])
    dx = layers.linear_backward(dy, cache, dW, db)
    return [dx, dW, db]


def layernorm_backward(dy, cache):
    dw, db = np.zeros(dy.shape[-1]), np.zeros(dy.shape[-1])
    dx = layers.layernorm_backward(dy, cache, dw, db)
    return [dx, dw, db]


layer_check("linear", layers.linear_forward, linear_backward, [randn(2, 3, 4), randn(4, 5), randn(5)])
dx_ln = layer_check("layernorm", layers.layernorm_forward, layernorm_backward,
                    [randn(2, 3, 6), randn(6), randn(6)])[0]
check("layernorm: max |row sum of dx|", float(np.max(np.abs(dx_ln.sum(axis=-1)))), 1e-12)
layer_check("gelu", layers.gelu_forward, lambda dy, c: [layers.gelu_backward(dy, c)], [2 * randn(3, 7)])
layer_check("attention (NH=2)", lambda q, k, v: layers.attention_forward(q, k, v, 2),
            layers.attention_backward, [randn(2, 4, 6), randn(2, 4, 6), randn(2, 4, 6)])

tok = rng.integers(0, 7, (2, 4))                                # (B, T) ids in a vocabulary of 7


def embedding_backward(dx, cache):
    dwte, dwpe = np.zeros((7, 3)), np.zeros((5, 3))
    layers.embedding_backward(dx, cache, dwte, dwpe)
    return [dwte, dwpe]


layer_check("embedding", lambda wte, wpe: layers.embedding_forward(tok, wte, wpe), embedding_backward,
            [randn(7, 3), randn(5, 3)])
_ = layer_check("cross-entropy", lambda z: layers.cross_entropy_forward(z, tok),
                lambda d, c: [layers.cross_entropy_backward(d, c)], [randn(2, 4, 7)])

# %% [markdown]
# A whole block of the tiny model (prefix `h.0.`): the input and all 16 parameter arrays, which covers the
# residual additions and the fan-out into q, k, v.

# %%
h0 = [name for name in params if name.startswith("h.0.")]


def block_forward(x, *ws):
    return serial.block_forward(x, dict(zip(h0, ws)), "h.0.", cfg)


def block_backward(dx, cache):
    g = {name: np.zeros_like(params[name]) for name in h0}
    dx = serial.block_backward(dx, cache, g, "h.0.", cfg)
    return [dx] + [g[name] for name in h0]


block_grads = layer_check("transformer block", block_forward, block_backward,
                          [randn(2, cfg.seq_len, cfg.d_model)] + [params[n].copy() for n in h0])
dbk = block_grads[1 + h0.index("h.0.attn.k.bias")]
print(f"  (attn k-bias gradient: max |dbk| = {np.max(np.abs(dbk)):.0e}, zero up to rounding)")

# %% [markdown]
# The whole model: `serial.loss` against `serial.loss_and_grads`, 6 sampled coordinates of each of the 37 arrays.
# The scalar is now the loss itself (near 2.4), and most gradients lie between $10^{-4}$ and $10^{-1}$.

# %%
_, grads = serial.loss_and_grads(params, idx, targets, cfg)
probe = lambda: serial.loss(params, idx, targets, cfg)      # reads params, which fd_error perturbs in place
model_err = {}
for name in params:
    model_err[name] = fd_error(probe, [params[name]], [grads[name]], n=6, rng=rng)
for name in sorted(model_err, key=model_err.get, reverse=True)[:3]:
    print(f"  {name:<22s} {model_err[name]:.1e}")
check(f"whole model ({len(params)} arrays): max rel err", max(model_err.values()))

kb = "h.0.attn.k.bias"
pure = fd_error(probe, [params[kb]], [grads[kb]], floor=1e-300)   # no floor: noise divided by noise
print(f"  {kb}: max |grad| = {np.max(np.abs(grads[kb])):.0e}; relative error without the floor {pure:.1e}, "
      f"with it {model_err[kb]:.0e}")

# %% [markdown]
# **Choosing h.** The error sum $h^2 |L'''|/6 + \varepsilon |L|/h$ is smallest near $h^* \approx
# \varepsilon^{1/3}$ (times a scale): about $5\cdot 10^{-6}$ in float64, $5\cdot 10^{-3}$ in float32, with an error
# of order $\varepsilon^{2/3}|L|$. Measured below on 4 coordinates (the largest gradient of 4 arrays, so the floor
# plays no part), for h from $10^{-1}$ to $10^{-12}$, with the loss in float64 and in float32 and the float64
# backward as the exact gradient.

# %%
steps = np.logspace(-1, -12, 23)                                  # the h to try, large to small
probed = ["wte", "h.0.attn.q.weight", "h.1.mlp.fc.weight", "lm_head.weight"]
coords = [(name, int(np.argmax(np.abs(grads[name])))) for name in probed]   # the largest gradient of each


def fd_sweep(ps):
    """The worst relative error over the probed coordinates, for each h in steps, of the loss computed with
    the parameters ps (perturbed in place and restored)."""
    out = []
    for h in steps:
        worst = 0.0
        for name, i in coords:
            flat = ps[name].reshape(-1)                           # a view: writing it perturbs ps[name]
            fd = gradcheck.central_difference(lambda: serial.loss(ps, idx, targets, cfg), flat, i, h)
            an = grads[name].reshape(-1)[i]
            worst = max(worst, abs(fd - an) / (abs(fd) + abs(an)))
        out.append(worst)
    return np.array(out)


sweep = {"float64": fd_sweep(params), "float32": fd_sweep({n: p.astype(np.float32) for n, p in params.items()})}
for dtype, errs in sweep.items():
    best = int(np.argmin(errs))
    print(f"  {dtype}: smallest error {errs[best]:.1e} at h = {steps[best]:.0e}; "
          f"at h = {H:.0e}: {errs[int(np.argmin(np.abs(steps - H)))]:.1e}")
best64 = steps[int(np.argmin(sweep["float64"]))]
check.holds("float64: the best h is between 1e-8 and 1e-3", 1e-8 <= best64 <= 1e-3)
check.holds("float32's best error > 1000 x float64's best", sweep["float32"].min() > 1e3 * sweep["float64"].min())

fig, ax = pictures.figure(6, 3.2)
for dtype, errs in sweep.items():
    ax.loglog(steps, errs, "o-", ms=3, label=f"loss computed in {dtype}")
ax.axvline(H, color="0.5", ls=":", lw=1)
ax.text(H * 1.3, 3e-13, f"h = {H:.0e}, the checks' step", fontsize=7, color="0.3")
ax.set_xlabel("step h of the central difference")
ax.set_ylabel("|fd - exact| / (|fd| + |exact|)")
ax.set_title("Central differences on 4 coordinates of the tiny model: rounding (left) vs truncation (right)",
             fontsize=8)
ax.set_ylim(1e-13, 3)
ax.legend(fontsize=8)
print("picture:", pictures.save(fig, "01_fd_error_vs_step"))

# %% [markdown]
# Right of each minimum the error falls like $h^2$ (truncation, slope 2), left of it grows like $1/h$ (rounding,
# slope -1). In float32 the valley is higher and further right, and below $h \approx 10^{-5}$, $w + h$ rounds back
# to $w$ and the error is 1: no step gives float32 the accuracy a $10^{-6}$ check needs. The errors exceed
# $\varepsilon^{2/3}$ because the gradients are small next to the loss.

# %% [markdown]
# ## 4. Training
#
# `hsgd.train.train` (also `python -m hsgd.train`) runs the mini-batch SGD loop on bytes of the Python standard
# library's source: each step's batch, `loss_and_grads`, `SGD.step` (momentum 0.9). In 40 steps of a small float32
# model the validation loss falls from $\ln 256 \approx 5.55$, a uniform guess over bytes.

# %%
small = ModelConfig(seq_len=32, d_model=32, n_heads=2, n_layers=2, d_ff=128)
run = train(small, TrainConfig(steps=40, batch_size=8, lr=0.1, momentum=0.9, eval_interval=0, eval_batches=4,
                               log_interval=10, sample_bytes=0))
print(f"validation loss {run['val_before']:.3f} -> {run['val_after']:.3f}")
check.holds("validation loss fell by more than 0.5", run["val_after"] < run["val_before"] - 0.5)

fig, ax = pictures.figure(6, 3)
ax.plot(range(1, len(run["losses"]) + 1), run["losses"], "-", label="training loss of the step's batch")
ax.plot([0, len(run["losses"])], [run["val_before"], run["val_after"]], "s", color="C3",
        label="validation loss, before and after")
ax.axhline(np.log(256), color="0.5", ls=":", lw=1, label="ln 256: a uniform guess over bytes")
ax.set_xlabel("step (a batch of 8 sequences of 32 bytes)")
ax.set_ylabel("mean cross-entropy (nats)")
ax.set_title("hsgd.train: serial mini-batch SGD with momentum 0.9 on the standard library's source", fontsize=8)
ax.legend(fontsize=7)
print("picture:", pictures.save(fig, "01_training_loss"))

# %% [markdown]
# The loss of each step's batch (noisy: 8 new sequences each step) and the validation loss before and after. The
# learning rate warms up over 20 steps (`TrainConfig.warmup`'s default), then decays along a cosine
# (`hsgd.model.optim.lr_at`), so the curve falls slowly at first.

# %% [markdown]
# ## Check against serial
#
# Later chapters compare a parallel run with the serial model from the same seed. Here the serial model itself was
# checked against calculus: every layer's backward and the whole model's gradient match central differences to
# $10^{-6}$, the batch gradient is the lecture's $\frac1B\sum_j \nabla L_j$, and SGD with it learns. Chapters 2
# and 3 check MPI's collectives against NumPy; from chapter 4 on, `serial.loss_and_grads` is the reference.

# %%
worst, err = check.worst([w for w in check.errors if "rel err" in w])
print(f"chapter 1: all {len(check.passed)} checks passed; largest finite-difference error {err:.1e} "
      f"({worst.split(':')[0]}), tolerance {TOL:.0e}")

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# The frameworks leave a model's backward to PyTorch's autograd, whose unit is hsgd's pair (forward, saved context,
# backward); they write such pairs by hand where they need control (fused kernels, communication in the backward).
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `layers.linear_forward` / `linear_backward`, `dW += x^T dy` | `LinearWithGradAccumulationAndAsyncCommunication` (megatron/core/tensor_parallel/layers.py), a `torch.autograd.Function`; with `gradient_accumulation_fusion` it adds into `main_grad` | none: PyTorch's autograd | `torch.autograd.Function` (`ctx.save_for_backward`, `backward(ctx, grad_output)`) | every backward written out: the derived formula is the code |
# | `layers.gelu_forward` / `gelu_backward` (tanh) | `GeLUFunction` / `bias_gelu_back` (megatron/core/fusions/fused_bias_gelu.py) | none | `torch.nn.functional.gelu(x, approximate="tanh")` | no fusion with the bias |
# | `serial.block_backward` | autograd through `TransformerLayer` (megatron/core/transformer/transformer_layer.py) | `DeepSpeedEngine.backward` | `loss.backward()` | the reversed order is visible in the source |
# | gradients accumulated with `+=` into a `grads` dict | `param.main_grad`, a view into DDP's gradient buffer | accumulated until `is_gradient_accumulation_boundary()` | `param.grad` until `optimizer.zero_grad()` | the caller owns the arrays |
# | `fd_error`: central differences in float64 | none | none | `torch.autograd.gradcheck` | the floor of the relative error is explained |
# | `optim.SGD(lr, momentum)`: $v \leftarrow \mu v + g$, $w \leftarrow w - \eta v$ | `OptimizerConfig(optimizer="sgd", sgd_momentum=0.9)` (megatron/core/optimizer/optimizer_config.py) | `"optimizer": {"type": "SGD"}`, handed to `torch.optim` (`_configure_basic_optimizer`) | `torch.optim.SGD(params, lr, momentum=0.9)` | no Nesterov, no dampening |
# | `optim.lr_at`: warm-up, then cosine to lr/10 | `OptimizerParamScheduler` (megatron/core/optimizer_param_scheduler.py) | `WarmupLR`, `WarmupDecayLR` (deepspeed/runtime/lr_schedules.py) | `LinearLR`, `CosineAnnealingLR` | a function of the step, no object |
#
# ## Exercises
#
# ### Exercise 1: the backward of RMSNorm, by hand
# RMSNorm (LLaMA): $y = x\, r \odot w$, $r = 1/\sqrt{\text{mean}(x^2) + \epsilon}$ over the last axis. Write
# `rmsnorm_forward(x, w) -> (y, cache)` and `rmsnorm_backward(dy, cache, dw) -> dx` (`dw +=`), derive $dx$ as
# section 2 derives LayerNorm's, check every coordinate of $x$ and $w$ with the probe $L = \sum y \odot R$, and
# check that the rows of $dx$ do *not* sum to zero. (Hint: $dx = r\,(g - \hat x\, \text{mean}(g \odot \hat x))$.)
# (solution: `tutorials/solutions/01_serial_sgd.py`, `exercise_1`)
#
# ### Exercise 2: momentum SGD against plain SGD
# Show that with momentum $\mu$ and fixed $\eta$, $w_t = w_0 - \eta \sum_{s=1}^{t} \sum_{i=1}^{s} \mu^{s-i} g_i$,
# and check it against `SGD.step`. Then minimize $f(w) = \frac12 \sum_i \lambda_i w_i^2$, $\lambda_i$ from 0.01 to
# 1, $\eta = 1$, with $\mu = 0$ and $\mu = 0.9$: count the steps to $f < 10^{-8} f(w_0)$, and check the plain count
# against $f(w_t) = \frac12 \sum_i \lambda_i (1 - \eta\lambda_i)^{2t} w_{0,i}^2$.
# (solution: `tutorials/solutions/01_serial_sgd.py`, `exercise_2`)
#
# ### Exercise 3: gradient accumulation equals the big batch
# Split a batch of B = 8 into micro-batches of 3 and 5; run `serial.forward`/`serial.backward` on each, seeding the
# backward with `layers.cross_entropy_backward(b_m / B, cache)` into one `grads` dict. Check it equals
# `serial.loss_and_grads` on all 8, and that weighting the micro-batches $\frac12$ each does *not*.
# (solution: `tutorials/solutions/01_serial_sgd.py`, `exercise_3`)
#
# ### Exercise 4: the backward is as causal as the forward
# With the probe $L = \sum_{b,c} y_{b, t_0, c} R_{b, c}$ on `layers.attention_forward`/`attention_backward`, check
# that dq, dk, dv are exactly zero after $t_0$ (dq everywhere but $t_0$), while dk and dv at positions $\le t_0$
# are not.
# (solution: `tutorials/solutions/01_serial_sgd.py`, `exercise_4`)

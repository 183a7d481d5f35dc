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
# parallelism and data parallelism* (summarized, section by section, in `tutorials/00_the_lecture.md`, with the
# chapter that carries out each step). From here on it is "the lecture", and the chapters cite its sections by
# number.
#
# Everything later in hsgd (tensor, data and pipeline parallelism) is checked against one program: the serial
# model in `hsgd/model/serial.py`. This chapter makes sure that program is right. It covers
#
# 1. SGD and mini-batch SGD as the lecture writes them, and why hsgd's update is simply `w -= lr * g`;
# 2. the backward pass of a GPT-style Transformer block, derived layer by layer;
# 3. a finite-difference check of every layer and of the whole model, in float64;
# 4. a short training run, to see the loss go down.
#
# Run it as a script (about 5 s on a quiet 2-core machine; it exits non-zero if any check fails):
#
#     python tutorials/01_serial_sgd.py
#
# or open it as a notebook: `jupytext --to ipynb tutorials/01_serial_sgd.py`, then open the `.ipynb` in
# Jupyter. It draws two pictures into `$HSGD_FIGURES` (default `tutorials/figures/`): the finite-difference error
# against the step size, and the training loss.
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
# Section 1 of the lecture starts from serial SGD.
# For one training example $(x_i, y_i)$ the parameters move against the gradient of that example's loss, with
# learning rate $\eta$:
#
# $$w \leftarrow w - \eta\, \nabla L(f(x_i; w), y_i).$$
#
# In practice one averages over a mini-batch of $B$ examples, which is steadier:
#
# $$w \leftarrow w - \eta\, \frac{1}{B} \sum_{j=1}^{B} \nabla L(f(x_j; w), y_j).$$
#
# In hsgd an example is a sequence of T bytes, and the loss is the cross-entropy of predicting each next byte,
# averaged over all N = B*T positions of the batch. Every sequence has the same T positions, so
#
# $$\text{loss} = \frac{1}{BT}\sum_{j=1}^{B}\sum_{t=1}^{T} \ell_{j,t} = \frac{1}{B}\sum_{j=1}^{B} L_j,
# \qquad L_j = \frac{1}{T}\sum_{t} \ell_{j,t},$$
#
# and because the gradient is linear, $\nabla\,\text{loss} = \frac{1}{B}\sum_j \nabla L_j$. The gradient
# `loss_and_grads` returns therefore already *is* the lecture's averaged gradient, and the update in
# `hsgd.model.optim.SGD` is just `w -= lr * g`. (This is also what makes data parallelism work in chapter 4: the
# mean over the batch equals the mean of the means over equal-sized shards.)
#
# Let us see it: the gradient of a batch of 4 sequences against the mean of 4 single-sequence gradients.

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
# One step of `hsgd.model.optim.SGD` without momentum is exactly the formula above:

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
# where `dout` is $\partial \text{loss} / \partial \text{out}$, handed down from the layer above. The backward
# returns the gradient for its inputs and *adds* (`+=`) the gradient for its parameters into arrays the caller
# owns, so gradients from several uses, micro-batches or shards simply accumulate.
#
# **Linear**, $y = xW + b$ with $x$: (N, Cin), $W$: (Cin, Cout). Since $y_{nj} = \sum_i x_{ni} W_{ij} + b_j$,
#
# $$dx = dy\, W^\top, \qquad dW = x^\top dy, \qquad db = \textstyle\sum_n dy_{n,:}.$$
#
# (These are also the only products whose shapes fit: a handy way to remember them.)
#
# **LayerNorm** over the last axis (size C): $\hat x = (x - \mu)\, r$ with $r = 1/\sqrt{\sigma^2 + \epsilon}$
# (biased variance), $y = \hat x \odot w + b$. The parameter gradients are
# $dw = \sum \text{dout} \odot \hat x$ and $db = \sum \text{dout}$, summed over rows. For the input, let
# $g = \text{dout} \odot w$. Differentiating $\hat x$ gives
# $\partial \hat x_j / \partial x_i = r\,(\delta_{ij} - \tfrac1C - \tfrac1C \hat x_i \hat x_j)$, so, row by
# row,
#
# $$dx = r\,\big(g - \text{mean}(g) - \hat x\, \text{mean}(g \odot \hat x)\big).$$
#
# The two subtracted terms remove the parts of $g$ along the directions LayerNorm cannot see: shifting every
# entry by the same amount (the mean) and scaling $x - \mu$ (along $\hat x$). In particular each row of $dx$
# sums to zero.
#
# **GELU**, tanh approximation: $y = \tfrac12 x (1 + t)$, $t = \tanh u$,
# $u = \sqrt{2/\pi}\,(x + 0.044715 x^3)$. It acts elementwise, so $dx = \text{dout} \odot y'(x)$ with
#
# $$y'(x) = \tfrac12 (1 + t) + \tfrac12 x\, (1 - t^2)\, \sqrt{2/\pi}\, (1 + 3 \cdot 0.044715\, x^2).$$
#
# **Causal attention**, per head, with q, k, v of shape (T, hs): scores $S = q k^\top/\sqrt{hs} + M$, where
# the mask $M$ is $-\infty$ above the diagonal (position t may only look at positions $\le t$) and 0
# elsewhere; $P = \text{softmax}(S)$ row by row; $y = P v$. Backward:
#
# $$dv = P^\top dy, \quad dP = dy\, v^\top, \quad dS = P \odot \big(dP - \text{rowsum}(dP \odot P)\big), \quad
# dq = dS\, k / \sqrt{hs}, \quad dk = dS^\top q / \sqrt{hs}.$$
#
# The softmax line follows from $\partial P_{ij} / \partial S_{ik} = P_{ij}(\delta_{jk} - P_{ik})$. The mask
# needs no backward of its own: $M$ is a constant, and where it is $-\infty$ we have $P = 0$ exactly, so
# $dS = 0$ there too; no gradient flows to future keys, the backward is as causal as the forward. In the
# block, q, k and v are three linear layers applied to the same input, so their three input gradients are
# added.
#
# **Residual connections**, $x_{\text{out}} = x + f(x)$:
# $dx = dx_{\text{out}} + (\partial f/\partial x)^\top dx_{\text{out}}$. The gradient passes through the skip
# connection unchanged, and the branch adds its own contribution. This is the general rule that a value used
# twice in the forward receives the sum of both gradients.
#
# **Embedding**, $x_{b,t} = \text{wte}[\text{idx}_{b,t}] + \text{wpe}[t]$: $d\,\text{wpe}[t]$ sums over the
# batch, and $d\,\text{wte}[v]$ sums the gradients of all positions that hold token $v$ (a scatter-add).
#
# **Cross-entropy** with logits $z$: (N, V) and targets $t_n$:
# $\text{loss} = \frac1N \sum_n \big(\log\sum_v e^{z_{nv}} - z_{n t_n}\big)$, so
#
# $$dz = \big(\text{softmax}(z) - \text{onehot}(t)\big) / N.$$
#
# That $1/N$ is where the lecture's $\frac1B\sum_j$ enters the backward pass.
#
# A Transformer block is `x = x + Attn(LN1(x))` then `x = x + MLP(LN2(x))`. `serial.block_backward` is
# `serial.block_forward` read from the bottom up: every `*_forward` line has its `*_backward` partner, in
# reverse order, each consuming the cache its partner saved.

# %%
print(inspect.getsource(serial.block_backward))

# %% [markdown]
# ## 3. Finite-difference checks
#
# A central difference approximates one coordinate of the gradient:
#
# $$\frac{L(w + h e_i) - L(w - h e_i)}{2h} = \frac{\partial L}{\partial w_i} + O(h^2).$$
#
# It has two errors: truncation, about $h^2 L'''/6$, and rounding, about $\varepsilon |L| / h$. In float64
# ($\varepsilon \approx 10^{-16}$) with $h = 10^{-5}$ both are around $10^{-10}$ (in float32,
# $\varepsilon \approx 6\cdot 10^{-8}$, rounding alone would be near $10^{-2}$: that is why the checks use
# float64). We report a relative error with an absolute floor,
#
# $$\text{err} = \frac{|fd - an|}{\max(|fd| + |an|,\ \text{floor})},$$
#
# because an error near $10^{-10}$ on a coordinate whose gradient is itself tiny says nothing about the code.
# The attention k-bias shows it best. Adding the same vector $b$ to every key adds the same number
# $q_t \cdot b$ to every score in row t, and softmax ignores that: the k-bias gradient is *exactly* zero in
# exact arithmetic. The computed values are rounding noise of order $10^{-18}$, so a pure relative error on
# them would compare noise with noise and come out near 1. With a floor of $10^{-3}$, a gradient coordinate
# below $10^{-3}$ must instead match to within $10^{-9}$ in absolute terms, still far tighter than any real
# bug (a wrong term in a backward is off by about the size of the gradient itself). The floor is set where the
# $\sim 10^{-10}$ finite-difference error stays well below $10^{-6}$ of what it is divided by.
#
# For one layer the scalar to differentiate is $L = \sum \text{out} \odot R$ with a fixed random $R$; then
# $\partial L / \partial \text{out} = R$, and `X_backward(R, cache)` must give
# $\partial L / \partial \text{inputs}$. A random $R$ probes every direction of the layer's Jacobian (an
# all-ones probe could hide bugs).
#
# The checker is `hsgd.model.gradcheck.fd_error`, the one every test of hsgd uses too: it perturbs each
# coordinate in place, calls `central_difference` (below) and keeps the worst `disagreement` (below, the
# "coordinate" measure is the formula above). Its defaults are this section's step and floor.

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
# Every coordinate of every input and parameter, layer by layer (each backward's `+=` targets are fresh
# zeros):

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
# Now a whole Transformer block of the tiny model (`block_forward` / `block_backward`, prefix `h.0.`): the
# input x and all 16 parameter arrays of the block, every coordinate. The residual additions and the three-way
# fan-out into q, k, v are checked here too.

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
# Finally the whole model: `serial.loss` against `serial.loss_and_grads`, on 6 sampled coordinates of each of
# the 37 parameter arrays, with the same step and error measure. Here the scalar is the loss itself (near
# 2.4), and most single-coordinate gradients are between $10^{-4}$ and $10^{-1}$.

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
# The step $h = 10^{-5}$ was chosen from the two error terms above. Their sum,
# $h^2 |L'''|/6 + \varepsilon |L|/h$, is smallest near $h^* \approx \varepsilon^{1/3}$ (times a scale of the
# function): about $5\cdot 10^{-6}$ in float64 and $5\cdot 10^{-3}$ in float32, with an absolute error of the order
# of $\varepsilon^{2/3}|L|$ there. Let us measure it rather than trust the estimate: the
# relative error of the central difference on 4 coordinates of the whole model (in 4 different arrays, each the
# coordinate with the largest gradient, so that the floor plays no part), for steps from $10^{-1}$ down to
# $10^{-12}$, with the loss computed in float64 and in float32. The exact gradient is the float64 backward in both.

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
# The picture shows both error terms: right of the minimum the error falls like $h^2$ as $h$ shrinks
# (truncation, slope 2 on the log-log axes), left of it the error grows like $1/h$ (rounding, slope -1). In
# float32 the valley is higher and further right, and below $h \approx 10^{-5}$ the step is lost in rounding
# altogether ($w + h$ rounds back to $w$ for most parameters): the difference is 0 and the error 1. No step gives
# float32 finite differences the accuracy a $10^{-6}$ check needs, which is why hsgd's gradient checks run in
# float64; the relative errors are larger than $\varepsilon^{2/3}$ because the gradients ($10^{-2}$ and less)
# are small next to the loss (about 2.4).

# %% [markdown]
# ## 4. Training
#
# With the gradients trusted, `hsgd.train.train` runs the mini-batch SGD loop on bytes of the Python standard
# library's source (no download needed): each step takes the step's batch, calls `loss_and_grads`, and updates
# every parameter with `SGD.step` (here with momentum 0.9). A small model and 40 steps are enough to see the
# validation loss fall from $\ln 256 \approx 5.55$ (a uniform guess over bytes). The same loop is
# `python -m hsgd.train` on the command line. Training runs in float32, for speed; the exactness checks above
# needed float64.

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
# The picture shows the loss of each step's batch (noisy: every step sees 8 new sequences) and the validation
# loss on held-out bytes before and after the 40 steps. The learning rate rises over the first 20 steps (the
# warm-up, `TrainConfig.warmup`'s default) and then decays along a cosine (`hsgd.model.optim.lr_at`), so the curve
# falls slowly at first.

# %% [markdown]
# ## Check against serial
#
# Every later chapter ends by comparing a parallel computation with the serial model built from the same seed:
# the same loss, and every gradient shard equal to the matching slice of `serial.loss_and_grads`. Here there
# is nothing further below to compare with, so the serial model itself was checked against calculus: every
# layer's backward and the whole model's gradient agree with central finite differences to better than
# $10^{-6}$ relative error, the batch gradient is the lecture's $\frac1B\sum_j \nabla L_j$, and SGD with it
# learns. Chapters 2 and 3 check MPI's collectives against sums NumPy computes on one process; from chapter 4 on,
# `serial.loss_and_grads` is the reference.

# %%
worst, err = check.worst([w for w in check.errors if "rel err" in w])
print(f"chapter 1: all {len(check.passed)} checks passed; largest finite-difference error {err:.1e} "
      f"({worst.split(':')[0]}), tolerance {TOL:.0e}")

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# The production frameworks never write a backward pass for a whole model: PyTorch's autograd records the forward
# and runs each operation's backward in reverse. But autograd's unit is the same pair as hsgd's, an operation with a
# forward, a saved context and a backward, and the frameworks write such pairs by hand where they need control
# (fused kernels, communication inside the backward).
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `layers.linear_forward` / `linear_backward`: `(out, cache)`, then `dx`, with `dW += x^T dy` | `LinearWithGradAccumulationAndAsyncCommunication` (megatron/core/tensor_parallel/layers.py): a `torch.autograd.Function` that saves `(input, weight)` and, with `gradient_accumulation_fusion`, adds the weight gradient into `main_grad` | none of its own: the model's modules, differentiated by PyTorch | `torch.autograd.Function` (`forward(ctx, ...)`, `ctx.save_for_backward`, `backward(ctx, grad_output)`); `torch.nn.Linear` under autograd | every layer's backward is written out, so the formula a reader derives is the code that runs |
# | `layers.gelu_forward` / `gelu_backward` (tanh approximation) | `GeLUFunction` / `bias_gelu_back` (megatron/core/fusions/fused_bias_gelu.py), the same tanh formula and derivative | none | `torch.nn.functional.gelu(x, approximate="tanh")` | no fusion with the bias: one formula per function |
# | `serial.block_backward`: the forward read from the bottom up | the block's backward is autograd's (`TransformerLayer`, megatron/core/transformer/transformer_layer.py) | the same, through `DeepSpeedEngine.backward` | `loss.backward()` | the reversed order is visible in the source |
# | the gradient accumulated with `+=` into a `grads` dict | `param.main_grad` (a view into DDP's contiguous gradient buffer) | gradients accumulated across micro-batches until `is_gradient_accumulation_boundary()` | `param.grad` accumulates (`+=`) until `optimizer.zero_grad()` | the caller owns the arrays; nothing is hidden on the parameter |
# | `fd_error`: central differences in float64 | none | none | `torch.autograd.gradcheck` (torch/autograd/gradcheck.py): central differences in float64 against the backward | the floor on the relative error is chosen and explained in the text |
# | `optim.SGD(lr, momentum)`: $v \leftarrow \mu v + g$, $w \leftarrow w - \eta v$ | `OptimizerConfig(optimizer="sgd", sgd_momentum=0.9)` (megatron/core/optimizer/optimizer_config.py; default `"adam"`), built by `get_megatron_optimizer` | `"optimizer": {"type": "SGD", ...}`: a name DeepSpeed does not implement itself goes to `torch.optim` (`DeepSpeedEngine._configure_basic_optimizer`) | `torch.optim.SGD(params, lr, momentum=0.9)`: with the default `dampening=0` the same update | one flat state array per rank (chapter 4 on); no Nesterov, no dampening |
# | `optim.lr_at`: linear warm-up, then cosine to lr/10 | `OptimizerParamScheduler` (megatron/core/optimizer_param_scheduler.py) | `WarmupLR`, `WarmupDecayLR` (deepspeed/runtime/lr_schedules.py) | `torch.optim.lr_scheduler.LinearLR`, `CosineAnnealingLR` | one function of the step, no scheduler object |
#
# ## Exercises
#
# ### Exercise 1: the backward of RMSNorm, by hand
# LLaMA-style models replace LayerNorm with RMSNorm: $y = x\, r \odot w$ with $r = 1/\sqrt{\text{mean}(x^2) +
# \epsilon}$ over the last axis (no mean subtracted, no bias). Write `rmsnorm_forward(x, w) -> (y, cache)` and
# `rmsnorm_backward(dy, cache, dw) -> dx` (with `dw +=`), deriving $dx$ the way section 2 derives LayerNorm's.
# Check every coordinate of $x$ and $w$ against central differences with the chapter's probe $L = \sum y \odot R$,
# and check that, unlike LayerNorm's, the rows of $dx$ do *not* sum to zero. (Hint: with $g = dy \odot w$ and
# $\hat x = x r$, $dx = r\,(g - \hat x\, \text{mean}(g \odot \hat x))$.)
# (solution: `tutorials/solutions/01_serial_sgd.py`, `exercise_1`)
#
# ### Exercise 2: momentum SGD against plain SGD
# Unroll `hsgd.model.optim.SGD` with momentum $\mu$: show that after $t$ steps with gradients $g_1 .. g_t$ (and a fixed
# learning rate) $w_t = w_0 - \eta \sum_{s=1}^{t} \sum_{i=1}^{s} \mu^{s-i} g_i$, and check it against `SGD.step`
# on random gradients. Then minimize the ill-conditioned quadratic $f(w) = \frac12 \sum_i \lambda_i w_i^2$,
# $\lambda_i$ from 0.01 to 1, with plain SGD ($\mu = 0$) and with $\mu = 0.9$, both with $\eta = 1$, and count the
# steps each needs to bring $f$ below $10^{-8} f(w_0)$. Check the plain count against the closed form: each
# coordinate shrinks by $(1 - \eta\lambda_i)$ per step, so $f(w_t) = \frac12 \sum_i \lambda_i (1 - \eta\lambda_i)^{2t}
# w_{0,i}^2$.
# (solution: `tutorials/solutions/01_serial_sgd.py`, `exercise_2`)
#
# ### Exercise 3: gradient accumulation equals the big batch
# Cut a batch of B = 8 sequences into micro-batches of 3 and 5 sequences. Run `serial.forward` and
# `serial.backward` on each, seeding the backward with `layers.cross_entropy_backward(b_m / B, cache)` so that
# micro-batch m adds $\frac{b_m}{B}\nabla L_m$ to one shared `grads` dict (the layers' `+=` does the accumulating).
# Check the result against `serial.loss_and_grads` on all 8 sequences, and check that weighting the two micro-batches
# equally ($\frac12$ each) is *not* the batch gradient when they have different sizes.
# (solution: `tutorials/solutions/01_serial_sgd.py`, `exercise_3`)
#
# ### Exercise 4: the backward is as causal as the forward
# Section 2 argued that no gradient flows to future keys. Check it on `layers.attention_forward` /
# `attention_backward`: take the probe $L = \sum_{b,c} y_{b, t_0, c} R_{b, c}$ that reads only position $t_0$ of
# the output, and check that dq, dk and dv are exactly zero at every position after $t_0$ (and that dq is zero at
# every position except $t_0$ itself), while dk and dv at positions $\le t_0$ are not.
# (solution: `tutorials/solutions/01_serial_sgd.py`, `exercise_4`)

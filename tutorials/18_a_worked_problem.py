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
# # Chapter 18: a worked problem: 70B on 512 H100s
#
# Chapter 17 opened the planner up. This chapter uses it the way an engineer would on a first morning with a new
# cluster, in the manner of the worked problems of Austin et al. 2025 ("How to Scale Your Model"): a question, a
# page of back-of-envelope bounds that fix what the answer can be, and only then the search, whose answer is held
# against those bounds. Every number below is computed by the run and checked against a second derivation.
#
# The bounds include the two crossovers that place tensor parallelism inside a node and let data parallelism cross
# nodes, as the lecture's section 4.1 asks.
#
# One process, no MPI; about 4 s measured on a 2-core machine. It draws one picture into `$HSGD_FIGURES`
# (default `tutorials/figures/`).
#
# Legend: L layers, C d_model (h), NH heads, NKV key/value heads, hs = C/NH, K = NKV hs the width of k and v, F the
# MLP's hidden width, V vocabulary, T sequence (s); B global batch (sequences), b sequences per micro-batch, m
# micro-batches; N the parameters; D training tokens; n the devices in all;
# tp (t), pp (p), cp, dp the sizes of a layout, M = tp pp cp the model-parallel size; R a device's matmul rate
# (FLOP/s), W a link's bandwidth (bytes/s per device and direction), U usable bytes per device.

# %%
import json
import os
import re
import tempfile

from hsgd.plan.__main__ import build_parser, plan
from hsgd.plan.costs import collective
from hsgd.plan.hardware import load
from hsgd.plan.models import presets
from hsgd.plan.search import Layout, evaluate

import pictures                     # tutorials/pictures.py: where the PNGs go
from checks import Checks           # tutorials/checks.py: check(what, err, tol), check.holds, check.note

check = Checks(tol=1e-12, width=86)   # one process: no communicator
say = check.say
GiB = 2 ** 30


def rel(a, b):
    return abs(a - b) / abs(b)


# %% [markdown]
# ## 1. The question
#
# Train Llama 3 70B (Dubey et al. 2024, "The Llama 3 Herd of Models": grouped-query attention with 8 key/value
# heads, a SwiGLU MLP, RMSNorm, rotary positions, untied embeddings) at its pre-training sequence length T = 8192,
# on 512 H100 80GB, 8 to a node on NVLink, the nodes joined by InfiniBand. The planner ships the model as the
# preset `llama3-70b` and the machine as `hsgd/plan/hw/h100-80g.toml` (datasheet figures):

# %%
MODEL, DEVICES, BATCH, HW = "llama3-70b", 512, 512, "h100-80g"
cfg, hw = presets()[MODEL], load(HW)
L, C, NH, NKV, F, V, T = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.vocab_size, cfg.seq_len
hs = C // NH
K = NKV * hs                                           # the width of k and of v
TOKENS = BATCH * T
PEAK = hw.peak("bfloat16")
EFF = hw.efficiency or 0.5                             # what python -m hsgd.plan takes when the file names none
RATE = PEAK * EFF
say(f"model {MODEL}: L={L} C={C} NH={NH} NKV={NKV} hs={hs} F={F} V={V} T={T}; {cfg.describe_family()}")
say(f"hardware {HW}: {hw.memory_bytes / GiB:.0f} GiB a device, {hw.devices_per_node} a node, "
    f"{DEVICES // hw.devices_per_node} nodes; bf16 peak {PEAK / 1e12:.0f} TFLOP/s (the planner's rate: "
    f"{EFF:g} of it, {RATE / 1e12:.1f} TFLOP/s); HBM {hw.memory_bandwidth / 1e12:.2f} TB/s")
say(f"links per device and direction: NVLink {hw.intra.bandwidth / 1e9:.0f} GB/s, InfiniBand "
    f"{hw.inter.bandwidth / 1e9:.0f} GB/s ({hw.intra.bandwidth / hw.inter.bandwidth:.0f} x slower)")
say(f"global batch: {BATCH} sequences x {T} = {TOKENS:,} tokens a step, {TOKENS // DEVICES:,} per device")

# %% [markdown]
# The batch, B = 512 sequences of 8192 tokens, about 4M tokens a step, is the batch Llama 3 405B's pre-training
# started with (Dubey et al. 2024: 4M tokens, then 8M and 16M later); section 2.4 says why it should not be much
# larger. It is also exactly «8,192 per device»: one sequence per device, a first hint that the devices will have
# to share replicas rather than each hold one.
#
# ## 2. Bounds before the search
#
# ### 2.1 Parameters
#
# A block holds q and the output projection ($C \times C$ each), k and v ($C \times K$ each, $K = N_{KV} h_s$),
# the three SwiGLU matrices ($C \times F$ each) and two RMSNorm weights; the model adds the embedding, the untied
# head and a final norm:
#
# $$N = L\,(2C^2 + 2CK + 3CF + 2C) + 2VC + C .$$

# %%
N = L * (2 * C * C + 2 * C * K + 3 * C * F + 2 * C) + 2 * V * C + C
say(f"N = L (2C^2 + 2CK + 3CF + 2C) + 2VC + C = {N / 1e9:.2f} B parameters")
check("N by hand = ModelConfig.n_params() (its parameter shapes, multiplied out)", rel(N, cfg.n_params()))
check("N by hand within 0.5% of the published 70.6 B (Dubey et al. 2024)", rel(N, 70.6e9), 5e-3)

# %% [markdown]
# ### 2.2 Bytes per parameter, and the smallest model-parallel size
#
# Megatron-LM trains in bf16 with Adam and keeps per parameter: the bf16 weight (2 bytes), a 32-bit gradient (4:
# with bf16 it accumulates and all-reduces gradients in fp32 by default), the fp32 master weight (4) and Adam's
# two fp32 moments (8): **18 bytes**. Its distributed optimizer (ZeRO stage 1 of Rajbhandari et al. 2020, "ZeRO:
# Memory Optimizations Toward Training Trillion Parameter Models") shards the last 12 over the dp ranks:
# **6 + 12/dp**. ZeRO's own count, which the planner uses, keeps 16-bit gradients: 16, or 4 + 12/dp.
#
# With M = tp pp devices sharing a replica and dp = n/M replicas, the model states alone must fit in the usable
# memory U (80 GiB less a 10% headroom, section 3):
#
# $$\frac{18N}{M} \le U \;\Rightarrow\; M \ge \frac{18N}{U}, \qquad \Big(6 + \frac{12M}{n}\Big)\frac{N}{M} \le U
# \;\Rightarrow\; M \ge \frac{6N}{U - 12N/n} ,$$
#
# and M must divide n = 512. This is before a single activation is stored: a lower bound.

# %%
U = 0.9 * hw.memory_bytes
BOUNDS = {"18 (Megatron-LM, no sharding)": 18 * N / U,
          "6 + 12/dp (Megatron-LM's distributed optimizer)": 6 * N / (U - 12 * N / DEVICES),
          "16 (ZeRO's count: the planner's ZeRO-0)": 16 * N / U,
          "4 + 12/dp (the planner's ZeRO-1)": 4 * N / (U - 12 * N / DEVICES)}
M_MIN = {name: min(d for d in range(1, DEVICES + 1) if DEVICES % d == 0 and d >= x) for name, x in BOUNDS.items()}
say(f"usable U = 0.9 x {hw.memory_bytes / GiB:.0f} GiB = {U / 1e9:.1f} GB; model states alone need M >= ...")
for name, x in BOUNDS.items():
    say(f"  {name:<50} M >= {x:5.1f}: M = {M_MIN[name]}")


def shard(tp):
    """Parameters on one tp rank of a whole replica (pp = 1): the matrices and the vocabulary split t ways
    (t <= NKV: each rank keeps NKV/t whole key/value heads), the 2L + 1 norm weights whole on every rank."""
    return (L * (2 * C * C + 2 * C * K + 3 * C * F) + 2 * V * C) / tp + (2 * L + 1) * C


OPTS = dict(tp_scheme="sequence", recompute="selective", schedule="1f1b", b=1, attention="flash")
GRID = {}                                              # (zero, tp, pp) -> the planner's evaluation
for zero in (0, 1):
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8, 16):
            dp = DEVICES // (tp * pp)
            GRID[zero, tp, pp] = evaluate(cfg, BATCH, Layout(dp=dp, pp=pp, tp=tp, m=BATCH // dp, zero=zero, **OPTS),
                                          hw, efficiency=EFF, simulated=False)
worst = 0.0
for (zero, tp, pp), e in GRID.items():
    if pp == 1:
        states = e.memory["params"] + e.memory["grads"] + e.memory["optimizer"]
        per = 16 if zero == 0 else 4 + 12 / e.layout.dp
        worst = max(worst, rel(states, per * shard(tp)))
check("the planner's model states at pp = 1, t = 1..8 = (16 or 4 + 12/dp) x shard(t)", worst)
e = GRID[1, 8, 1]
states = e.memory["params"] + e.memory["grads"] + e.memory["optimizer"]
say(f"tp 8, pp 1, dp 64, ZeRO-1: the planner's states {states / GiB:.2f} GiB; Megatron-LM's (fp32 gradients: "
    f"2 bytes more per parameter) {(6 + 12 / 64) * shard(8) / GiB:.2f} GiB")

# %% [markdown]
# Without sharding the optimizer no replica of fewer than «32» devices can hold 70B (18 bytes a parameter: M
# «16.4» rounded up to a divisor of 512); with the distributed optimizer the bound falls to «5.6», so M = «8»: one
# node, tp = 8, pp = 1, already holds the states: «50.83 GiB» by Megatron-LM's count, «34.40 GiB» by the planner's,
# the difference being Megatron's 32-bit gradient, «2 bytes more per parameter». The rest of U is for the
# activations, which section 3 adds.

# %% [markdown]
# ### 2.3 FLOPs and days
#
# A step multiplies each token by every weight matrix three times (forward, and the two products of the
# backward): $6 N_{mm}$ FLOPs a token, with $N_{mm} = N - VC - (2L+1)C$ (the embedding is a lookup and the norms
# are no products). Attention adds $QK^\top$ and the weighted sum, $4TC$ per token and layer in the forward, three
# times that for a step: $12LTC$ a token, counted over the whole $T \times T$ as MFU's convention does (a causal
# kernel computes about half). So
#
# $$F_{step} = 6 N_{mm} BT + 12\,L\,T\,C\,BT \approx 6N\,BT\Big(1 + \frac{2LTC}{N}\Big),$$
#
# and $6ND$ for D training tokens. At T = 8192 the second term is not small.

# %%
N_MM = N - V * C - (2 * L + 1) * C
F_DENSE, F_ATT = 6 * N_MM * TOKENS, 12 * L * T * C * TOKENS
F_STEP = F_DENSE + F_ATT
check("6 N_mm BT + 12 L T C BT = ModelConfig.step_flops (summed matrix by matrix)", rel(F_STEP, cfg.step_flops(BATCH)))
say(f"a step: 6 N BT = {6 * N * TOKENS:.3e}, 6 N_mm BT = {F_DENSE:.3e}, attention {F_ATT:.3e} FLOPs "
    f"({F_ATT / F_STEP:.1%} of {F_STEP:.3e})")
MFU = 0.40                                             # Dubey et al. 2024 report 38-43% BF16 MFU for 405B
STEP_AT_MFU = F_STEP / (DEVICES * PEAK * MFU)
say(f"at {MFU:.0%} MFU on {DEVICES} H100s: {STEP_AT_MFU:.2f} s a step")
for what, D in (("Chinchilla's 20 tokens a parameter", 20 * N), ("Llama 3's 15T tokens", 15e12)):
    days = F_STEP / TOKENS * D / (DEVICES * PEAK * MFU) / 86400
    say(f"  {what:<36} D = {D / 1e12:5.2f}T tokens: {F_STEP / TOKENS * D:.2e} FLOPs, {days:5.0f} days")

# %% [markdown]
# Attention is «13.4%» of the step at this length. At «40%» MFU a step takes «9.97 s»; 1.4T tokens (Hoffmann et
# al. 2022, "Training Compute-Optimal Large Language Models": about 20 tokens a parameter, «1.41T») take about
# «39 days», Llama 3's 15T about «413 days»: 512 H100s suit a compute-optimal 70B, not an over-trained one (Llama 3
# 405B was trained on up to 16K H100s).
#
# ### 2.4 The batch: why dp cannot just grow
#
# The batch is not free. McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training") show that to reach
# a given loss the steps S and the examples E trade off as $(S/S_{min} - 1)(E/E_{min} - 1) = 1$, with a critical
# batch $B_{crit} = E_{min}/S_{min}$: below it, a larger batch saves steps almost for free; above it, it mostly
# spends tokens. Kaplan et al. 2020 ("Scaling Laws for Neural Language Models") fit
# $B_{crit}(\mathcal{L}) \approx B_*/\mathcal{L}^{1/\alpha_B}$, $B_* \approx 2\cdot 10^8$ tokens,
# $\alpha_B \approx 0.21$: it grows as the loss falls, a few million tokens at a loss near 2 nats (their
# tokenizer and data; an order of magnitude, not a law for Llama's).

# %%
B_STAR, ALPHA_B = 2e8, 0.21
B_CRIT = B_STAR / 2.0 ** (1 / ALPHA_B)                  # at a loss of 2 nats
say(f"B_crit(2 nats) = {B_CRIT / 1e6:.1f}M tokens; B = {TOKENS / 1e6:.1f}M: S/S_min = 1 + B_crit/B = "
    f"{1 + B_CRIT / TOKENS:.2f}, E/E_min = 1 + B/B_crit = {1 + TOKENS / B_CRIT:.2f}")

# %% [markdown]
# So B = 4M tokens spends «1.57» times the minimum tokens and takes «2.76» times the minimum steps: a balanced
# choice. Data parallelism splits B; it cannot go past one sequence per replica (dp $\le B/b$), and raising B to
# feed more replicas runs into $B_{crit}$. With more devices than that, the rest must be model parallel, and a step
# no longer halves when the devices double; the planner shows it at 1024 devices in section 3.
#
# ### 2.5 Tensor parallelism: the crossover per link
#
# One block's forward on one of t ranks multiplies $bT$ tokens by its shard of the weights,
# $2bT\,C\,W_b/t$ FLOPs with $W_b = 2C + 2K + 3F$ (the block's weights are $C W_b$). It exchanges two activations of
# $bTC$ 16-bit values, two All-Reduces (or an All-Gather and a Reduce-Scatter each, with sequence parallelism; the
# same bytes), a ring moving $2\frac{t-1}{t}$ of each: $8\,bTC\frac{t-1}{t}$ bytes. Communication stays below
# compute when
#
# $$\frac{8 bTC (t-1)/t}{W} \le \frac{2 bT C W_b / t}{R} \iff \frac{W_b}{t} \ge 4\,\frac{t-1}{t}\,\frac{R}{W} .$$
#
# $R/W$ is the device's arithmetic intensity against the link: the FLOPs it does in the time the link moves a
# byte. The block's width per tp rank must exceed about four times it. (For a GPT block, $W_b = 12C$: $C/t \ge R/3W$.)

# %%
W_B = 2 * C + 2 * K + 3 * F
TP = 8
n_act = 2 * 1 * T * C                                   # one activation of a micro-batch (b = 1) in 16 bits
flops_fwd = 2 * T * C * W_B / TP                        # one block's forward on one of TP ranks
say(f"W_b = 2C + 2K + 3F = {W_B}; per tp rank at t = {TP}: {W_B // TP}")
say(f"{'link':<11} {'R/W':>8} {'min W_b/t':>10} {'comm/compute':>13} {'planner':>8} {'largest t':>10}")
for link in (hw.intra, hw.inter):
    intensity = RATE / link.bandwidth
    need = 4 * (TP - 1) / TP * intensity
    ratio = need / (W_B / TP)                           # (comm time) / (compute time) of the forward
    planner = 2 * collective("Allreduce", n_act, TP, link) / (flops_fwd / RATE)
    t_max = int(1 + W_B / (4 * intensity))              # the largest t with comm <= compute
    say(f"{link.name:<11} {intensity:8.0f} {need:10.0f} {ratio:13.2f} {planner:8.2f} {t_max:>10}")
    check(f"{link.name}: comm/compute by the formula vs the planner's collective() (its latency)",
          rel(ratio, planner), 0.03)
    if link is hw.intra:
        nvlink_ratio = ratio
    else:
        ib_ratio = ratio

# %% [markdown]
# At the planner's rate an H100 does «1099» FLOPs per byte NVLink moves and «9890» per byte of InfiniBand. Llama
# 70B's block is «104448» wide, «13056» per rank at t = 8: on NVLink its tensor-parallel traffic costs «0.29» of the
# forward's compute (the planner's alpha-beta cost agrees, «0.30» with the latency); on InfiniBand it would cost
# «2.65» times it. On NVLink the crossover would allow t up to «24», but a node has 8 devices; across nodes, no
# more than «3». That is the lecture's rule of section 4.1, derived: **tp stays inside a node**.
#
# ### 2.6 Data parallelism: the crossover per step
#
# Once per step each replica All-Reduces the gradients of its device's shard, $s_g \Psi$ bytes ($\Psi = N/M$,
# $s_g$ = 2 bytes in the planner, 4 with Megatron-LM's fp32 reduction), over InfiniBand; meanwhile the device
# computed $6 \Psi\, BT/dp$ FLOPs (its share of its replica's tokens). Communication stays below compute when
#
# $$\frac{2\frac{dp-1}{dp}\, s_g \Psi}{W_{IB}} \le \frac{6\Psi\,BT/dp}{R} \iff \frac{BT}{dp} \ge
# \frac{s_g}{3}\,\frac{dp-1}{dp}\,\frac{R}{W_{IB}} ,$$
#
# a minimum number of tokens per replica, independent of the model's size (Austin et al. 2025 derive the same for
# TPUs).

# %%
lay = Layout(dp=64, pp=1, tp=8, m=8, zero=0, **OPTS)
e = evaluate(cfg, BATCH, lay, hw, efficiency=EFF)
dp = lay.dp
by_hand = 2 * (dp - 1) / dp * 2 * shard(lay.tp) / hw.inter.bandwidth
say(f"dp {dp} x tp {lay.tp}: All-Reduce of {2 * shard(lay.tp) / GiB:.2f} GiB of 16-bit gradients: "
    f"{by_hand:.3f} s by hand, {e.time.parts()['dp']:.3f} s in the plan")
check("dp term = 2 (dp-1)/dp 2 Psi / W_IB (the planner's adds the latency)", rel(e.time.parts()["dp"], by_hand), 1e-3)
for s_g in (2, 4):
    need = s_g / 3 * (dp - 1) / dp * RATE / hw.inter.bandwidth
    say(f"  s_g = {s_g}: at least {need:,.0f} tokens per replica; this batch gives {TOKENS // dp:,}: "
        f"dp exchange / compute = {need / (TOKENS / dp):.2f}")

# %% [markdown]
# Each replica gets «65,536» tokens a step, ten times the «6,490» the crossover asks for (twice that with 32-bit
# gradients): the exchange is «0.10» of the compute, and a bucketed exchange can hide it behind the backward
# (chapter 8). So data parallelism may cross nodes, and the bounds already suggest the answer: tp = 8 inside a
# node, as little pp as memory allows, dp = 64 across nodes.
#
# ## 3. The planner
#
# `python -m hsgd.plan` prices every layout, drops what does not fit in $U$ and sorts the rest by predicted step
# time. The search is restricted to ZeRO 0 and 1 (`--zero 0,1`): Megatron-LM's default and its distributed
# optimizer, the settings section 2.2 counted; exercise 3 widens it. Everything else (tp, pp, cp, sequence
# parallelism, recomputation, micro-batch size, schedule) is searched.

# %%
BASE = ["--model", MODEL, "--batch", str(BATCH), "--devices", str(DEVICES), "--hw", HW, "--zero", "0,1", "--top", "5"]


def run_planner(argv):
    """(printed lines, --json's content) of python -m hsgd.plan argv, in this process."""
    lines = []
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "plan.json")
        plan(build_parser().parse_args(argv + ["--json", path]),
             say=lambda *a, **k: lines.append(" ".join(str(x) for x in a)))
        with open(path) as f:
            return lines, json.load(f)


def table(lines):
    """The planner's lines up to its table's last row (not the progress lines, not the per-layout reports)."""
    end = next(i for i, line in enumerate(lines) if line.startswith("\n1."))
    return [line for line in lines[:end] if not line.startswith("  ...")]


ARGV = BASE + ["--headroom", "0.1"]
lines, found = run_planner(ARGV)
say("$ python -m hsgd.plan " + " ".join(ARGV))
for line in table(lines):
    say(line)
best = found["layouts"][0]
lay = best["layout"]
mem = sum(best["memory"].values())
say(f"\nchosen: {lay['name']}: {mem / GiB:.2f} GiB of {U / GiB:.2f} usable, {best['time']['total']:.2f} s, "
    f"MFU {best['mfu']:.1%}")

ARGV0 = BASE + ["--headroom", "0"]
lines0, found0 = run_planner(ARGV0)
say("\n$ python -m hsgd.plan " + " ".join(ARGV0) + "   (the table's first 3 rows)")
say("\n".join(table(lines0)[-5:-2]))
best0 = found0["layouts"][0]
mem0 = sum(best0["memory"].values())
say(f"headroom 0: {best0['layout']['name']} at {mem0 / GiB:.2f} GiB, {mem0 / hw.memory_bytes:.1%} of "
    f"{hw.memory_bytes / GiB:.0f} GiB; {1 - best0['time']['total'] / best['time']['total']:.1%} faster by the model")
check.holds("with headroom 0 the fastest layout would not fit in the 10% headroom's U", mem0 > U)

# %% [markdown]
# Without headroom the fastest layout, «dp32 pp4 tp4», fills «95.1%» of the device to buy «1.4%» by the model.
# The planner's memory is the formulas' (chapter 11): model states and stored activations. A real process also holds
# the CUDA context and the libraries' workspaces, NCCL's buffers for every communicator it joins,
# and the caching allocator's fragmentation: freed blocks too small for the next large tensor, which can grow over
# a run as sizes vary. None of these is in the formulas, and a layout planned at 95% can fail with out-of-memory
# hours into a run. The default `--headroom 0.1` keeps 8 GiB for them.
#
# Now the chosen layout against section 2:

# %%
M = lay["tp"] * lay["pp"] * lay["cp"]
states = best["memory"]["params"] + best["memory"]["grads"] + best["memory"]["optimizer"]
per_param = 16 if lay["zero"] == 0 else 4 + 12 / lay["dp"]
check.holds(f"tp = {lay['tp']} <= {hw.devices_per_node}, the devices of a node (section 2.5)",
            lay["tp"] <= hw.devices_per_node)
check.holds(f"M = {M} >= the model states' bound for ZeRO-{lay['zero']} (section 2.2)",
            M >= M_MIN["16 (ZeRO's count: the planner's ZeRO-0)" if lay["zero"] == 0 else
                       "4 + 12/dp (the planner's ZeRO-1)"])
check.holds("its memory: at least the states' bound per_param N / M, at most U",
            per_param * N / M <= mem <= U)
for z in (0, 1):
    ms = [x["layout"]["tp"] * x["layout"]["pp"] * x["layout"]["cp"] for x in found["layouts"]
          if x["layout"]["zero"] == z]
    name = "16 (ZeRO's count: the planner's ZeRO-0)" if z == 0 else "4 + 12/dp (the planner's ZeRO-1)"
    say(f"ZeRO-{z}: {len(ms)} layouts fit; the smallest M among them {min(ms)}, the states' bound {M_MIN[name]}")
    check.holds(f"ZeRO-{z}: no fitting layout has M below the states' bound", min(ms) >= M_MIN[name])

# flash attention computes the causal half of the scores, 2 T^2 C a sequence and layer forward, and its backward
# computes them again, 5 T^2 C: 7 L T^2 C B in all, in place of the 12 L T^2 C B of MFU's count
F_FLASH = F_DENSE + 7 * L * T * T * C * BATCH
t_compute = F_FLASH / (DEVICES * RATE)
parts = best["time"]
say(f"compute by hand F / (n R) = {F_FLASH:.3e} / ({DEVICES} x {RATE / 1e12:.1f}e12) = {t_compute:.3f} s; the "
    f"planner's compute term {parts['compute']:.3f} s, its step {parts['total']:.3f} s "
    f"({parts['total'] / t_compute - 1:+.0%}: " + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items()
                                                           if v > 0.01 and k not in ("compute", "total")) + ")")
check("the planner's compute term vs F / (n R) by hand (5%: a pipeline's slowest stage)",
      rel(parts["compute"], t_compute), 0.05)
check.holds("the predicted step is no faster than F / (n R)", parts["total"] >= t_compute)
say(f"the bound of 2.3 at {MFU:.0%} MFU: {STEP_AT_MFU:.2f} s; the planner's MFU {best['mfu']:.1%}")

extra = best["memory"]["params"]                       # Megatron-LM's fp32 gradient: 2 more bytes a parameter
say(f"with Megatron-LM's 32-bit gradients (ZeRO-{lay['zero']} keeps them whole): {(mem + extra) / GiB:.2f} GiB, "
    f"{'within' if mem + extra <= U else 'over'} the {U / GiB:.2f} GiB usable")
fp32 = next(x for x in found["layouts"] if sum(x["memory"].values()) + x["memory"]["params"] <= U)
say(f"the fastest layout that fits with them: {fp32['layout']['name']}, {fp32['time']['total']:.2f} s")

# %% [markdown]
# The planner chose what the bounds suggested: «dp64 pp1 tp8, b1 m8, zero1, sp, recompute selective». Its compute
# term is the FLOPs at its rate; the rest of the step is the elementwise work, the exposed tensor-parallel traffic
# and the data-parallel exchange of sections 2.5 and 2.6 (the planner does not overlap the exchange unless asked,
# `--overlap`). Its MFU, «38.8%», is near the 40% assumed in section 2.3. Two cautions. The planner counts ZeRO's
# 16-bit gradients, and its flags ask Megatron-LM for them (`--grad-reduce-in-bf16`); with Megatron-LM's default
# 32-bit ones the same layout needs «72.25 GiB», just past $U$, and the first layout that fits is the one printed
# above. And at 1024 devices, the same batch:

# %%
lines2, found2 = run_planner(BASE[:5] + [str(2 * DEVICES)] + BASE[6:] + ["--top", "1"])
b2 = found2["layouts"][0]
speedup = best["time"]["total"] / b2["time"]["total"]
say(f"1024 devices: {b2['layout']['name']}, {b2['time']['total']:.2f} s a step: {speedup:.2f} x faster than on 512, "
    f"{TOKENS // b2['layout']['dp']:,} tokens per replica")
check.holds("twice the devices at the same batch: less than twice as fast (section 2.4)", speedup < 2)

# %% [markdown]
# Twice the devices give «1.87 x»: dp doubles to 128 and each replica's share of the batch halves, so the fixed
# costs per step weigh more.
#
# ## 4. The answer as flags
#
# With `--impl megatron` (the default) the planner prints the chosen layout as Megatron-LM's command line and as
# torchtitan's job file (`hsgd.plan.flags`); the run checks that they name the model and the layout:

# %%
start = next(i for i, line in enumerate(lines) if line.startswith("\nto run layout 1"))
end = next(i for i, line in enumerate(lines) if line.startswith("\nwrote "))
flag_lines = lines[start:end]
for line in flag_lines:
    say(line)
megatron = " ".join(flag_lines[1:next(i for i, x in enumerate(flag_lines) if x.startswith("with torchtitan"))])
titan = flag_lines[next(i for i, x in enumerate(flag_lines) if x.startswith("with torchtitan")) + 1:]


def flag(name, default=None):
    found_ = re.search(rf"--{name} (\d+)", megatron)
    return int(found_.group(1)) if found_ else default


def key(name):
    return int(next(x.split("=")[1] for x in titan if x.strip().startswith(name + " =")))


tp, pp, cp = flag("tensor-model-parallel-size"), flag("pipeline-model-parallel-size"), flag("context-parallel-size", 1)
check.equal("Megatron-LM's tp, pp, cp, and dp = 512 / (tp pp cp) = the layout's",
            (tp, pp, cp, DEVICES // (tp * pp * cp)), (lay["tp"], lay["pp"], lay["cp"], lay["dp"]))
check.equal("--global-batch-size = --micro-batch-size x dp x m",
            flag("global-batch-size"), flag("micro-batch-size") * lay["dp"] * lay["m"])
check.equal("Megatron-LM's model sizes = the shapes of section 1",
            [flag(k) for k in ("num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads",
                               "num-query-groups", "seq-length")], [L, C, F, NH, NKV, T])
degrees = [key(k) for k in ("data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
                            "context_parallel_degree", "pipeline_parallel_degree")]
check.equal("torchtitan's degrees multiply to the 512 devices", degrees[0] * degrees[1] * degrees[2] * degrees[3]
            * degrees[4], DEVICES)
check.equal("torchtitan's local_batch_size x its dp = the global batch", key("local_batch_size") * lay["dp"], BATCH)
check.holds('torchtitan\'s flavor is "70B" (its llama3 70B has these sizes)', 'flavor = "70B"' in " ".join(titan))
check.holds("Megatron-LM reduces gradients in bf16, as the planner counted them (2 bytes)",
            "--bf16 --grad-reduce-in-bf16" in megatron)

# %% [markdown]
# The picture: memory per device of the planner's accounting against the model-parallel size M = tp x pp, for
# ZeRO 0 and 1 (sequence parallelism, selective recomputation, b = 1, 1F1B), with the states-only bounds of 2.2 as
# lines, 80 GiB and the usable 72 GiB. The gap between a point and its line is the activations; at equal M the
# points of larger tp lie lower, since only tp divides the first stage's activations (chapter 17).

# %%
fig, ax = pictures.figure(6.4, 3.6)
for zero, colour in ((0, "tab:red"), (1, "tab:blue")):
    for tp, marker in ((1, "o"), (2, "s"), (4, "^"), (8, "D")):
        pts = sorted((tp * pp, sum(e.memory.values()) / GiB) for (z, t, pp), e in GRID.items() if z == zero and t == tp)
        ax.plot(*zip(*pts), marker, color=colour, ms=4, alpha=0.8, label=f"tp {tp}" if zero == 1 else None)
    ms = [2 ** k for k in range(8)]
    bound = [(16 if zero == 0 else 4 + 12 * m / DEVICES) * N / m / GiB for m in ms]
    ax.plot(ms, bound, "-", color=colour, lw=1, label=f"ZeRO-{zero}: states alone (2.2)")
ax.axhline(hw.memory_bytes / GiB, color="black", lw=1)
ax.axhline(U / GiB, color="black", lw=1, ls="--")
ax.text(1, hw.memory_bytes / GiB * 1.1, "80 GiB", fontsize=7)
ax.text(1, U / GiB * 0.78, "usable, 10% kept free", fontsize=7)
ax.set_xscale("log", base=2)
ax.set_xticks([2 ** k for k in range(8)], [str(2 ** k) for k in range(8)])
ax.set_yscale("log")
ax.set_xlabel("M = tp x pp (devices sharing a replica)")
ax.set_ylabel("GiB on the fullest device")
ax.set_title(f"{MODEL}, {DEVICES} H100s, batch {BATCH}: red ZeRO-0, blue ZeRO-1, pp = M / tp", fontsize=8)
ax.legend(fontsize=6, ncol=2)
pictures.save(fig, "18_memory_against_m")

# %%
what, err = check.worst()
say(f"\nchapter 18: all {len(check.passed)} checks passed; largest error {err:.1e} ({what})")

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | bytes per parameter (`hsgd.plan.paper.model_states`: 2 + 2 + 12, divided by dp where ZeRO shards) | 18 with bf16 (fp32 gradients, `accumulate_allreduce_grads_in_fp32`), 6 + 12/d with `--use-distributed-optimizer`; `--grad-reduce-in-bf16` for 16 | `zero_optimization.stage` 1-3; `estimate_zero2_model_states_mem_needs_all_live` | `torch.distributed.fsdp.fully_shard` with `MixedPrecisionPolicy(param_dtype, reduce_dtype)` | ZeRO's 16-bit gradient count; the chapter adds Megatron's 2 bytes by hand |
# | FLOPs of a step (`ModelConfig.step_flops`: 6 N_mm BT + 12 L T C BT) | `num_floating_point_operations` (megatron/training/training.py), for its TFLOP/s log | the flops profiler (`deepspeed.profiling.flops_profiler`) | `torch.utils.flop_counter.FlopCounterMode` | counted from the shapes, the same count MFU uses |
# | memory headroom (`--headroom`, default 0.1) | none: a layout that does not fit fails with out-of-memory | none | `torch.cuda.set_per_process_memory_fraction`; `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` against fragmentation | a fraction kept free before the search, not found by failing |
# | the layout's flags (`hsgd.plan.flags.megatron`, `.torchtitan`) | `--tensor-model-parallel-size`, `--pipeline-model-parallel-size`, `--sequence-parallel`, `--micro-batch-size`, `--global-batch-size` | `PipelineModule(num_stages=...)`, the config's `train_micro_batch_size_per_gpu` | torchtitan's `[parallelism]` keys; `torch.distributed.device_mesh.init_device_mesh` | generated from a priced layout rather than written by hand |
#
# ## Exercises
#
# ### Exercise 1: the same tokens at half the length
# Take T = 4096 (`llama3-70b,T=4096`) and B = 1024 sequences: the same 4M tokens a step. Compute the attention's
# share of the step's FLOPs by hand and check it against `ModelConfig.step_flops`; check that it is about half of
# T = 8192's; run the planner (`--zero 0,1`) and say what the shorter sequence changes in its answer.
# (solution: `tutorials/solutions/18_a_worked_problem.py`, `exercise_1`)
#
# ### Exercise 2: tensor parallelism across two nodes
# Price tp = 16, pp = 1, dp = 32 (ZeRO-1, sequence parallelism, selective recomputation, b = 1, flash attention).
# Count the blocks' tensor-parallel payload of a step by hand (per block and micro-batch, 6 All-Gathers and 4
# Reduce-Scatters of $bTC$ 16-bit values with sequence parallelism), check it against the planner's bytes, and
# compare the tp term with tp = 8's: how much of the factor comes from the link, by section 2.5?
# (solution: `tutorials/solutions/18_a_worked_problem.py`, `exercise_2`)
#
# ### Exercise 3: ZeRO 2 and 3 allowed
# Widen the search to `--zero 0,1,2,3` (Megatron-LM's `--use-megatron-fsdp`). Which layout wins, and by how much by
# the model? Check its gradients and optimizer state against ZeRO-2's $14\Psi/dp$ (and ZeRO-3's weights against
# $2\Psi/dp$ if it is ZeRO-3), with $\Psi$ its device's parameters, and say what the model leaves out that would
# make that gain smaller.
# (solution: `tutorials/solutions/18_a_worked_problem.py`, `exercise_3`)

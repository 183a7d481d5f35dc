"""hsgd.crosscheck on dumps of a producer that is not hsgd's own writer: tests/foreign_producer.py, written from
hsgd/crosscheck/FORMAT.md alone (its own names, weights stored (out, in), q|k|v fused [q_i | k_i | v_i] and gate|up
fused [gate_i | up_i] per tp rank, GQA, the vocabulary padded between ranks' rows, ranks numbered tp-major, FSDP x
TP 2-D shards, experts on blocks of consecutive dp ranks, safetensors files).

What it proves: the foreign dumps of a gpt2, a llama (GQA, tied) and a MoE model pass when their gradients are
hsgd.model.serial's (every error 0: the same numbers, moved around); a k bias whose gradient is exactly zero is no
permutation; and with one bug planted, `python -m hsgd.crosscheck DIR --json FILE` (run here in-process) names it
with the class of hsgd.crosscheck.classify it is, one test per class: not finite, missing, partial sum, padding,
constant factor, permutation (rows, heads, shards, blocks moved within a fused tensor), transposed, swapped (two
parameters' gradients exchanged, a whole fused part among them: k and v, gate and up), part missing, wrong group,
balance domain, fused layout, replicas differ, stale replica, unreduced, no simple pattern. The gradients a bug gives
are built here from the reference's (an earlier step's, one dp slice's own rows', the balance loss over each
rank's rows), never read from the crosscheck.
"""
import functools
import json
from dataclasses import dataclass

import numpy as np
import pytest

from hsgd.crosscheck.__main__ import main
from hsgd.model import serial
from hsgd.model.balance import Domain
from hsgd.model.config import ModelConfig
from hsgd.model.moe_pass import MoEPass, serial_pass

from . import foreign_producer as foreign

SIZES = dict(vocab_size=37, seq_len=8, d_model=16, n_heads=4, n_layers=1, d_ff=32)
GPT2 = ModelConfig(**SIZES)                                   # biases: the k bias's gradient is exactly 0
LLAMA = ModelConfig(**SIZES, arch="llama")                    # GQA: NKV = 2 kv heads for NH = 4
TIED = ModelConfig(**SIZES, arch="llama", tied=True)
MOE = ModelConfig(**{**SIZES, "n_layers": 2, "d_ff": 8}, arch="llama", moe_experts=4, moe_every=2,
                  moe_capacity_factor=1.0, moe_balance=0.1, moe_balance_domain="global", moe_z_loss=0.01)
TP, DP, B = 2, 3, 6                      # tp 2, dp 3: a factor dp (3) is not tp's (2)
MOE_DP, MOE_EP, MOE_B = 4, 2, 8          # experts 0, 1 on dp ranks 0, 1; experts 2, 3 on dp ranks 2, 3
HS = SIZES["d_model"] // SIZES["n_heads"]


@dataclass
class Step:
    """One training step of the system: parameters, batch, loss and (correct) gradients in hsgd's names."""
    cfg: ModelConfig
    params: dict
    idx: np.ndarray
    targets: np.ndarray
    loss: float
    grads: dict


def moe_loss_and_grads(cfg, params, idx, targets, per_rank=False):
    """(loss, grads) of the MoE model counted as the dump's layout counts (FORMAT.md, "Experts": each dp rank's rows
    routed together, capacity per rank); per_rank: the balance loss over each rank's rows, not the global domain."""
    B, T = idx.shape
    groups = foreign.capacity_groups(B, T, MOE_DP, 1)
    if per_rank:
        moe = MoEPass(cfg, Domain(groups, [len(G) for G in groups], len(groups)), groups)
    else:
        moe = serial_pass(cfg, B, T, np, B // MOE_DP, groups)
    return serial.loss_and_grads(params, idx, targets, cfg, moe=moe)


@functools.lru_cache(maxsize=None)
def step(cfg, seed=1):
    """The step of model cfg (parameters with noise, so that no norm weight or bias is trivial); cached: never
    change its arrays, build new dicts."""
    params = serial.init_params(cfg, seed=seed, dtype="float64")
    rng = np.random.default_rng(seed)
    for p in params.values():
        p += rng.normal(0.0, 0.1, p.shape)
    n = MOE_B if cfg.moe_experts else B
    idx, targets = (rng.integers(0, cfg.vocab_size, (n, cfg.seq_len)) for _ in range(2))
    if cfg.moe_experts:
        loss, grads = moe_loss_and_grads(cfg, params, idx, targets)
    else:
        loss, grads = serial.loss_and_grads(params, idx, targets, cfg)
    return Step(cfg, params, idx, targets, loss, grads)


def own_rows(s, d, dp=DP):
    """The gradient of dp rank d's B/dp sequences alone (the mean loss over its rows): before any reduction."""
    b = s.idx.shape[0] // dp
    return serial.loss_and_grads(s.params, s.idx[d * b:(d + 1) * b], s.targets[d * b:(d + 1) * b], s.cfg)[1]


def write(tmp_path, s, **kw):
    """The foreign dump of step s in tmp_path/dump (kw: the producer's, grads and loss among them)."""
    kw = {"grads": s.grads, "loss": s.loss, "tp": TP, "dp": MOE_DP if s.cfg.moe_experts else DP,
          "ep": MOE_EP if s.cfg.moe_experts else 1, **kw}
    foreign.write(tmp_path / "dump", s.cfg, s.params, idx=s.idx, targets=s.targets, **kw)
    return tmp_path / "dump"


def verdict(tmp_path):
    """(exit code, {name: JSON row}, loss row) of python -m hsgd.crosscheck DIR --json FILE."""
    out = tmp_path / "verdict.json"
    code = main([str(tmp_path / "dump"), "--json", str(out)])
    v = json.loads(out.read_text())
    rows = {r["name"]: r for r in v["parameters"]}
    fine = [r["error"] for r in rows.values() if r["ok"]]
    print(f"exit {code}; largest error of the passing gradients {max(fine, default=0.0):.1e}")
    for r in rows.values():
        if not r["ok"]:
            print(f"  {r['name']}: {r['class']}: {r['detail']}")
    return code, rows, v["loss"]


# ------------------------------------------------------------------------------------------- correct dumps pass

@pytest.mark.parametrize("cfg, kw", [
    (GPT2, {}),
    (LLAMA, {"rank_order": "dp-major", "safetensors": True}),
    (GPT2, {"two_d": True, "safetensors": True}),
    (LLAMA, {"two_d": True}),
    (TIED, {"two_d": True, "rank_order": "dp-major"}),
    (MOE, {}),
    (MOE, {"two_d": True, "safetensors": True}),
], ids=["gpt2", "llama-gqa-dp-major-safetensors", "gpt2-2d-safetensors", "llama-2d", "tied-2d", "moe-ep2",
        "moe-ep2-2d-safetensors"])
def test_a_correct_foreign_dump_passes(tmp_path, cfg, kw):
    """Every gradient back exactly from the foreign names, fused layouts, transposes, the padding between ranks'
    vocabulary rows, the rank order, the 2-D boxes (with their padding) and the experts' ranks."""
    path = write(tmp_path, step(cfg), **kw)
    layout = json.loads((path / "layout.json").read_text())
    first = layout["tensors"]["tok_emb"]["shards"][0]         # tp rank 0's rows, padded, then tp rank 1's
    assert max([first.get("padding", 0)] + [c["padding"] for c in first.get("slices", [])]) > 0
    if kw.get("two_d"):                  # a weight cut along two axes, the dp one padded where dp does not divide C
        wo = layout["tensors"]["blk0.attn.wo"]["shards"]
        padded = any(c["padding"] for s in wo for c in s["slices"])
        assert {len(s["slices"]) for s in wo} == {2} and padded == bool(cfg.d_model % layout["parallel"]["dp"])
    if cfg.moe_experts:                   # expert 3: local expert 1 of ep rank 1, on dp ranks 2 and 3 only
        w13 = layout["tensors"]["blk0.moe.experts.3.w13"]["shards"]
        assert {s["rank"] for s in w13} == {foreign.rank_of(d, t, TP, MOE_DP) for d in (2, 3) for t in range(TP)}
        assert {s["key"] for s in w13} == {"blk0.moe.local_experts.1.w13"}
    if kw.get("safetensors"):
        assert (path / "grads-rank0.safetensors").exists() and not (path / "grads-rank0.npz").exists()
    code, rows, loss = verdict(tmp_path)
    assert code == 0 and loss["ok"] and set(rows) == set(cfg.param_shapes())
    assert max(r["error"] for r in rows.values()) <= 1e-14


def test_a_k_bias_gradient_of_exactly_zero_is_no_permutation(tmp_path):
    """The k bias's gradient is 0 (softmax does not see a constant added to a row of scores); the reference's is
    rounding (printed), the system's exactly 0.0. Right, it passes; with the q bias wrong beside it in the fused
    bqkv, the k bias still passes and q's bug is named what it is, a factor, not a permutation of zero blocks."""
    s = step(GPT2)
    print(f"reference k bias gradient: largest {np.abs(s.grads['h.0.attn.k.bias']).max():.1e}")
    zero_k = {**s.grads, "h.0.attn.k.bias": np.zeros_like(s.grads["h.0.attn.k.bias"])}
    write(tmp_path, s, grads=zero_k)
    code, rows, _ = verdict(tmp_path)
    assert code == 0 and rows["h.0.attn.k.bias"]["class"] == ""
    write(tmp_path, s, grads={**zero_k, "h.0.attn.q.bias": DP * s.grads["h.0.attn.q.bias"]})
    code, rows, _ = verdict(tmp_path)
    assert code == 1 and rows["h.0.attn.k.bias"]["ok"] and rows["h.0.attn.v.bias"]["ok"]
    assert rows["h.0.attn.q.bias"]["class"] == "constant factor" and "= dp" in rows["h.0.attn.q.bias"]["detail"]


# ------------------------------------------------------------------------------------------- the bugs, by class

def with_grads(changed):
    """A bug that changes the values: changed {hsgd name: f(reference gradient, step)}."""
    return lambda s: {"grads": {**s.grads, **{n: f(s.grads[n], s) for n, f in changed.items()}}}


def at(key, f, where=lambda place: True):
    """A bug in the arrays written: f(array, place) for the arrays of `key` on the places `where` accepts."""
    return lambda s: {"change": lambda k, place, a: f(a.copy(), place) if k == key and where(place) else a}


def nan_at(a, place):
    """An overflow in one entry of one rank's array."""
    a[0, 0] = np.nan
    return a


def pad_at(a, place, axis=0):
    """Gradient in the last entry along `axis` of the rank's array: a padding entry, where the rank has padding."""
    np.moveaxis(a, axis, 0)[-1] = 1e-3
    return a


def kv_exchanged(tp_ranks):
    """[q_i | k_i | v_i] written as [q_i | v_i | k_i] on tp ranks tp_ranks (llama: q_i 8 rows, k_i and v_i 4)."""
    q, kv = LLAMA.n_heads // TP * HS, LLAMA.n_kv_heads // TP * HS
    return at("blk0.attn.wqkv", lambda a, place: np.concatenate([a[:q], a[q + kv:], a[q:q + kv]]),
              lambda place: place.tp_rank in tp_ranks)


def halves_exchanged(a, place):
    """A rank's [gate_i | up_i] written as [up_i | gate_i]."""
    return np.concatenate([a[len(a) // 2:], a[:len(a) // 2]])


def stale(replica, earlier=True):
    """dp rank `replica` holds the gradients of an earlier step (another batch and parameters) or random values."""
    def bug(s):
        other = step(s.cfg, seed=2).grads if earlier else {
            n: np.random.default_rng(5).normal(0, float(np.abs(g).max()), g.shape) for n, g in s.grads.items()}
        return {"replica_grads": {replica: other}}
    return bug


def unreduced_replica(s):
    """dp rank 2's replicas hold its own rows' gradient: the all-reduce's result never reached its buffer."""
    return {"replica_grads": {2: own_rows(s, 2)}}


def unreduced_only_copy(s):
    """One copy, dp rank 0's (the others write nothing): its own rows' gradient divided by dp, ready for an
    all-reduce sum that never ran."""
    return {"replicas": False, "replica_grads": {0: {n: g / DP for n, g in own_rows(s, 0).items()}}}


def place_mean(s):
    """Each expert's gradient averaged over all dp ranks (dp_comm), where the same local slot holds expert e on one ep
    rank and expert e + E/ep on the other: the mean of experts {e mod E/ep + q E/ep} (the wrong group)."""
    per = MOE.moe_experts // MOE_EP
    out = dict(s.grads)
    for n in s.grads:
        if ".moe.experts." in n:
            e = int(n.split(".")[4])
            place = [q * per + e % per for q in range(MOE_EP)]
            out[n] = sum(s.grads[n.replace(f".experts.{e}.", f".experts.{o}.")] for o in place) / MOE_EP
    return {"grads": out}


def balance_per_rank(s):
    loss, grads = moe_loss_and_grads(s.cfg, s.params, s.idx, s.targets, per_rank=True)
    return {"grads": grads, "loss": loss}


def tied_lookup_only(s):
    """A tied wte's gradient of the embedding lookup alone (the LM head's use not added): the untied model's wte
    gradient with lm_head = wte^T."""
    untied = ModelConfig(**SIZES, arch="llama")
    parts = serial.loss_and_grads({**s.params, "lm_head.weight": s.params["wte"].T.copy()}, s.idx, s.targets,
                                  untied)[1]
    return {"grads": {**s.grads, "wte": parts["wte"]}}


def heads_reordered(g, s):
    """q's heads (blocks of hs columns) in the order 1, 0, 3, 2."""
    C = g.shape[0]
    return g.reshape(C, -1, HS)[:, [1, 0, 3, 2]].reshape(C, C)


def swap_rows_blocks(g, s):
    """wo's input rows in tp blocks exchanged: the ranks' shards gathered in the order 1, 0."""
    n = len(g) // TP
    return np.concatenate([g[n:], g[:n]])


def noise(g, s):
    """A wrong computation: the gradient plus 30% noise."""
    return g + 0.3 * np.abs(g).max() * np.random.default_rng(0).normal(size=g.shape)


def holding(dp_ranks, split):
    """How the crosscheck names the ranks of dp ranks dp_ranks: each rank on its own, in order ("1 | 4"), whether the
    tensor is whole on each or split over tp (each shard is judged by itself: hsgd.crosscheck.replicas)."""
    ranks = [foreign.rank_of(d, t, TP, DP) for t in range(TP) for d in dp_ranks]
    return " | ".join(map(str, sorted(ranks)))


def stale_words(split):
    return [f"ranks {holding([0, 2], split)} hold the reference", f"ranks {holding([1], split)} hold another value"]


def per_head(a, place):
    """A rank's [q_i | k_i | v_i] (gpt2: 2 heads each) written per head, [q_a k_a v_a q_b k_b v_b]: the whole
    tensor then interleaved per head (groups = NH), while layout.json says per tp rank (groups = tp)."""
    heads = np.split(a, 3 * GPT2.n_heads // TP)                 # q_a q_b k_a k_b v_a v_b
    n = GPT2.n_heads // TP
    return np.concatenate([heads[m * n + j] for j in range(n) for m in range(3)])


CASES = [
    # id, model, the bug, the writer's options, {parameter: (class, words its detail holds)}
    ("not-finite", GPT2, at("blk0.attn.wo", nan_at, lambda p: p.rank == 4), {},
     {"h.0.attn.proj.weight": ("not finite", ["NaN"])}),
    ("missing", GPT2, at("norm_f.scale", lambda a, p: 0 * a), {}, {"ln_f.weight": ("missing", ["never arrived"])}),
    ("missing-one-replica", GPT2, at("norm_f.scale", lambda a, p: 0 * a, lambda p: p.dp_rank == 2), {},
     {"ln_f.weight": ("missing", ["zero on ranks 2 | 5"])}),
    ("partial-sum", GPT2, at("blk0.norm2.scale", lambda a, p: a * (0.25, 0.75)[p.tp_rank]), {},
     {"h.0.ln2.weight": ("partial sum", ["sum is the reference", "2 ranks"])}),
    ("padding", GPT2, at("tok_emb", pad_at, lambda p: p.tp_rank == 0), {},
     {"wte": ("padding", ["padded entries carry gradient"])}),
    ("constant-factor", GPT2, with_grads({"h.0.mlp.proj.weight": lambda g, s: DP * g}), {},
     {"h.0.mlp.proj.weight": ("constant factor", ["= dp:"])}),
    ("permutation-rows", GPT2, with_grads({"wpe": lambda g, s: g[::-1]}), {},
     {"wpe": ("permutation", ["rows along axis 0"])}),
    ("permutation-heads", GPT2, with_grads({"h.0.attn.q.weight": heads_reordered}), {},
     {"h.0.attn.q.weight": ("permutation", ["(heads;", "h.0.attn.q.weight 0 <- h.0.attn.q.weight 1, "
                                             "h.0.attn.q.weight 1 <- h.0.attn.q.weight 0, "
                                             "h.0.attn.q.weight 2 <- h.0.attn.q.weight 3"])}),
    ("permutation-shards", GPT2, with_grads({"h.0.attn.proj.weight": swap_rows_blocks}), {},
     {"h.0.attn.proj.weight": ("permutation", ["shards along axis 0", "[1, 0]"])}),
    ("transposed", GPT2, with_grads({"h.0.attn.proj.weight": lambda g, s: g.T}), {},
     {"h.0.attn.proj.weight": ("transposed", ["transpose"])}),
    ("swapped", GPT2, with_grads({"h.0.ln1.weight": lambda g, s: s.grads["h.0.ln2.weight"],
                                  "h.0.ln2.weight": lambda g, s: s.grads["h.0.ln1.weight"]}), {},
     {"h.0.ln1.weight": ("swapped", ["h.0.ln1", "holds", "h.0.ln2", "'s gradient"]),
      "h.0.ln2.weight": ("swapped", ["h.0.ln2", "holds", "h.0.ln1", "'s gradient"])}),
    ("fused-k-v-exchanged", LLAMA, kv_exchanged((0, 1)), {},
     {f"h.0.attn.{m}.weight": ("swapped", [f"h.0.attn.{m}.weight holds h.0.attn.{o}.weight's gradient",
                                           "fused blocks of blk0.attn.wqkv"]) for m, o in ("kv", "vk")}),
    ("fused-k-v-exchanged-on-one-rank", LLAMA, kv_exchanged((0,)), {},
     {f"h.0.attn.{m}.weight": ("permutation", ["fused blocks of blk0.attn.wqkv in another order",
                                               f"h.0.attn.{m}.weight 0 <- h.0.attn.{o}.weight 0"])
      for m, o in ("kv", "vk")}),
    ("fused-gate-up-swapped", LLAMA, at("blk0.ffn.w13", halves_exchanged), {},
     {f"h.0.mlp.{m}.weight": ("swapped", [f"h.0.mlp.{m}.weight holds h.0.mlp.{o}.weight's gradient",
                                          "fused blocks of blk0.ffn.w13"])
      for m, o in (("gate", "up"), ("up", "gate"))}),
    ("fused-gate-up-swapped-on-one-rank", LLAMA, at("blk0.ffn.w13", halves_exchanged, lambda p: p.tp_rank == 1), {},
     {f"h.0.mlp.{m}.weight": ("permutation", ["fused blocks of blk0.ffn.w13 in another order", f"h.0.mlp.{o}.weight"])
      for m, o in (("gate", "up"), ("up", "gate"))}),
    ("part-missing", TIED, tied_lookup_only, {}, {"wte": ("part missing", ["the embedding lookup's part alone"])}),
    ("fused-layout", GPT2, at("blk0.attn.wqkv", per_head), {},
     {f"h.0.attn.{m}.weight": ("fused layout", ["interleave groups, groups = 4", "(groups, 2 pieces per part)"])
      for m in "qkv"}),
    ("replicas-differ", GPT2, at("blk0.norm2.shift", lambda a, p: a * (1.1, 1.2, 1.3)[p.dp_rank]), {},
     {"h.0.ln2.bias": ("replicas differ", ["3 different values"])}),
    ("stale-replica-earlier-step", GPT2, stale(1), {},
     {n: ("stale replica", stale_words(split)) for n, split in (("ln_f.weight", False), ("h.0.attn.q.weight", True),
                                                                ("wte", True))}),
    ("stale-replica-random", LLAMA, stale(1, earlier=False), {},
     {n: ("stale replica", stale_words(split)) for n, split in (("ln_f.weight", False), ("h.0.mlp.up.weight", True))}),
    ("unreduced-replica", GPT2, unreduced_replica, {},
     {n: ("unreduced", [f"ranks {holding([2], split)} hold their own rows' gradient", "dp rank 2's rows alone"])
      for n, split in (("ln_f.weight", False), ("h.0.attn.v.weight", True), ("lm_head.weight", True))}),
    ("unreduced-only-copy", LLAMA, unreduced_only_copy, {},
     {n: ("unreduced", ["G is 1/dp x the gradient of dp rank 0's rows alone"])
      for n in ("ln_f.weight", "h.0.attn.k.weight", "wte")}),
    ("no-simple-pattern", GPT2, with_grads({"h.0.mlp.fc.weight": noise}), {},
     {"h.0.mlp.fc.weight": ("no simple pattern", ["in no pattern tried"])}),
    ("wrong-group", MOE, place_mean, {},
     {f"h.0.moe.experts.{e}.{m}.weight": ("wrong group", ["averaged over the wrong group"])
      for e in range(4) for m in ("gate", "proj")}),
    ("balance-domain", MOE, balance_per_rank, {},
     {"h.0.moe.router.weight": ("balance domain", ["each rank's rows instead of the declared domain (global)"])}),
    ("2d-padding", GPT2, at("blk0.attn.wo", pad_at, lambda p: p.dp_rank == DP - 1), {"two_d": True},
     {"h.0.attn.proj.weight": ("padding", ["padded entries carry gradient"])}),
    ("2d-constant-factor", LLAMA, at("blk0.ffn.w13", lambda a, p: a / DP), {"two_d": True},
     {f"h.0.mlp.{m}.weight": ("constant factor", ["= 1/dp:"]) for m in ("gate", "up")}),
    ("2d-fused-k-v-exchanged-on-one-rank", LLAMA, kv_exchanged((1,)), {"two_d": True, "safetensors": True},
     {f"h.0.attn.{m}.weight": ("permutation", ["fused blocks of blk0.attn.wqkv in another order",
                                               f"h.0.attn.{m}.weight 1 <- h.0.attn.{o}.weight 1"])
      for m, o in ("kv", "vk")}),
]


@pytest.mark.parametrize("cfg, bug, options, expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_kind_of_bug_is_named(tmp_path, cfg, bug, options, expect):
    """The planted bug's parameters fail with its class and its words; with the experts averaged over the wrong
    group every dense parameter passes."""
    s = step(cfg)
    write(tmp_path, s, **{**options, **bug(s)})
    code, rows, _ = verdict(tmp_path)
    assert code == 1
    for name, (cls, words) in expect.items():
        row = rows[name]
        assert not row["ok"] and row["class"] == cls, (name, row["class"], row["detail"])
        for w in words:
            assert w in row["detail"], (name, w, row["detail"])
    if bug is place_mean:
        assert all(r["ok"] for n, r in rows.items() if ".moe.experts." not in n), "a dense parameter fails"

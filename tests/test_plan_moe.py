"""The planner prices mixture-of-experts models (hsgd.plan.experts, and its uses in costs, paper, search, __main__):

  1. total and active parameters: the formula (sympy) and its value equal ModelConfig.n_params() and
     n_active_params() on every family (gelu and swiglu experts, biases, moe_every 1..3); what a rank holds adds up
     to n_params at tp = ep = 1, and each expert splits over tp as the dense MLP; Mixtral 8x7B's preset has the
     published 47 B parameters and 13 B active (Jiang et al. 2024, "Mixtral of Experts");
  2. FLOPs: the planner's per micro-batch summed over stages and micro-batches equal ModelConfig.step_flops (the
     router replicated over tp: (tp - 1) more routers at tp > 1);
  3. memory per rank: the experts' parameters, gradients and optimizer state fall as 1/ep without ZeRO and stay
     put with ZeRO-3 (sharded over edp = D/ep: E/ep experts x 1/edp = E/D); a MoE block's activations are the
     docstring's table;
  4. the all-to-all: bytes per step equal the spec's 4 N k C s + 8 ep per MoE block and micro-batch (6 N k C s +
     2 x 8 ep with full recomputation), priced in the step time, and on the link an exact enumeration of the
     process grid's ep groups says they cross;
  5. the search: where the experts do not fit otherwise, every layout that fits has ep > 1;
  6. a dense model is priced exactly as before the experts came (the previous planner's numbers), and a MoE model's
     stage without MoE blocks exactly as the dense model's;
  7. the command line: --moe-experts and --moe-top-k print total and active parameters and ep; bad inputs exit 2.

    PATH=$PWD/.venv/bin:$PATH python -m pytest -q tests/test_plan_moe.py -s      # -s shows the numbers
"""
import dataclasses
import itertools
import re

import pytest

from hsgd.accounting.activations import paper_zero_bytes
from hsgd.model.config import ModelConfig
from hsgd.plan import costs
from hsgd.plan.experts import (alltoall_calls, alltoall_formula, expert_formula, kept_bytes, moe_formula,
                               param_counts, rank_numel)
from hsgd.plan.family import megatron_numel
from hsgd.plan.hardware import load
from hsgd.plan.models import presets
from hsgd.plan.paper import activation_bytes
from hsgd.plan.search import Layout, evaluate, search
from hsgd.pp.chunks import split_layers

from tests.test_plan_llama import run                  # python -m hsgd.plan in this process

# a small MoE model: swiglu experts, every other block MoE (blocks 0, 2), 8 experts top-2
SMALL = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4, d_ff=48, arch="llama",
                    moe_experts=8, moe_top_k=2, moe_every=2)
HW = load("a100-80g")


# ------------------------------------------------------------------------------------ 1. parameters
def test_parameter_formulas_are_model_configs():
    """(a) With symbols: P - P_active = L_moe (E - k) X, and a MoE model with E = k = 1 and no router is the dense
    one. (b) param_counts(cfg) = (n_params(), n_active_params()) on 72 configurations: layernorm or rmsnorm, gelu or
    swiglu experts, biases or not, moe_every 1, 2, 3, (E, k) = (4, 1), (4, 2), (3, 3), plus a dense one. (c) At tp =
    ep = 1 a rank holds n_params: embedding + the dense and MoE blocks + their experts + head; at tp = 2, 4 an
    expert's share is (X - b C)/tp + b C (proj's bias whole). (d) Mixtral 8x7B: 47 B parameters, 13 B active."""
    sympy = pytest.importorskip("sympy")
    P, L, C, F, E, k, m, b = sympy.symbols("P L C F E k m b", positive=True)
    X = expert_formula(C, F, m, b)
    total, active = moe_formula(P, L, C, E, k, X)
    gap = sympy.expand(total - active - L * (E - k) * X)
    single = sympy.expand(moe_formula(P, L, C, 1, 1, X)[0] - L * C - P)
    checked = 0
    for norm, mlp, bias, every, (nE, nk) in itertools.product(("layernorm", "rmsnorm"), ("gelu", "swiglu"),
                                                             (True, False), (1, 2, 3), ((4, 1), (4, 2), (3, 3))):
        cfg = ModelConfig(vocab_size=37, seq_len=9, d_model=16, n_heads=4, n_layers=5, d_ff=24, norm=norm, mlp=mlp,
                          bias=bias, moe_experts=nE, moe_top_k=nk, moe_every=every)
        assert param_counts(cfg) == (cfg.n_params(), cfg.n_active_params()), cfg
        per, moe = megatron_numel(cfg, 1), rank_numel(cfg, 1, 1)
        held = per["embedding"] + per["head"] + sum(moe["moe"] + moe["experts"] if cfg.is_moe(i) else per["h"]
                                                    for i in range(cfg.n_layers))
        assert held == cfg.n_params(), (cfg, held)
        for tp in (2, 4):
            x = expert_formula(16, 24, 2 if mlp == "gelu" else 3, int(bias))
            assert rank_numel(cfg, tp, 1)["experts"] == nE * ((x - bias * 16) // tp + bias * 16), (cfg, tp)
        checked += 1
    dense = ModelConfig(arch="llama")
    assert param_counts(dense) == (dense.n_params(), dense.n_params())
    mixtral = presets()["mixtral-8x7b"]
    t, a = param_counts(mixtral)
    print(f"P - P_active - L (E - k) X = {gap}; E = k = 1 less the router - dense = {single}; param_counts = "
          f"ModelConfig's on {checked} MoE configurations; Mixtral 8x7B {t / 1e9:.4g} B, {a / 1e9:.4g} B active")
    assert gap == 0 and single == 0 and checked == 72
    assert (round(t / 1e9), round(a / 1e9)) == (47, 13) and (t, a) == (mixtral.n_params(), mixtral.n_active_params())


# ------------------------------------------------------------------------------------ 2. FLOPs
@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_planner_flops_are_step_flops(mlp):
    """On one device's share (tp = cp = 1, stored scores), F + B + W of a micro-batch summed over pp stages (their
    MoE blocks) and m micro-batches equals ModelConfig.step_flops(B, recompute) exactly, for each recomputation; at
    tp = 2, tp times a rank's is that plus (tp - 1) routers: 6 B T C E per MoE block (8 with full recomputation)."""
    cfg = dataclasses.replace(SMALL, mlp=mlp, moe_every=1 if mlp == "gelu" else 2)
    B, b = 6, 2
    for recompute, pp, tp in itertools.product(("none", "selective", "full"), (1, 2, 4), (1, 2)):
        total = 0.0
        for s, layers in enumerate(split_layers(cfg.n_layers, pp)):
            n_moe = sum(cfg.is_moe(i) for i in layers)
            f, bwd, w = costs.micro_batch_flops(cfg, b, tp, 1, len(layers), s == pp - 1, recompute, n_moe=n_moe)
            total += (B // b) * (f + bwd + w) * tp
        router = len(cfg.moe_layers()) * (8 if recompute == "full" else 6) * B * cfg.seq_len * cfg.d_model * 8
        want = cfg.step_flops(B, recompute) + (tp - 1) * router
        assert total == want, (mlp, recompute, pp, tp, total, want)
    print(f"{mlp} experts, MoE blocks {cfg.moe_layers()}: planner FLOPs = step_flops (+ the replicated routers), "
          f"e.g. {cfg.step_flops(B) / 1e6:.4g} MFLOP")


# ------------------------------------------------------------------------------------ 3. memory
def test_expert_memory_falls_as_one_over_ep():
    """dp 8, tp 1: without ZeRO the experts' params, grads and optimizer state times ep are the same at ep = 1, 2,
    4, 8 (ep = 1: 2, 2 and 12 bytes x L_moe E X), the dense categories and the activations do not change (uniform
    routing: R = N k rows whatever ep); with ZeRO-3 the expert states are paper_zero_bytes(L_moe E X, D) at every ep.
    At tp = 2 they are half of tp = 1's. A MoE block's activations less a dense one's are 4 N E + 2 x 2 S C + 6 S F/t
    - 6 N F/t (swiglu, S = N k)."""
    L_moe, E = len(SMALL.moe_layers()), SMALL.moe_experts
    X = expert_formula(SMALL.d_model, SMALL.d_ff, 3, 0)
    worst = 0.0
    for zero in (0, 3):
        base = None
        for ep in (1, 2, 4, 8):
            mem = evaluate(SMALL, 16, Layout(dp=8, pp=1, tp=1, m=2, zero=zero, ep=ep), HW).memory
            experts = {k: v for k, v in mem.items() if k.startswith("expert")}
            dense = {k: v for k, v in mem.items() if not k.startswith("expert")}
            scaled = {k: v * (ep if zero == 0 else 1) for k, v in experts.items()}
            base = base or (scaled, dense)
            worst = max(worst, max(abs(scaled[k] / base[0][k] - 1) for k in scaled))
            assert scaled == base[0] and dense == base[1], (zero, ep, mem)
            print(f"zero {zero} ep {ep}: " + ", ".join(f"{k} {v:.0f} B" for k, v in experts.items()))
        psi = L_moe * E * X                                       # the experts' elements, all of them
        want = (2 * psi, 2 * psi, 12 * psi) if zero == 0 else (2 * psi / 8, 2 * psi / 8, 12 * psi / 8)
        assert zero == 0 or sum(want) == paper_zero_bytes(psi, 8, 3)
        assert tuple(base[0].values()) == want, (zero, base[0], want)
    half = evaluate(SMALL, 16, Layout(dp=4, pp=1, tp=2, m=2, ep=2), HW).memory
    whole = evaluate(SMALL, 16, Layout(dp=8, pp=1, tp=1, m=2, ep=2), HW).memory
    assert all(half[k] * 2 == whole[k] for k in ("expert params", "expert grads", "expert optimizer"))
    N, C, F, t = 2 * SMALL.seq_len, SMALL.d_model, SMALL.d_ff, 2
    table = 4 * N * E + 2 * 2 * (N * 2) * C + 6 * (N * 2) * F / t           # router, dispatched + outputs, hidden
    err = 0.0
    for seq in (False, True):
        extra = activation_bytes(SMALL, 2, t, seq, "none", moe=True) - activation_bytes(SMALL, 2, t, seq, "none")
        err = max(err, abs(extra - (table - 6 * N * F / t)) / table)
    assert kept_bytes(SMALL, N, t) == table and err <= 1e-12, err
    print(f"expert states x ep constant without ZeRO (max relative change {worst:.1e}), constant with ZeRO-3; a MoE "
          f"block's activations - a dense one's = the table less the MLP's, max relative error {err:.1e}")


# ------------------------------------------------------------------------------------ 4. the all-to-all
def node_crossing(lay, per_node):
    """Whether some ep group of the process grid has ranks on two nodes of per_node consecutive ranks: rank =
    ((dp_rank pp + pp_rank) cp + cp_rank) tp + tp_rank; an ep group is ep consecutive dp_comm keys dp_rank cp + cp_rank
    at the same (pp_rank, tp_rank)."""
    for p, t, key0 in itertools.product(range(lay.pp), range(lay.tp), range(0, lay.dp * lay.cp, lay.ep)):
        ranks = [((key // lay.cp * lay.pp + p) * lay.cp + key % lay.cp) * lay.tp + t for key in range(key0,
                                                                                                     key0 + lay.ep)]
        if len({r // per_node for r in ranks}) > 1:
            return True
    return False


def test_alltoall_bytes_are_the_spec_and_cross_the_right_link():
    """(a) dp 4, cp 2, tp 2, ep 4, b 2, m 2: the step's ("ep", "Alltoallv") bytes are m L_moe 4 N k C s (6 with full
    recomputation), N = b T/cp, ("ep", "Alltoall") m L_moe 8 ep (twice with full), and the step time's ep part is
    those calls priced by costs.collective on the ep link (forward and backward, the forward again with full); ep = 1
    has no all-to-all. (b) For every dp x pp x cp x tp of 8, 16, 24, 32, 48, 64 devices (cp <= 4), ep dividing dp cp,
    group_links puts the ep group inside a node exactly when no ep group of the grid crosses one (where ep and cp do
    not divide each other and pp > 1 the planner takes the cross-node link: it never claims a node wrongly)."""
    N, k, C, s, m = 2 * SMALL.seq_len // 2, SMALL.moe_top_k, SMALL.d_model, 2, 2
    L_moe = len(SMALL.moe_layers())
    for rc, again in (("none", 1), ("full", 2)):
        lay = Layout(dp=4, pp=1, tp=2, cp=2, b=2, m=m, ep=4, recompute=rc)
        e = evaluate(SMALL, 16, lay, HW)
        want = {("ep", "Alltoallv"): (m * L_moe * (2 + 2 * again), m * L_moe * (2 + 2 * again) * N * k * C * s),
                ("ep", "Alltoall"): (m * L_moe * again, m * L_moe * again * 8 * 4)}
        got = {key: v for key, v in e.bytes[0].items() if key[0] == "ep"}
        assert got == want == alltoall_formula(SMALL, lay, L_moe), (rc, got, want)
        link = costs.group_links(lay, HW, SimpleExchange())["ep"]
        fwd, bwd = alltoall_calls(SMALL, 2, 2, 4, s)
        price = sum(costs.collective(op, nb, 4, link, HW) for op, nb in fwd)
        price = m * L_moe * (again * price + sum(costs.collective(op, nb, 4, link, HW) for op, nb in bwd))
        assert abs(e.time.ep - price) <= 1e-12 * price and e.time.parts()["ep all-to-all"] == e.time.ep, rc
        print(f"recompute {rc}: {got}, ep time {e.time.ep * 1e6:.4g} us on the {link.name} link")
    one = evaluate(SMALL, 16, Layout(dp=8, pp=1, tp=1, m=2, ep=1), HW)
    assert not any(c in ("ep", "edp") for c, _ in one.bytes[0]) and one.time.ep == 0.0
    cases = agree = 0
    for n in (8, 16, 24, 32, 48, 64):
        for pp, cp, tp in itertools.product((1, 2, 4, 8), (1, 2, 3, 4), (1, 2, 4, 8)):
            if n % (pp * cp * tp):
                continue
            dp = n // (pp * cp * tp)
            for ep in (e for e in range(2, dp * cp + 1) if dp * cp % e == 0):
                lay = Layout(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep)
                inside = costs.group_links(lay, HW, SimpleExchange())["ep"] is HW.intra
                crosses = node_crossing(lay, HW.devices_per_node)
                assert not (inside and crosses), lay
                unaligned = pp > 1 and cp % ep and ep % cp
                assert unaligned or inside == (not crosses), (lay, inside, crosses)
                cases, agree = cases + 1, agree + (inside == (not crosses))
    print(f"ep link: {agree} of {cases} (dp, pp, cp, tp, ep) agree with the enumeration; {cases - agree} unaligned "
          "groups within a node the planner puts on the cross-node link")
    assert agree > 0


class SimpleExchange:
    """An exchange with no communicators of its own (group_links reads only comms())."""

    def comms(self):
        return {}


def test_collective_prices_the_alltoall():
    """Alltoall: the cheaper of pairwise exchange (p - 1) alpha + (p - 1)/p n beta and Bruck's ceil(log2 p) (alpha +
    n/2 beta) (Thakur et al. 2005); Alltoallv: pairwise only."""
    link = HW.inter
    a, beta = link.latency, 1 / link.bandwidth
    for p, n in ((8, 64), (8, 1e9), (6, 1e3)):
        lg = (p - 1).bit_length()
        pair, bruck = (p - 1) * a + (p - 1) / p * n * beta, lg * (a + n / 2 * beta)
        assert costs.collective("Alltoall", n, p, link) == min(pair, bruck)
        assert costs.collective("Alltoallv", n, p, link) == pair
    print(f"8 ranks: 64 B {costs.collective('Alltoall', 64, 8, link) * 1e6:.3g} us (Bruck), 1 GB "
          f"{costs.collective('Alltoall', 1e9, 8, link) * 1e3:.4g} ms (pairwise)")


# ------------------------------------------------------------------------------------ 5. the search
def test_search_picks_ep_when_the_experts_do_not_fit_otherwise():
    """Mixtral 8x7B at T = 4096 on 64 H100s, tp 8, pp 1, no ZeRO: at ep = 1 a rank holds 1/8 of all its parameters'
    16 bytes and nothing fits; the search over ep finds layouts, every one with ep > 1."""
    cfg, hw = dataclasses.replace(presets()["mixtral-8x7b"], seq_len=4096), load("h100-80g")
    space = {"tp": [8], "pp": [1], "zero": [0], "b": [1]}
    none, tried, dropped = search(cfg, 256, 64, hw, dict(space, ep=[1]))
    found, tried_all, _ = search(cfg, 256, 64, hw, space)
    eps = sorted({e.layout.ep for e in found})
    print(f"ep = 1: {tried} tried, dropped {dropped}; all ep: {tried_all} tried, {len(found)} fit, with ep in {eps}; "
          f"best {found[0].layout.name()} at {sum(found[0].memory.values()) / 2**30:.2f} GiB")
    assert not none and dropped == {"does not fit in memory": tried} and found and min(eps) > 1


# ------------------------------------------------------------------------------------ 6. dense models unchanged
# The planner's numbers for three dense layouts before the experts came (hsgd.plan at commit a1a9d6d, with the same
# ModelConfig and hardware files): memory by category, step time and bytes per link. A deliberate change to the
# dense model of time or memory changes them here too.
BEFORE = [
    ("hsgd-small", 8, "a100-80g", dict(tp=2, pp=2, dp=2, m=2, b=2, zero=1, tp_scheme="sequence"),
     {'params': 70848.0, 'grads': 70848.0, 'optimizer': 212544.0, 'activations': 180224.0}, 0.00011405268369774452,
     {'intra-node': 356224}),
    ("llama-small", 8, "h100-80g", dict(tp=2, pp=1, dp=2, cp=2, m=4, zero=3, recompute="full"),
     {'params': 39072.0, 'grads': 39072.0, 'optimizer': 234432.0, 'activations': 12288.0, 'recompute': 24576.0},
     0.00040411364476888894, {'intra-node': 2031488}),
    ("llama3-70b", 512, "h100-80g", dict(tp=8, pp=4, dp=2, m=256, schedule="interleaved", v=2, zero=1,
                                         tp_scheme="sequence", attention="flash"),
     {'params': 4541513728.0, 'grads': 4541513728.0, 'optimizer': 13624541184.0, 'activations': 30940856320.0},
     48.51083415904785, {'intra-node': 6940834922496, 'inter-node': 21967929344})]


@pytest.mark.parametrize("name, batch, hw, layout, memory, seconds, links", BEFORE, ids=[b[0] for b in BEFORE])
def test_dense_models_are_priced_as_before(name, batch, hw, layout, memory, seconds, links):
    """A dense model's memory, step time and bytes per link are exactly the previous planner's; its time has no ep
    part and its bytes no ep or edp communicator."""
    e = evaluate(presets()[name], batch, Layout(**layout), load(hw))
    print(f"{name} {e.layout.name()}: {sum(e.memory.values()):.6g} B, {e.time.total!r} s, {e.links}")
    assert e.memory == memory and e.time.total == seconds and e.links == links
    assert "ep all-to-all" not in e.time.parts() and not any(c in ("ep", "edp") for s in e.bytes.values() for c, _ in s)


def test_a_stage_without_moe_blocks_is_the_dense_models():
    """SMALL on pp 4 (one block a stage, blocks 0 and 2 MoE): the bytes of stage 3 (block 3, dense, and the head)
    equal those of the same model without experts; stage 0's hold the experts' exchange over edp and the all-to-all,
    and its memory the experts."""
    dense = dataclasses.replace(SMALL, moe_experts=0)
    lay = Layout(dp=2, pp=4, tp=1, m=4, ep=2)
    moe, plain = evaluate(SMALL, 8, lay, HW), evaluate(dense, 8, dataclasses.replace(lay, ep=1), HW)
    assert moe.bytes[3] == plain.bytes[3] and moe.stage == 0 and "expert params" in moe.memory
    assert ("ep", "Alltoallv") in moe.bytes[0] and ("edp", "Allreduce") in moe.bytes[0]
    print(f"stage 3: {moe.bytes[3]}")


# ------------------------------------------------------------------------------------ 7. the command line
def test_cli_prices_experts():
    """--model llama-small --moe-experts 8 --moe-top-k 2 --ep 2 on 8 devices: total and active parameters
    (ModelConfig's), the experts line, ep2 in every ranked layout's name, Megatron-LM's --num-experts and
    --expert-model-parallel-size, torchtitan's expert_parallel_degree, the experts' --explain line; --help explains
    the flags; the mixtral preset prints its counts."""
    code, out, err = run("--model", "llama-small", "--moe-experts", "8", "--moe-top-k", "2", "--devices", "8",
                         "--batch", "16", "--top", "3", "--explain", "--ep", "2")
    assert code == 0, err
    cfg = dataclasses.replace(presets()["llama-small"], moe_experts=8, moe_top_k=2)
    total, active = cfg.n_params(), cfg.n_active_params()
    for words in (f"{total / 1e9:.4g} B parameters ({active / 1e9:.4g} B active per token)",
                  "8 experts top-2 in every block", "experts: 2 MoE blocks of 8 experts; ep tried",
                  "--num-experts 8 --moe-router-topk 2", "--expert-model-parallel-size", "expert_parallel_degree",
                  "[memory] experts:"):
        assert words in out, (words, out)
    rows = [line for line in out.splitlines() if line.startswith(("  1 dp", "  2 dp", "  3 dp"))]
    assert len(rows) == 3 and all(re.match(r"\s+\d dp\d+ pp\d+ tp\d+ ep2,", r) for r in rows), rows
    code, help_text, _ = run("--help")
    assert code == 0 and all(w in help_text for w in ("--moe-experts", "--moe-top-k", "--ep", "active parameters"))
    code, mix, err = run("--model", "mixtral-8x7b,T=4096", "--devices", "64", "--batch", "256", "--hw", "h100-80g",
                         "--tp", "8", "--pp", "1", "--zero", "0", "--micro-batch", "1", "--top", "1")
    assert code == 0 and "46.7 B parameters (12.88 B active per token)" in mix, err
    print("\n".join(line for line in out.splitlines() if line.startswith(("model", "family", "experts", "  1 dp"))))


BAD = [(("--model", "llama-small", "--moe-top-k", "2"), ["--moe-top-k", "add --moe-experts"]),
       (("--model", "llama-small", "--ep", "2"), ["--ep", "add --moe-experts"]),
       (("--model", "llama-small", "--moe-experts", "4", "--moe-top-k", "5"), ["moe_top_k=5", "from 1 to 4"]),
       (("--model", "llama-small", "--moe-experts", "8", "--impl", "hsgd"), ["--impl megatron"]),
       (("--model", "llama-small", "--moe-experts", "-1"), ["at least 0"])]


@pytest.mark.parametrize("argv, words", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_cli_bad_expert_inputs(argv, words):
    """Each exits 2 with one line that says what is wrong and what would work."""
    code, out, err = run(*argv)
    print(f"exit {code}: {err.strip()}")
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("hsgd: error:"), (code, err)
    assert all(w in err for w in words), (words, err)

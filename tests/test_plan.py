"""hsgd.plan, the planner, checked against what it claims to compute:

  1. costs.makespan's closed form (m v + p - 1)(f + b + w) equals the schedule simulator for gpipe, 1f1b and
     interleaved;
  2. hsgd.model.config.gpt_step_flops is Narayanan et al. (2021)'s FLOPs, and hsgd's parameter count their P (sympy);
  3. the Table 1 rows (narayanan2021.csv) agree with themselves: parameters, aggregate PFLOP/s, % of peak, grid;
  4. paper.activation_bytes is Korthikanti et al. (2022)'s Table 2 and paper.stage_memory ZeRO's model states;
  5. --impl hsgd prices each layout with hsgd.plan.layout.plan_rank (which tests/mpi/test_plan_layout.py holds
     equal to the trainer), and search covers every factorization of 8 devices, sorted by time;
  6. monotonic: a faster network never slows a layout, a bigger batch takes longer, MFU is in (0, 1];
  7. the command line: usage errors exit 2 with one line that names the fix; a good run prints and writes JSON;
  8. the V and dual schedules (zb-v, dualpipev, dualpipe): their makespans are the schedules' closed forms, the
     search offers them only where they apply, DualPipe holds and sends twice one copy's parameters, the V's turn
     on its last stage sends nothing.

    PATH=$PWD/.venv/bin:$PATH python -m pytest -q tests/test_plan.py -s      # -s shows the numbers each test saw

Legend: l (L) layers, h (C) width, F d_ff, V vocabulary, s (T) sequence, a heads, B batch, b micro-batch,
t (tp) tensor-parallel ranks, p (pp) stages, m micro-batches, v chunks per stage, Nd data-parallel ranks.
"""
import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from hsgd.errors import ConfigError
from hsgd.model.config import ModelConfig, gpt_step_flops
from hsgd.grid.process_grid import factorizations
from hsgd.accounting.activations import paper_table2, paper_zero_bytes
from hsgd.plan import costs
from hsgd.plan.__main__ import presets
from hsgd.plan.hardware import load
from hsgd.plan.layout import plan_rank
from hsgd.plan.paper import activation_bytes, hsgd_params_as_paper, paper_params, stage_memory, table1
from hsgd.plan.search import Layout, evaluate, layouts, search
from hsgd.pp.timelines import peak_formula

from .test_plan_hardware import GOOD

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))       # the repository root, for the CLI

# a model that splits over tp up to 8 and pp up to 8 (V % tp != 0 on purpose, as in tests/mpi/test_plan_layout.py)
SMALL = ModelConfig(vocab_size=61, seq_len=16, d_model=16, n_heads=8, n_layers=8, d_ff=32)


# ------------------------------------------------------------------------------------ 1. the pipeline's makespan
def test_makespan_closed_form_equals_the_simulator():
    """For every stage costing (f, b, w) per chunk action, the simulated makespan of gpipe and 1f1b (v = 1) and of
    interleaved (v = 2, 3; m a multiple of p) is (m v + p - 1)(f + b + w), to 1e-9 relative, for p = 2..8,
    m = 1..12 and five cost triples (equal, no W, unequal in both orders, a heavy backward)."""
    triples = [(1.0, 1.0, 1.0), (1.0, 2.0, 0.0), (0.3, 0.5, 0.4), (2.0, 1.0, 0.5), (1.0, 3.0, 1.7)]
    cases, worst = 0, 0.0
    for kind in ("gpipe", "1f1b", "interleaved"):
        for p in range(2, 9):
            for m in range(1, 13):
                for v in ((2, 3) if kind == "interleaved" else (1,)):
                    if kind == "interleaved" and m % p:
                        continue
                    for f, b, w in triples:
                        closed = costs.makespan(kind, m, p, v, f, b, w, simulated=False)
                        sim = costs.makespan(kind, m, p, v, f, b, w, simulated=True)
                        err = abs(closed - sim) / sim
                        worst = max(worst, err)
                        cases += 1
                        assert err <= 1e-9, f"{kind} m={m} p={p} v={v} {(f, b, w)}: closed {closed} simulated {sim}"
    print(f"{cases} (kind, m, p, v, costs) cases: closed form = simulation, max relative error {worst:.2e}")
    assert cases > 500


# ------------------------------------------------------------------------------------ 2. FLOPs and parameters
def test_step_flops_are_narayanans_symbolically():
    """gpt_step_flops(B, s, h, 4h, V, l) as a polynomial in symbols: with full recomputation it is Narayanan et al.
    (2021)'s 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) and without it 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) (3/4 of
    theirs: one forward fewer per block); selective adds the attention's forward again, 4 B s^2 h per layer."""
    sympy = pytest.importorskip("sympy")
    B, s, h, V, l = sympy.symbols("B s h V l", positive=True)
    full = sympy.expand(gpt_step_flops(B, s, h, 4 * h, V, l, "full") - 96 * B * s * l * h ** 2 * (
        1 + s / (6 * h) + V / (16 * l * h)))
    none = sympy.expand(gpt_step_flops(B, s, h, 4 * h, V, l, "none") - 72 * B * s * l * h ** 2 * (
        1 + s / (6 * h) + V / (12 * l * h)))
    selective = sympy.expand(gpt_step_flops(B, s, h, 4 * h, V, l, "selective")
                             - gpt_step_flops(B, s, h, 4 * h, V, l, "none") - 4 * B * s ** 2 * h * l)
    print(f"full - Narayanan = {full}; none - 72 B s l h^2 (...) = {none}; selective - none - 4 B s^2 h l = "
          f"{selective}")
    assert full == 0 and none == 0 and selective == 0


def hsgd_params(L, C, F, V, T):
    """hsgd's parameter count by hand from ModelConfig.param_shapes: per block LN1, LN2 (2C each), q, k, v, proj
    (C^2 + C each), fc (CF + F), proj (FC + C): 4C^2 + 2CF + F + 9C; wte VC, wpe TC, ln_f 2C, lm_head CV."""
    return L * (4 * C ** 2 + 2 * C * F + F + 9 * C) + 2 * V * C + T * C + 2 * C


def test_parameter_count_is_narayanans():
    """(a) The hand-written hsgd_params equals ModelConfig.n_params() on 24 configs with F != 4C too, so the
    polynomial below is the code's. (b) Symbolically, Narayanan et al.'s P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h))
    expands to l (12 h^2 + 13 h) + V h + s h, which is hsgd_params at F = 4C less the untied head VC and ln_f's 2C.
    (c) paper.hsgd_params_as_paper(cfg) equals paper_params(l, h, V, s) on a grid of 3 x 4 x 2 x 2 integer
    points (l, h, V, s): both sides are polynomials of degree at most (1, 2, 1, 1) in those variables, and two
    such polynomials that agree on a grid with one more point per variable than its degree are equal."""
    sympy = pytest.importorskip("sympy")
    checked = 0
    for L in (1, 3):
        for C, NH in ((4, 2), (6, 3), (12, 4)):
            for F, V, T in ((7, 5, 3), (4 * C, 11, 9), (20, 13, 2), (C, 2, 17)):
                cfg = ModelConfig(vocab_size=V, seq_len=T, d_model=C, n_heads=NH, n_layers=L, d_ff=F)
                assert hsgd_params(L, C, F, V, T) == cfg.n_params(), cfg
                checked += 1
    l, h, V, s = sympy.symbols("l h V s", positive=True)
    paper = 12 * l * h ** 2 * (1 + sympy.Rational(13, 12) / h + (V + s) / (12 * l * h))
    gap_poly = sympy.expand(paper - (l * (12 * h ** 2 + 13 * h) + V * h + s * h))
    gap_hsgd = sympy.expand(paper - (hsgd_params(l, h, 4 * h, V, s) - V * h - 2 * h))
    worst, points = 0.0, 0
    for L in (1, 2, 3):
        for C in (1, 2, 3, 5):
            for Vn in (1, 7):
                for T in (1, 5):
                    cfg = ModelConfig(vocab_size=Vn, seq_len=T, d_model=C, n_heads=1, n_layers=L, d_ff=4 * C)
                    ours, theirs = hsgd_params_as_paper(cfg), paper_params(L, C, Vn, T)
                    worst = max(worst, abs(ours - theirs) / theirs)
                    points += 1
    print(f"hand-written count = n_params() on {checked} configs; P - l(12h^2 + 13h) - Vh - sh = {gap_poly}; "
          f"P - (hsgd's at F = 4C - VC - 2C) = {gap_hsgd}; hsgd_params_as_paper vs paper_params on {points} points: "
          f"max relative error {worst:.2e} (paper_params computes in floats)")
    assert gap_poly == 0 and gap_hsgd == 0 and worst <= 1e-12


# ------------------------------------------------------------------------------------ 3. Table 1
def test_table1_rows_agree_with_themselves():
    """Each row of Narayanan et al. (2021)'s Table 1: paper_params(layers, hidden, 51200, 2048) rounds to its
    params_billion (to 0.1 B; 1008.0 to 1 B); tflops_per_gpu x gpus / 1000 is within 1% of aggregate_pflops;
    tflops_per_gpu / 312 x 100 is within 1 point of percent_of_peak; t x p divides gpus and dp divides the batch;
    the preset built from the row has its heads, hidden and layers."""
    rows = table1()
    worst_agg, worst_pct, worst_p = 0.0, 0.0, 0.0
    for r in rows:
        billions = paper_params(r["layers"], r["hidden"], 51200, 2048) / 1e9
        tol = 0.5 if r["params_billion"] >= 1000 else 0.05
        worst_p = max(worst_p, abs(billions - r["params_billion"]) / tol)
        assert abs(billions - r["params_billion"]) <= tol + 1e-9, (r["params_billion"], billions)
        agg = r["tflops_per_gpu"] * r["gpus"] / 1000
        worst_agg = max(worst_agg, abs(agg / r["aggregate_pflops"] - 1))
        assert abs(agg / r["aggregate_pflops"] - 1) <= 0.01, (r["params_billion"], agg, r["aggregate_pflops"])
        pct = r["tflops_per_gpu"] / 312 * 100
        worst_pct = max(worst_pct, abs(pct - r["percent_of_peak"]))
        assert abs(pct - r["percent_of_peak"]) <= 1.0, (r["params_billion"], pct, r["percent_of_peak"])
        assert r["gpus"] % (r["t"] * r["p"]) == 0, r
        assert r["batch"] % (r["gpus"] // (r["t"] * r["p"])) == 0, r
        cfg = r["cfg"]
        assert (cfg.n_heads, cfg.d_model, cfg.n_layers, cfg.d_ff) == (r["heads"], r["hidden"], r["layers"],
                                                                        4 * r["hidden"])
    print(f"{len(rows)} rows: parameters off by at most {worst_p:.2f} of the rounding half-step; aggregate "
          f"PFLOP/s max relative error {worst_agg:.2%}; % of peak max error {worst_pct:.2f} points")
    assert len(rows) == 10


# ------------------------------------------------------------------------------------ 4. Korthikanti, ZeRO
# Korthikanti et al. (2022), Table 2 in units of s b h: tp 10 + 24/t + 5as/(ht); tp+sp 34/t + 5as/(ht);
# selective (with sp) 34/t; full 2. For GPT-3 175B (5as/h = 80, t = 8): 23, 14.25, 4.25, 2, the paper's numbers;
# for MT-NLG 530B (s = 2048, h = 20480, a = 128: 5as/h = 64, t = 8): 21, 12.25, 4.25, 2.
SHAPES = [(dict(seq_len=2048, d_model=12288, n_heads=96), 1, 8, {"tp": 23, "tp+sp": 14.25, "selective": 4.25,
                                                                  "full": 2}),
          (dict(seq_len=2048, d_model=20480, n_heads=128), 2, 8, {"tp": 21, "tp+sp": 12.25, "selective": 4.25,
                                                                   "full": 2})]


@pytest.mark.parametrize("shape, b, t, per_sbh", SHAPES, ids=["gpt3-175b", "mt-nlg-530b"])
def test_activation_bytes_are_korthikanti_table2(shape, b, t, per_sbh):
    """paper.activation_bytes(cfg, b, t, sequence, recompute) equals hsgd.accounting.activations.paper_table2's row of
    those settings, and both equal the paper's numbers written by hand above (in s b h): tp (no sp, no recomputation),
    tp+sp, selective with sp, full without sp; full with sp is the input's T-shard, 2 s b h / t; selective
    without sp keeps the replicated s b h (10 + 24/t); with cp = 2 every row is the one of s/2 positions."""
    cfg = ModelConfig(vocab_size=51200, n_layers=2, d_ff=4 * shape["d_model"], **shape)
    s, h, a = cfg.seq_len, cfg.d_model, cfg.n_heads
    sbh = s * b * h
    rows = paper_table2(s, b, h, a, t)
    got = {"tp": activation_bytes(cfg, b, t, False, "none"), "tp+sp": activation_bytes(cfg, b, t, True, "none"),
           "selective": activation_bytes(cfg, b, t, True, "selective"),
           "full": activation_bytes(cfg, b, t, False, "full")}
    worst = 0.0
    for k, v in got.items():
        worst = max(worst, abs(v - rows[k]) / rows[k], abs(v - per_sbh[k] * sbh) / (per_sbh[k] * sbh))
    assert worst <= 1e-12, (got, rows, per_sbh)
    assert activation_bytes(cfg, b, t, True, "full") == rows["full"] / t
    assert abs(activation_bytes(cfg, b, t, False, "selective") - sbh * (10 + 24 / t)) <= 1e-12 * sbh
    half = paper_table2(s // 2, b, h, a, t)
    assert activation_bytes(cfg, b, t, True, "none", cp=2) == half["tp+sp"]
    print(f"{shape} b={b} t={t}: per layer in s b h " + ", ".join(f"{k} {v / sbh:g}" for k, v in got.items())
          + f"; max relative error against Table 2 {worst:.2e}")


# ZeRO (Rajbhandari et al. 2020), Figure 1: psi = 7.5 B parameters, Nd = 64, K = 12 -> 120, 31.4, 16.6, 1.88 GB
ZERO_FIGURE1 = {0: 120e9, 1: 31.4e9, 2: 16.6e9, 3: 1.88e9}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_stage_memory_is_zero_and_korthikanti(zero):
    """paper_zero_bytes reproduces ZeRO's Figure 1 (7.5 B parameters on 64 ranks, to its 3 digits). For a Layout
    with Nd = dp x cp ranks and each recomputation and tp scheme, stage_memory's params + grads + optimizer equal
    paper_zero_bytes(psi, Nd, zero) exactly, split as ZeRO splits them (2 psi weights, /Nd at stage 3; 2 psi
    gradients, /Nd from stage 2; 12 psi of Adam, /Nd from stage 1); its activations are held x (blocks / v) x
    activation_bytes (+ the head's 32-bit logits 4 (s/cp) b ceil(V/t) on the last stage), and full recomputation
    adds one layer's whole activations."""
    fig = paper_zero_bytes(7.5e9, 64, zero)
    assert abs(fig - ZERO_FIGURE1[zero]) <= 0.005 * ZERO_FIGURE1[zero], (zero, fig)
    cfg = ModelConfig(vocab_size=51201, seq_len=2048, d_model=6144, n_heads=48, n_layers=40, d_ff=4 * 6144)
    psi, nd_seen, worst = 123_456_789, set(), 0.0
    for dp, cp, tp, pp, v, sched in ((4, 1, 8, 4, 2, "interleaved"), (3, 2, 4, 2, 1, "1f1b"), (8, 1, 2, 5, 1, "gpipe")):
        for scheme in ("megatron", "sequence"):
            for rc in ("none", "selective", "full"):
                lay = Layout(dp=dp, pp=pp, tp=tp, cp=cp, v=v, zero=zero, tp_scheme=scheme, recompute=rc, b=2, m=pp * 2,
                             schedule=sched)
                nd = dp * cp
                nd_seen.add(nd)
                for s, last in ((0, False), (pp - 1, True)):
                    held = peak_formula(sched, lay.m, pp, s, v)
                    blocks = cfg.n_layers // pp
                    mem = stage_memory(cfg, lay, psi, blocks, held, last)
                    states = mem["params"] + mem["grads"] + mem["optimizer"]
                    assert states == paper_zero_bytes(psi, nd, zero), (lay, mem)
                    by_hand = {"params": 2 * psi / (nd if zero == 3 else 1),
                               "grads": 2 * psi / (nd if zero >= 2 else 1),
                               "optimizer": 12 * psi / (nd if zero >= 1 else 1)}
                    for k, want in by_hand.items():
                        worst = max(worst, abs(mem[k] - want) / want)
                    per_layer = activation_bytes(cfg, lay.b, tp, scheme == "sequence", rc, cp)
                    acts = held * (blocks / v) * per_layer
                    if last:
                        acts += 4 * (cfg.seq_len // cp) * lay.b * -(-cfg.vocab_size // tp)
                    assert mem["activations"] == acts, (lay, s, mem["activations"], acts)
                    if rc == "full":
                        assert mem["recompute"] == activation_bytes(cfg, lay.b, tp, scheme == "sequence", "none", cp)
                    else:
                        assert mem.get("recompute", 0) == 0
    assert worst <= 1e-12, worst
    print(f"ZeRO-{zero}: Figure 1 {fig / 1e9:.4g} GB (paper {ZERO_FIGURE1[zero] / 1e9:g}); model states = "
          f"paper_zero_bytes for Nd in {sorted(nd_seen)}; max relative error of the split by hand {worst:.2e}")


# ------------------------------------------------------------------------------------ 5. the planner on hsgd
def test_search_on_hsgd_equals_plan_rank_and_covers_every_factorization():
    """search(SMALL, 16, 8 devices, this-machine, impl="hsgd", float64): every layout it returns is priced with
    plan_rank of the same settings (its bytes on stages 0, pp/2 and pp-1 are plan_rank's; its memory is plan_rank's
    walk at the moment the total peaks, on the stage it names, and that total is the largest of ALL pp stages, not
    only the three it looks at); the list is sorted by step time, every layout fits, elements are 8 bytes, all 10
    factorizations dp x pp x tp of 8 appear, and the interleaved and zero-bubble layouts, whose memory hsgd has no
    formula for, are dropped with that reason."""
    hw = load("this-machine")
    found, tried, dropped = search(SMALL, 16, 8, hw, impl="hsgd", dtype="float64")
    times = [e.time.total for e in found]
    assert all(a <= b + 1e-9 for a, b in zip(times, times[1:])) and len(found) > 0   # (ties: less memory first)
    grids = {(e.layout.dp, e.layout.pp, e.layout.tp) for e in found}
    assert grids == {(dp, pp, tp) for dp, pp, tp in factorizations(8)}, sorted(grids)
    assert any("no memory formula for the interleaved" in why for why in dropped), dropped
    under = 0.0
    for e in found:
        lay = e.layout
        assert e.fits is True and lay.itemsize == 8 and lay.schedule != "interleaved", lay
        tc = lay.train_config(16, "float64")
        plans = {s: plan_rank(SMALL, tc, lay.dp, lay.pp, lay.tp, lay.cp, s) for s in range(lay.pp)}
        assert set(e.bytes) == {0, lay.pp // 2, lay.pp - 1}
        for s, counts in e.bytes.items():
            assert counts == plans[s]["bytes"], (lay.name(), s)
        total = plans[e.stage]["memory"]["total"]        # the largest sample of the walk
        assert sum(e.memory.values()) == total, lay.name()
        assert total == max(p["memory"]["total"] for p in plans.values()), (lay.name(), e.stage)
        peaks = plans[e.stage]["memory"]["peak"]          # each category's own maximum, at any moment
        assert all(e.memory[c] <= peaks[c] for c in e.memory), lay.name()
        under = max(under, sum(peaks.values()) / total - 1)
    print(f"{len(found)} of {tried} layouts, dropped {dropped}; {len(grids)} factorizations; memory equal to the "
          f"walk's peak total on the fullest stage; times {times[0]:.4g} s .. {times[-1]:.4g} s; the sum of "
          f"per-category peaks would overstate it by up to {under:.2%}")


# ------------------------------------------------------------------------------------ 6. monotonic sanity
def test_faster_network_and_bigger_batch():
    """On a100-80g for narayanan-1.7b, batch 64 on 32 devices (4 nodes), every layout the model allows (priced as
    search prices them): doubling the inter-node bandwidth (a dataclasses.replace copy) never makes a layout slower
    and makes every layout whose dp group spans nodes (dp > 1, dp x pp x tp > 8) strictly faster; doubling the batch
    (m doubled, the same layout otherwise) makes it strictly slower; MFU is in (0, 1]."""
    cfg = presets()["narayanan-1.7b"]
    hw = load("a100-80g")
    fast = dataclasses.replace(hw, inter=dataclasses.replace(hw.inter, bandwidth=2 * hw.inter.bandwidth))
    lays = layouts(cfg, 64, 32, {})
    gains, slower, mfus = [], [], []
    for lay in lays:
        e = evaluate(cfg, 64, lay, hw, simulated=False)
        t, t_fast = e.time.total, evaluate(cfg, 64, lay, fast, simulated=False).time.total
        assert t_fast <= t * (1 + 1e-12), (lay.name(), t, t_fast)
        if lay.dp > 1 and lay.dp * lay.pp * lay.tp * lay.cp > hw.devices_per_node:
            assert t_fast < t, (lay.name(), t, t_fast)
            gains.append(t / t_fast)
        t_big = evaluate(cfg, 128, dataclasses.replace(lay, m=2 * lay.m), hw, simulated=False).time.total
        assert t_big > t, (lay.name(), t, t_big)
        slower.append(t_big / t)
        assert 0 < e.mfu <= 1, (lay.name(), e.mfu)
        mfus.append(e.mfu)
    print(f"{len(lays)} layouts: 2x inter-node bandwidth speeds the {len(gains)} dp-across-nodes ones by "
          f"{min(gains):.4f}x .. {max(gains):.4f}x; 2x batch takes {min(slower):.4f}x .. {max(slower):.4f}x as long; "
          f"MFU {min(mfus):.3f} .. {max(mfus):.3f}")
    assert len(gains) > 10


# ------------------------------------------------------------------------------------ 7. the command line
def cli(*args):
    """(exit code, stdout, stderr) of python -m hsgd.plan args, run from the repository root."""
    r = subprocess.run([sys.executable, "-m", "hsgd.plan", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    return r.returncode, r.stdout, r.stderr


HW_MISSING_KEY = GOOD.replace("memory_bytes = 80e9\n", "")           # a good file without its memory

# (flags, words the one error line must contain: what is wrong and what would work); "{tmp}" is tmp_path
USAGE_ERRORS = [
    (["--model", "nope"], ["unknown model", "narayanan-1.7b", "L=96"]),
    (["--model", "L=2,C=10,NH=3"], ["n_heads must divide d_model", "[1, 2, 5, 10]"]),
    (["--hw", "nope"], ["unknown hardware", "a100-80g"]),
    (["--hw", "{tmp}/hw.toml"], ["has no 'memory_bytes'", "80e9"]),
    (["--model", "gpt2-xl", "--devices", "8", "--tp", "8"], ["n_heads=25", "change --devices"]),
    (["--model", "narayanan-1008b", "--devices", "8"], ["nothing fits", "more devices", "--zero 1,2,3"]),
    (["--efficiency", "2"], ["--efficiency", "(0, 1]"]),
    (["--json", "{tmp}/no/such/folder/out.json"], ["does not exist", "create it"]),
    (["--calibrate"], ["--calibrate needs --out"]),
]


# The usage errors in one process: main(argv) of python -m hsgd.plan for each case in turn, its stdout and stderr
# captured, and its exit code (what `python -m hsgd.plan` exits with); every refusal comes before any work.
IN_ONE_PROCESS = """
import contextlib, io, json, sys
from hsgd.plan.__main__ import main
out = []
for argv in json.loads(sys.stdin.read()):
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        try:
            code = main(argv)
        except SystemExit as x:
            code = x.code if isinstance(x.code, int) else 0
    out.append((code, o.getvalue(), e.getvalue()))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def usage_runs(tmp_path_factory):
    """{flags: (exit code, stdout, stderr)} of every case of USAGE_ERRORS, in one process."""
    import json
    tmp = tmp_path_factory.mktemp("plan-usage")
    (tmp / "hw.toml").write_text(HW_MISSING_KEY)
    cases = [[f.replace("{tmp}", str(tmp)) for f in flags] for flags, _ in USAGE_ERRORS]
    r = subprocess.run([sys.executable, "-c", IN_ONE_PROCESS], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, input=json.dumps(cases))
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(zip((tuple(f) for f, _ in USAGE_ERRORS), json.loads(r.stdout.strip().splitlines()[-1])))


@pytest.mark.parametrize("flags, words", USAGE_ERRORS, ids=[" ".join(f) for f, _ in USAGE_ERRORS])
def test_cli_usage_errors(usage_runs, flags, words):
    """The flags exit 2 with exactly one line on stderr, 'hsgd: error: ...', that says what is wrong and what would
    work (the words), and no traceback."""
    rc, out, err = usage_runs[tuple(flags)]
    lines = err.strip().splitlines()
    print(f"exit {rc}: {err.strip()}")
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("hsgd: error:"), (rc, err)
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_cli_good_run_and_help(tmp_path):
    """--model narayanan-1.7b --batch 512 --devices 32 --hw a100-80g --top 2 --json F --explain exits 0, prints the
    table header and 2 ranked layouts, [compute] and [pipeline] lines, and F loads with 'layouts' sorted by step
    time, the first two the printed ones; --help exits 0 and lists every preset."""
    path = tmp_path / "plan.json"
    rc, out, err = cli("--model", "narayanan-1.7b", "--batch", "512", "--devices", "32", "--hw", "a100-80g",
                       "--top", "2", "--json", str(path), "--explain")
    assert rc == 0, err
    header = [line for line in out.splitlines() if re.match(r"\s*#\s+layout\s+memory\s+step\s+tokens/s\s+MFU", line)]
    ranked = re.findall(r"^\s+(\d+) (dp\d+ pp\d+ tp\d+.*?)\s{2,}", out, flags=re.M)
    assert len(header) == 1 and [r[0] for r in ranked] == ["1", "2"], out
    assert "[compute]" in out and "[pipeline]" in out, out
    with open(path) as f:
        doc = json.load(f)
    times = [e["time"]["total"] for e in doc["layouts"]]
    assert all(a <= b + 1e-9 for a, b in zip(times, times[1:])) and len(times) >= 2   # (ties: less memory first)
    assert [e["layout"]["name"] for e in doc["layouts"][:2]] == [r[1].strip() for r in ranked]
    rc, help_text, err = cli("--help")
    assert rc == 0 and all(name in help_text for name in presets()), help_text
    print(f"printed {[r[1] for r in ranked]}; the JSON has {len(times)} layouts sorted, {times[0]:.4g} s .. "
          f"{times[-1]:.4g} s; --help lists {len(presets())} presets")


def test_the_search_prices_every_cp_scheme_the_heads_allow():
    """cp 2 on 8 devices: ring, all-gather and Ulysses each priced (hsgd.cp.split.CP_SCHEMES), their attention
    FLOPs those of what each computes (the ring skips the masked chunk pairs, the others score T^2/cp a head); the
    bytes Ulysses moves on cp_comm are its four all-to-alls, counted by hand here; a model whose 2 heads a tp rank
    of 2 cannot cut over cp has no Ulysses layout; Megatron-LM's flags name --cp-comm-type."""
    from hsgd.plan import flags
    from hsgd.cp.split import CP_SCHEMES
    lays = layouts(SMALL, 16, 8, {"cp": [2], "tp": [2], "pp": [1], "zero": [0], "tp_scheme": ["megatron"],
                                  "recompute": ["none"], "b": [1]})
    assert sorted(lay.cp_scheme for lay in lays) == ["allgather", "ring", "ulysses"]
    T, C = SMALL.seq_len, SMALL.d_model
    from hsgd.cp.split import attention_blocks
    block = {s: costs.micro_batch_flops(SMALL, 1, 2, 2, 1, False, "none", cp_scheme=s)[0] for s in CP_SCHEMES}
    print(block)                                      # one block's forward FLOPs: the linears' the same for all
    assert block["ulysses"] == block["allgather"] and \
        block["ulysses"] - block["ring"] == 4 * (T * T // 2 - attention_blocks(T, 2, 0)) * C / 2 > 0
    few = dataclasses.replace(SMALL, n_heads=2, n_kv_heads=2)
    assert "ulysses" not in {lay.cp_scheme for lay in layouts(few, 16, 8, {"cp": [2], "tp": [2], "pp": [1]})}
    hw = load("this-machine")
    sent = {}
    for lay in lays:
        e = evaluate(SMALL, 16, lay, hw, impl="hsgd", dtype="float64")
        sent[lay.cp_scheme] = {k: v for k, v in e.bytes[0].items() if k[0] == "cp"}
    print(sent)
    # Ulysses: 4 all-to-alls per block and micro-batch, of q|k|v (Q) and of y (Y) each way, b = 1 sequence of T/cp
    # positions on a tp rank: Q = (T/cp)(C/tp + 2 K/tp) 8, Y = (T/cp)(C/tp) 8 (SMALL: K = C)
    L, m, Tl, c = SMALL.n_layers, lays[0].m, T // 2, C // 2
    Q, Y = Tl * (c + 2 * c) * 8, Tl * c * 8
    assert sent["ulysses"] == {("cp", "Alltoall"): (4 * L * m, L * m * 2 * (Q + Y))}, sent["ulysses"]
    lines = flags.megatron(SMALL, [lay for lay in lays if lay.cp_scheme == "ulysses"][0], 16)
    assert ("cp", "Alltoall") in sent["ulysses"] and any("--cp-comm-type a2a" in line for line in lines), lines


# ------------------------------------------------------------------------------------ 8. the V and dual schedules
def test_v_and_dual_makespans_are_their_closed_forms():
    """costs.makespan simulates zb-v, dualpipev and dualpipe on their own placements (on the loop placement their
    lists would not run): its makespan less a stage's busy time (2m chunk passes of f + b + w; dualpipe m) is ZB-V's
    (p-1) f for f = b = w, m >= 2p-1, and DeepSeek-V3's Table 2 idle (hsgd.pp.timelines.table2) for DualPipeV
    (p-1)(F&B + B - 3W) and DualPipe (p/2-1)(F&B + B - 3W), B = b + w a whole backward and F&B = f + b + w (the
    planner's pair: no overlap credit), for f = b, w <= f, m >= 2p; to 1e-9 relative. The activations the planner
    prices, peak_formula's (micro-batch, chunk) pairs, are the lists' own peak on every stage."""
    from hsgd.pp.timelines import peak_formula, peak_held, table2
    cases, worst = 0, 0.0
    for kind in ("zb-v", "dualpipev", "dualpipe"):
        for p in (2, 4, 6):
            for m in (2 * p, 2 * p + 4):
                for f, b, w in ((1.0, 1.0, 1.0), (2.0, 2.0, 0.5), (0.3, 0.3, 0.3)):
                    if kind == "zb-v" and not f == b == w:
                        continue
                    span = costs.makespan(kind, m, p, 2, f, b, w)
                    busy = (m if kind == "dualpipe" else 2 * m) * (f + b + w)
                    want = (p - 1) * f if kind == "zb-v" else table2(kind, m, p, (f, b, w, f + b + w))
                    err = abs(span - busy - want) / span
                    worst = max(worst, err)
                    cases += 1
                    assert err <= 1e-9, (kind, p, m, (f, b, w), span - busy, want)
                held = [peak_held(acts) for acts in costs.vshape_actions(kind, m, p, 2)]
                assert held == [peak_formula(kind, m, p, s, 2) for s in range(p)], (kind, p, m, held)
    print(f"{cases} (kind, p, m, costs) cases: simulated idle = closed form, max relative error {worst:.2e}; "
          "peak pairs = peak_formula on every stage")


def test_the_search_offers_the_v_and_dual_schedules_only_where_they_apply():
    """layouts() with --schedule zb-v,dualpipev,dualpipe: every layout has v = 2 and ZeRO <= 1, dualpipev m >= 2 pp,
    dualpipe an even pp, an even m >= 2 pp, the V 2 pp <= L pieces; each kind is offered, and one stage runs 1f1b
    only; a MoE model gets no dualpipe. evaluate refuses a layout that breaks one of these with the reason. The
    planner's command line asked for them ranks such a layout first and prints torchtitan's schedule name for it;
    flags.py names torchtitan's ZBVZeroBubble and DualPipeV with 2 pp stages of L/(2 pp) layers, says that it has
    no bidirectional DualPipe and that Megatron-LM has none of the three."""
    from hsgd.plan.__main__ import build_parser, plan
    space = {"schedule": ["zb-v", "dualpipev", "dualpipe"], "tp": [1], "recompute": ["none"],
             "tp_scheme": ["megatron"]}
    seen = {}
    for batch in (8, 16, 32):
        for lay in layouts(SMALL, batch, 8, space):
            if lay.pp == 1:
                assert lay.schedule == "1f1b", lay                 # (one stage: no V, no two ends)
                continue
            seen.setdefault(lay.schedule, set()).add((lay.pp, lay.m))
            assert lay.v == 2 and lay.zero <= 1, lay
            if lay.schedule != "dualpipe":
                assert 2 * lay.pp <= SMALL.n_layers, lay
            if lay.schedule != "zb-v":
                assert lay.m >= 2 * lay.pp, lay
            if lay.schedule == "dualpipe":
                assert lay.pp % 2 == 0 and lay.m % 2 == 0, lay
    print({k: sorted(v) for k, v in seen.items()})
    assert set(seen) == {"zb-v", "dualpipev", "dualpipe"}
    stages = {k: {p for p, _ in v} for k, v in seen.items()}
    assert 8 in stages["dualpipe"] and 8 not in stages["zb-v"] | stages["dualpipev"]      # (L = 8: 16 V pieces)
    assert any(m < 2 * p for p, m in seen["zb-v"])                                          # (zb-v: any m)
    moe = dataclasses.replace(SMALL, moe_experts=4)
    assert {lay.schedule for lay in layouts(moe, 16, 8, space) if lay.pp > 1} == {"zb-v", "dualpipev"}
    hw = load("a100-80g")
    good = Layout(dp=2, pp=4, tp=1, v=2, m=8, schedule="dualpipe")
    bad = {"pp=3": dataclasses.replace(good, dp=1, pp=3, m=16), "m < 2 pp": dataclasses.replace(good, m=6),
           "zero 2": dataclasses.replace(good, zero=2), "v=1": dataclasses.replace(good, v=1)}
    for name, lay in bad.items():
        with pytest.raises(ConfigError) as err:
            evaluate(SMALL, 16, lay, hw)
        print(f"{name}: {err.value}")
    with pytest.raises(ConfigError, match="dualpipev"):
        evaluate(moe, 16, good, hw)
    lines = []
    args = build_parser().parse_args(["--model", "narayanan-1.7b", "--batch", "512", "--devices", "32", "--pp", "4",
                                      "--tp", "1", "--micro-batch", "4", "--zero", "1", "--sp", "no", "--recompute",
                                      "none", "--schedule", "zb-v,dualpipev,dualpipe", "--top", "3"])
    assert plan(args, lambda *a, **k: lines.append(" ".join(map(str, a)))) == 0
    ranked = [re.search(r", (zb-v|dualpipev|dualpipe),", line).group(1) for line in lines
              if re.match(r"\s+[123] dp\d+ pp4", line)]
    print(ranked, [line.strip() for line in lines if "pipeline_parallel_schedule" in line or "1F1B in" in line])
    assert sorted(ranked) == ["dualpipe", "dualpipev", "zb-v"], lines
    name = {"zb-v": '"ZBVZeroBubble"', "dualpipev": '"DualPipeV"', "dualpipe": "no bidirectional DualPipe"}
    assert any("pipeline_parallel_schedule" in line and name[ranked[0]] in line for line in lines), lines
    from hsgd.plan import flags
    for kind in name:                                       # the V: 2 pp = 8 stages of 1 layer; dualpipe: 1F1B's
        lay = Layout(dp=2, pp=4, tp=1, v=2, m=8, schedule=kind)
        titan, mega = flags.torchtitan(SMALL, lay, 16), " ".join(flags.megatron(SMALL, lay, 16))
        assert any(name[kind] in line for line in titan), titan
        if kind == "dualpipe":
            assert "# Megatron-LM runs 1F1B in place of dualpipe" in mega, mega
        else:
            assert f"# Megatron-LM has no {kind} schedule" in mega, mega
        per_stage = "pipeline_parallel_layers_per_stage = 1" in titan and "virtual-pipeline-stage 1" in mega
        assert per_stage == (kind != "dualpipe"), (titan, mega)


def test_dualpipe_holds_and_sends_twice_the_parameters():
    """For an untied model, the same layout under dualpipe and 1f1b (pp = 2 and 4, ZeRO 0 and 1): each dualpipe
    stage s holds what 1F1B's stages s and p-1-s hold (its dp exchange's bytes, hsgd.plan.layout.PlannedStage's
    names), so all stages together hold 2x 1F1B's parameters (pp = 2: every stage; pp = 4: stages 0 and p-1, and 2x
    on the middle stage), its memory's params are those bytes and its optimizer 6x them; its pp Recv is 1F1B's
    messages of b T C 2 bytes, m (2 - [s = 0] - [s = p-1]), plus one of its gradients G from its twin; zb-v's last
    stage receives 2m messages, not 4m (the V's turn is a local hand-off), and its time's pp transfer is 2 messages
    a micro-batch (pp = 2, where that stage would be the slowest if the hand-off were priced), the dual's the
    slowest stage's messages m/2 times plus G each way to the twin."""
    from types import SimpleNamespace
    from hsgd.plan.layout import PlannedStage
    cfg = dataclasses.replace(SMALL, tied=False)
    hw = load("a100-80g")
    msg, checked = 1 * cfg.seq_len * cfg.d_model * 2, 0
    for pp, zero in ((2, 0), (4, 1)):
        dp, m = 8 // pp, 2 * pp
        one = Layout(dp=dp, pp=pp, tp=1, m=m, zero=zero)
        dual = dataclasses.replace(one, v=2, schedule="dualpipe")
        e1, e2 = evaluate(cfg, 8 * m // pp, one, hw), evaluate(cfg, 8 * m // pp, dual, hw)
        G1 = {s: b[("dp", "Allreduce" if zero == 0 else "Reduce_scatter_block")][1] for s, b in e1.bytes.items()}
        G2 = {s: b[("dp", "Allreduce" if zero == 0 else "Reduce_scatter_block")][1] for s, b in e2.bytes.items()}
        for s in G2:
            twin = pp - 1 - s
            assert G2[s] == G1[s] + G1[twin] if twin in G1 else G2[s] == 2 * G1[s], (pp, s, G1, G2)
            calls, nbytes = e2.bytes[s][("pp", "Recv")]
            msgs = m * (2 - (s == 0) - (s == pp - 1))
            assert (calls, nbytes) == (msgs + 1, msgs * msg + G2[s]), (pp, s, calls, nbytes)
            tc = SimpleNamespace(virtual_stages=2, schedule="dualpipe", micro_batches=m, pp_split=None)
            names = PlannedStage(cfg, tc, pp, s).names
            tc1 = SimpleNamespace(virtual_stages=1, schedule="1f1b", micro_batches=m, pp_split=None)
            halves = PlannedStage(cfg, tc1, pp, s).names + PlannedStage(cfg, tc1, pp, twin).names
            assert sorted(names) == sorted(halves), (pp, s)
            checked += 1
        if pp == 2:
            assert sum(G2.values()) == 2 * sum(G1.values())
        assert e2.memory["params"] == G2[e2.stage] and e2.memory["optimizer"] == 6 * G2[e2.stage] / (dp if zero
                                                                                                    else 1)
        print(f"pp={pp} ZeRO-{zero}: 1F1B gradient bytes {G1}, DualPipe {G2}; fullest stage {e2.stage}: params "
              f"{e2.memory['params']:g} B; pp Recv {e2.bytes[0][('pp', 'Recv')]}")
    link = hw.intra                                          # (pp x tp <= 8 devices: inside a node)
    for kind, pp in (("zb-v", 2), ("dualpipe", 4)):
        lay = Layout(dp=8 // pp, pp=pp, tp=1, v=2, m=2 * pp, schedule=kind)
        e = evaluate(cfg, 8 * lay.m // pp, lay, hw)
        one_msg = costs.collective("Recv", msg, 2, link, hw)
        if kind == "zb-v":
            assert e.bytes[pp - 1][("pp", "Recv")] == (2 * lay.m, 2 * lay.m * msg)
            want = lay.m * 2 * one_msg
        else:
            G = max(b[("dp", "Allreduce")][1] for b in e.bytes.values())
            want = lay.m // 2 * 4 * one_msg + costs.collective("Recv", G, 2, link, hw)
        print(f"{kind} pp={pp}: pp transfer {e.time.pp_transfer:.6g} s, by hand {want:.6g} s")
        assert abs(e.time.pp_transfer - want) <= 1e-12 * want, (kind, e.time.pp_transfer, want)
    assert checked == 5

"""The serial reference: the mini-batch identity, determinism, and a short training run that learns."""
import numpy as np
import pytest

from hsgd.model.config import ModelConfig
from hsgd.model import ops, serial
from hsgd.model.data import Corpus
from hsgd.train import train
from hsgd.step.settings import TrainConfig

from .conftest import max_rel_err, noisy_params, random_batch


def test_minibatch_identity(tiny_cfg):
    """grad of the batch-mean loss == (1/B) * sum of the per-example gradients (the lecture's mini-batch SGD)."""
    params = noisy_params(tiny_cfg)
    idx, targets = random_batch(tiny_cfg, 5)
    loss, grads = serial.loss_and_grads(params, idx, targets, tiny_cfg)
    mean_grads = serial.zeros_like_params(params)
    mean_loss = 0.0
    for j in range(5):
        lj, gj = serial.loss_and_grads(params, idx[j:j + 1], targets[j:j + 1], tiny_cfg)
        mean_loss += lj / 5
        for name in mean_grads:
            mean_grads[name] += gj[name] / 5
    # floor 1e-6: the k-bias gradients are exactly zero in exact arithmetic (softmax ignores a shift shared by a
    # row of scores), so what is computed for them is rounding noise of ~1e-18; the other gradients are ~1e-2.
    errs = {name: max_rel_err(grads[name], mean_grads[name], floor=1e-6) for name in params}
    worst = max(errs, key=errs.get)
    print(f"mini-batch identity: loss diff {abs(loss - mean_loss):.1e}, max rel err {errs[worst]:.1e} ({worst})")
    assert abs(loss - mean_loss) <= 1e-14 * abs(loss)
    assert errs[worst] < 1e-12


def test_grads_accumulate(tiny_cfg):
    """Passing a grads dict accumulates into it: two calls on the same batch give twice the gradient."""
    params = noisy_params(tiny_cfg)
    idx, targets = random_batch(tiny_cfg, 2)
    _, g1 = serial.loss_and_grads(params, idx, targets, tiny_cfg)
    g2 = serial.zeros_like_params(params)
    for _ in range(2):
        serial.loss_and_grads(params, idx, targets, tiny_cfg, grads=g2)
    err = max(max_rel_err(g2[n], 2 * g1[n]) for n in params)
    print(f"accumulation: max rel err {err:.1e}")
    assert err < 1e-14


def test_init_is_deterministic_and_follows_the_spec():
    cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=3, d_ff=64)
    a = serial.init_params(cfg, seed=7, dtype="float64")
    b = serial.init_params(cfg, seed=7, dtype="float64")
    c = serial.init_params(cfg, seed=8, dtype="float64")
    assert list(a) == list(cfg.param_shapes())
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert not np.array_equal(a["wte"], c["wte"])
    assert all(a[n].shape == s for n, s in cfg.param_shapes().items())
    assert all(np.all(a[n] == 0) for n in a if n.endswith(".bias"))
    assert all(np.all(a[n] == 1) for n in a if n.endswith(".weight") and (".ln" in n or n.startswith("ln_f")))
    # standard deviations: 0.02, and 0.02 / sqrt(2L) for the residual projections (many draws, loose bounds)
    assert abs(a["wte"].std() - 0.02) < 0.001
    resid = np.concatenate([a[f"h.{i}.mlp.proj.weight"].ravel() for i in range(3)])
    assert abs(resid.std() - 0.02 / np.sqrt(6)) < 0.0005
    # float32 parameters are the float64 ones rounded
    f32 = serial.init_params(cfg, seed=7, dtype="float32")
    assert f32["wte"].dtype == np.float32 and np.array_equal(f32["wte"], a["wte"].astype(np.float32))


def test_batches_are_a_pure_function_of_seed_and_step(tmp_path):
    path = tmp_path / "text.txt"
    path.write_bytes(bytes(range(256)) * 40)
    c1, c2 = Corpus.load(str(path), 8), Corpus.load(str(path), 8)
    x1, y1 = c1.batch(seed=3, step=5, batch_size=6)
    x2, y2 = c2.batch(seed=3, step=5, batch_size=6)
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    assert x1.shape == (6, 8) and np.array_equal(x1[:, 1:], y1[:, :-1])           # targets: next bytes
    assert not np.array_equal(x1, c1.batch(seed=3, step=6, batch_size=6)[0])
    # the first rows of a larger batch are not the point: a batch is drawn whole, for a fixed global size
    val_x, _ = c1.batch(seed=3, step=5, batch_size=6, split="val")
    assert val_x.max() < 256 and not np.array_equal(val_x, x1)


def test_training_lowers_the_loss_on_the_default_corpus():
    """A few dozen SGD steps of a small model on the built-in corpus: the validation loss falls clearly."""
    cfg = ModelConfig(vocab_size=256, seq_len=32, d_model=32, n_heads=2, n_layers=2, d_ff=64)
    tc = TrainConfig(steps=40, batch_size=8, lr=0.05, momentum=0.9, eval_interval=0, eval_batches=2,
                     log_interval=20, sample_bytes=20)
    out = train(cfg, tc, out=open("/dev/null", "w"))
    print(f"val loss {out['val_before']:.3f} -> {out['val_after']:.3f}")
    assert out["val_after"] < out["val_before"] - 1.0
    assert all(np.isfinite(out["losses"]))


def test_same_seed_same_training_run():
    """Two runs with the same seed give bit-identical losses and parameters (float64)."""
    cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=16, n_heads=2, n_layers=1, d_ff=32)
    tc = TrainConfig(steps=5, batch_size=4, dtype="float64", eval_batches=1, sample_bytes=0)
    devnull = open("/dev/null", "w")
    a, b = train(cfg, tc, out=devnull), train(cfg, tc, out=devnull)
    assert a["losses"] == b["losses"]
    assert all(np.array_equal(a["params"][n], b["params"][n]) for n in a["params"])


def test_threads_change_nothing(set_threads):
    """The threaded paths of the kernels (serial on hsgd.model.ops; threads.parallel_rows: GELU, LayerNorm and attention
    pieces on 2 threads, attention's BLAS on one thread per piece) give the one-thread gradients. The shapes are
    large enough for every threaded layer but GELU's one-pass backward to split its rows, and the sequences long
    enough for 2 causal blocks."""
    cfg = ModelConfig(vocab_size=31, seq_len=128, d_model=512, n_heads=2, n_layers=1, d_ff=1024)
    params = serial.init_params(cfg, seed=3, dtype="float64")
    idx, targets = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 5, cfg.seq_len))
    set_threads(1)
    loss1, g1 = serial.loss_and_grads(params, idx, targets, cfg, ops=ops)
    set_threads(2)
    loss2, g2 = serial.loss_and_grads(params, idx, targets, cfg, ops=ops)
    err = max(max_rel_err(g2[n], g1[n]) for n in g1)
    print(f"2 threads vs 1: loss {loss2!r} vs {loss1!r}, max rel grad err {err:.1e}")
    assert abs(loss2 - loss1) <= 1e-14 * abs(loss1) and err < 1e-13


@pytest.mark.parametrize("threads, B", [(2, 5), (3, 7), (4, 2)])
def test_batch_split_over_threads_is_the_minibatch_identity(set_threads, threads, B):
    """split=True: slices of whole sequences on threads of their own, each weighted by its share of the batch,
    accumulated into the given gradients; equal to the unsplit computation up to rounding (float64)."""
    from hsgd.model.threads import cpu_threads, parallel_batches
    cfg = ModelConfig(vocab_size=31, seq_len=8, d_model=16, n_heads=2, n_layers=2, d_ff=32)
    params = serial.init_params(cfg, seed=5, dtype="float64")
    idx, targets = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, B, cfg.seq_len))
    set_threads(1)
    loss1, g1 = serial.loss_and_grads(params, idx, targets, cfg, grads=noisy_params(cfg, seed=9))
    set_threads(threads)
    loss2, g2 = serial.loss_and_grads(params, idx, targets, cfg, grads=noisy_params(cfg, seed=9), split=True)
    slices = parallel_batches(lambda lo, hi: (lo, hi, cpu_threads()), B)
    after = cpu_threads()
    err = max(max_rel_err(g2[n], g1[n]) for n in g1)
    print(f"{threads} threads, B = {B}: slices {slices}; loss diff {abs(loss2 - loss1):.1e}, max rel grad err "
          f"{err:.1e}")
    n = min(threads, B)
    assert slices == [(B * i // n, B * (i + 1) // n, 1) for i in range(n)] and after == threads
    assert abs(loss2 - loss1) <= 1e-14 * abs(loss1) and err < 1e-13


@pytest.mark.parametrize("scheme", ["megatron", "gather", "sequence"])
def test_shard_numel_counts_what_a_tp_rank_holds(scheme):
    """tp_shards.shard_numel, from the shapes, is the size of the shards tp_shards.shard cuts, on every rank; a
    vocabulary of 250 does not split evenly, so its padding is counted too."""
    from hsgd.model.config import ModelConfig
    from hsgd.tp import shards as tp_shards
    cfg = ModelConfig(vocab_size=250, seq_len=8, d_model=16, n_heads=4, n_layers=2, d_ff=64)
    full = serial.init_params(cfg, seed=0, dtype="float64")
    some = ["wte", "h.0.attn.q.weight", "h.1.ln2.bias", "lm_head.weight"]
    for tp in (1, 2, 4):
        for rank in range(tp):
            shards = tp_shards.shard_params(full, rank, tp, scheme)
            assert tp_shards.shard_numel(cfg, tp, scheme=scheme) == sum(a.size for a in shards.values())
            assert tp_shards.shard_numel(cfg, tp, some, scheme) == sum(shards[n].size for n in some)

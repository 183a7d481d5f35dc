"""A PyTorch Distributed Checkpoint (DCP) of one training step, for `python -m hsgd.crosscheck.from_dcp`: four
processes on a 2-D DeviceMesh (dp 2, tp 2) hold a tiny llama's parameters and gradients as DTensors and save them
with torch.distributed.checkpoint.save, as a trainer that checkpoints its step (torchtitan) does.

    python benchmarks/make_dcp_fixture.py OUT [--bug] [--format torch_save|safetensors] [--no-params]
                                              [--metadata-json]
    python -m hsgd.crosscheck.from_dcp OUT --out DUMP --trust-pickled-metadata && python -m hsgd.crosscheck DUMP

The state dict saved (DCP flattens it: "params.tok_embeddings.weight", "grads.norm.weight", "batch.idx", "loss"):
    {"params": {FQN: the parameter before the step}, "grads": {FQN: its gradient after the step's reductions},
     "batch": {"idx", "targets": int64 (B, T)}, "loss": 0-d float32}
under torchtitan's llama3 names (hsgd.crosscheck.systems.torchtitan_tensors: nn.Linear weights (out, in)), float32,
and OUT/hsgd.json beside .metadata: the model, the layout's sizes, the dtype and the names. The tensors are laid out
as DTensors of many placements, over mesh dims (dp, tp) (placement k splits over mesh dim k):
    (Shard(0), Shard(1))   tok_embeddings (37 rows: 19 and 18), wq: a 2-D box per rank
    (Shard(1), Shard(0))   wo: the same, the mesh dims crossed
    (Shard(0), Shard(0))   w1: four row blocks
    (Shard(0), Replicate()), (Replicate(), Shard(0)), (Replicate(), Shard(1))   wk, w3, norm / wv, output / w2
    (Replicate(), Replicate())   attention_norm; and ffn_norm a plain tensor on every rank
DCP saves each distinct chunk once (its plans deduplicated: a replicated one on one rank only).

The values are not PyTorch's arithmetic: every rank takes hsgd's serial float64 reference step
(hsgd.model.serial.loss_and_grads) on parameters rounded to float32, and stores them in float32, so the crosscheck
passes to float32's rounding. What is under test is the checkpoint's layout and its reading, not a training loop
(benchmarks/crosscheck_torch.py is one). --bug doubles one gradient (feed_forward.w2: a "constant factor").
--no-params leaves the parameters out (read them from another checkpoint: from_dcp --params). --metadata-json also
writes OUT/dcp-metadata.json, the checkpoint's .metadata as plain JSON (hsgd.crosscheck.dcp.describe), which lets
from_dcp read the folder without PyTorch (--metadata-json): the committed fixtures of tests/data/dcp/ carry one.

The processes: torch.multiprocessing (fork, so that torch is imported once), gloo on the CPU, rendezvous through a
file (no network port). Needs PyTorch (pip install torch); --format safetensors also the safetensors package.
"""
import argparse
import datetime
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository: hsgd

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter  # noqa: E402
from torch.distributed.checkpoint.filesystem import SerializationFormat  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: E402

from hsgd.crosscheck.dcp import describe  # noqa: E402
from hsgd.crosscheck.dump import FAMILY_KEYS, MODEL_KEYS  # noqa: E402
from hsgd.crosscheck.systems import torchtitan_tensors  # noqa: E402
from hsgd.model import serial  # noqa: E402
from hsgd.model.config import ModelConfig  # noqa: E402

DP, TP = 2, 2
S, R = Shard, Replicate
PLACEMENTS = {                                  # FQN: placements over mesh dims (dp, tp); None: a plain tensor
    "tok_embeddings.weight": (S(0), S(1)),
    "layers.0.attention_norm.weight": (R(), R()),
    "layers.0.attention.wq.weight": (S(0), S(1)),
    "layers.0.attention.wk.weight": (S(0), R()),
    "layers.0.attention.wv.weight": (R(), S(0)),
    "layers.0.attention.wo.weight": (S(1), S(0)),
    "layers.0.ffn_norm.weight": None,
    "layers.0.feed_forward.w1.weight": (S(0), S(0)),
    "layers.0.feed_forward.w3.weight": (S(0), R()),
    "layers.0.feed_forward.w2.weight": (R(), S(1)),
    "norm.weight": (S(0), R()),
    "output.weight": (R(), S(0)),
}
BUG = "layers.0.feed_forward.w2.weight"         # --bug: its gradient doubled


def model():
    return ModelConfig(vocab_size=37, seq_len=8, d_model=16, n_heads=4, n_layers=1, d_ff=32, arch="llama")


def step(cfg, seed, bug):
    """({FQN: parameter}, {FQN: gradient}) float32 in torchtitan's storage, idx, targets (B, T), the loss: the
    reference's step on parameters rounded to float32."""
    params = {n: a.astype(np.float32).astype(np.float64) for n, a in serial.init_params(cfg, seed, "float64").items()}
    rng = np.random.default_rng(seed + 1)
    idx = rng.integers(0, cfg.vocab_size, (4, cfg.seq_len))                     # (B, T)
    targets = rng.integers(0, cfg.vocab_size, (4, cfg.seq_len))
    loss, grads = serial.loss_and_grads(params, idx, targets, cfg)
    tensors = torchtitan_tensors(cfg)
    p = {n: t.from_reference(params).astype(np.float32) for n, (t, _) in tensors.items()}
    g = {n: t.from_reference(grads).astype(np.float32) for n, (t, _) in tensors.items()}
    if bug:
        g[BUG] = 2 * g[BUG]
    return p, g, idx, targets, float(loss)


def worker(rank, args, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=DP * TP,
                            timeout=datetime.timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        cfg = model()
        p, g, idx, targets, loss = step(cfg, args.seed, args.bug)

        def laid(arrays):
            return {n: torch.from_numpy(a) if PLACEMENTS[n] is None else
                    distribute_tensor(torch.from_numpy(a), mesh, list(PLACEMENTS[n])) for n, a in arrays.items()}
        state = {"grads": laid(g), "batch": {"idx": torch.from_numpy(idx), "targets": torch.from_numpy(targets)},
                 "loss": torch.tensor(loss, dtype=torch.float32)}
        if not args.no_params:
            state["params"] = laid(p)
        fmt = SerializationFormat.SAFETENSORS if args.format == "safetensors" else SerializationFormat.TORCH_SAVE
        os.chdir(os.path.dirname(args.out))          # .metadata keeps the path it was given: the folder's name only
        name = os.path.basename(args.out)
        dcp.save(state, storage_writer=FileSystemWriter(name, serialization_format=fmt))
        dist.barrier()
        if rank == 0:
            meta = {"system": f"benchmarks/make_dcp_fixture.py (DTensors on a (dp {DP}, tp {TP}) mesh, "
                              f"{args.format}{', --bug' if args.bug else ''})",
                    "model": {k: getattr(cfg, k) for k in MODEL_KEYS + FAMILY_KEYS},
                    "parallel": {"dp": DP, "tp": TP}, "dtype": "float32", "names": "torchtitan"}
            with open(os.path.join(args.out, "hsgd.json"), "w") as f:
                json.dump(meta, f, indent=1)
            if args.metadata_json:
                with open(os.path.join(args.out, "dcp-metadata.json"), "w") as f:
                    json.dump(describe(FileSystemReader(name).read_metadata()), f, indent=None)
    finally:
        dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the checkpoint's folder (created; an earlier checkpoint there is overwritten)")
    p.add_argument("--bug", action="store_true", help=f"double {BUG}'s gradient (a constant factor)")
    p.add_argument("--format", choices=("torch_save", "safetensors"), default="torch_save",
                   help="DCP's serialization of the chunks (default torch_save, DCP's own default)")
    p.add_argument("--no-params", action="store_true", help="save the gradients, batch and loss only")
    p.add_argument("--metadata-json", action="store_true", help="also write dcp-metadata.json (.metadata as JSON)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args, os.path.join(tmp, "rendezvous")), nprocs=DP * TP, join=True,
                           start_method="fork")
    print(f"wrote {args.out}: {sorted(os.listdir(args.out))}")


if __name__ == "__main__":
    main()

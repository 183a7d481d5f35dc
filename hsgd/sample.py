"""Generate text from a checkpoint:  python -m hsgd.sample DIR --prompt "def "   (or under mpirun -n N)

DIR is a checkpoint directory (step-NNNNNN) or the --save-dir holding them (its newest). The checkpoint may
come from any layout: its shards are reassembled into the full model (hsgd.checkpoint.Shards), which the
serial model then samples from, one byte at a time (hsgd.generate). Under mpirun every rank checks the
checkpoint and rank 0 samples and prints; the others only wait (sampling a small model needs no parallelism).
"""
import sys

from mpi4py import MPI

from . import launch
from .backend import get_xp, to_device
from .checkpoint import Shards, open_checkpoint
from .config import ModelConfig
from .generate import generate, printable


def build_parser():
    p = launch.RankZeroParser(prog="python -m hsgd.sample", description="Generate text from an hsgd checkpoint.")
    p.add_argument("dir", help="a checkpoint directory or a --save-dir (its newest checkpoint)")
    p.add_argument("--prompt", default="def ", help="the text to continue ('def ')")
    p.add_argument("--bytes", type=int, default=200, help="bytes to generate (200)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature (0.8)")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k most likely bytes (40)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (0)")
    p.add_argument("--device", choices=["cpu", "gpu"], help="cpu or gpu")
    return p


def main(argv=None):
    world = MPI.COMM_WORLD

    def body():
        args = build_parser().parse_args(argv)
        manifest = launch.agree(world, lambda: open_checkpoint(args.dir))
        if world.Get_rank() == 0:
            shards = Shards(manifest)
            cfg = ModelConfig(**manifest["model"])
            xp = get_xp(args.device)
            params = {n: to_device(shards.full(n), xp) for n in cfg.param_shapes()}
            text = generate(params, cfg, args.prompt.encode(), args.bytes, seed=args.seed,
                            temperature=args.temperature, top_k=args.top_k)
            print(f"# {manifest['path']} (step {manifest['step']})\n{printable(text)}")
        world.Barrier()
        return 0

    return launch.run(body, world)


__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())

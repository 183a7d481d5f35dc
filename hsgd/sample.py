"""Generate text from a checkpoint:  python -m hsgd.sample DIR --prompt "def "   (or under mpirun -n N)

DIR is a checkpoint directory (step-NNNNNN) or the --save-dir holding them (its newest). The checkpoint may
come from any layout: its shards are reassembled into the full model (hsgd.checkpoint.store.Shards), which the
serial model then samples from, one byte at a time (hsgd.model.generate). Under mpirun every rank checks the
checkpoint and rank 0 samples and prints; the others only wait (sampling a small model needs no parallelism).
"""
import sys

from mpi4py import MPI

from hsgd.cli import Parser
from hsgd.grid import launch
from hsgd.model.backend import get_xp, to_device
from hsgd.checkpoint.store import Shards, open_checkpoint
from hsgd.model.config import ModelConfig
from hsgd.errors import UsageError
from hsgd.step.settings import MAX_SAMPLE_BYTES
from hsgd.model.generate import generate, sample_text

MAX_BYTES = MAX_SAMPLE_BYTES    # --bytes at most: one forward pass of the model per byte (as hsgd.train's)


def build_parser():
    p = Parser(prog="python -m hsgd.sample", description="Generate text from an hsgd checkpoint.",
               speaks=launch.on_rank_zero)
    p.add_argument("dir", help="a checkpoint directory or a --save-dir (its newest checkpoint)")
    p.add_argument("--prompt", default="def ", help="the text to continue ('def ')")
    p.add_argument("--bytes", type=int, default=200, help=f"bytes to generate, at most {MAX_BYTES:,} (200)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature (0.8)")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k most likely bytes (40)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (0)")
    p.add_argument("--device", choices=["cpu", "gpu"], help="cpu or gpu")
    return p


def check_args(args):
    """Everything sampling needs, checked before any work (on every rank)."""
    if args.bytes < 0:
        raise UsageError(f"--bytes {args.bytes} must be an integer >= 0")
    if args.bytes > MAX_BYTES:
        raise UsageError(f"--bytes {args.bytes} is more than {MAX_BYTES:,} (each byte is a forward pass of the model); "
                         "give a smaller number")
    if not args.temperature > 0 or args.temperature == float("inf"):
        raise UsageError(f"--temperature {args.temperature} must be a finite number > 0 (0.8 is the default)")
    if not 1 <= args.top_k <= 256:
        raise UsageError(f"--top-k {args.top_k} must be in 1..256 (the byte vocabulary)")
    if args.seed < 0:
        raise UsageError(f"--seed {args.seed} must be an integer >= 0")
    try:
        prompt = args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"--prompt {args.prompt!r} is not valid text ({e.reason}); pass the prompt as UTF-8") from None
    return prompt, get_xp(args.device)                  # ConfigError with the fix when CuPy does not import


def main(argv=None):
    world = MPI.COMM_WORLD

    def body():
        args = build_parser().parse_args(argv)
        prompt, xp = launch.agree(world, lambda: check_args(args))
        manifest = launch.agree(world, lambda: open_checkpoint(args.dir))
        shards = launch.agree(world, lambda: Shards(manifest))           # its layout splits the model, on every rank

        def sample():                                    # rank 0's work; a failure reaches every rank (agree)
            cfg = ModelConfig(**manifest["model"])
            params = {n: to_device(shards.full(n), xp) for n in cfg.param_shapes()}
            return generate(params, cfg, prompt, args.bytes, seed=args.seed, temperature=args.temperature,
                            top_k=args.top_k)

        text = launch.agree(world, lambda: sample() if world.Get_rank() == 0 else None)
        if world.Get_rank() == 0:
            print(f"# {manifest['path']} (step {manifest['step']})\n{sample_text(text)}")
        return 0

    return launch.run(body, world)


__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())

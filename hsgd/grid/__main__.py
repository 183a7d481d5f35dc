"""`mpirun -n P python -m hsgd.grid [--dp N] [--pp N] [--cp N] [--tp N]`: build the process grid
(hsgd.grid.process_grid) and print which rank is where and the groups of every communicator."""
import argparse
import sys

from mpi4py import MPI

from hsgd.errors import EXIT_USAGE, UsageError
from hsgd.grid.process_grid import ProcessGrid


def main(argv=None):
    p = argparse.ArgumentParser(prog="mpirun -n P python -m hsgd.grid",
                                description="Build the dp x pp x cp x tp process grid and print which rank is where.")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: P / (pp * tp))")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (the sequence split over ranks)")
    args = p.parse_args(argv)
    world = MPI.COMM_WORLD
    try:
        dp = args.dp if args.dp is not None else max(world.Get_size() // max(args.pp * args.tp * args.cp, 1), 1)
        grid = ProcessGrid(world, dp=dp, pp=args.pp, tp=args.tp, cp=args.cp)
    except UsageError as e:
        if world.Get_rank() == 0:                               # every rank found the same error: report once
            print(f"hsgd: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    table = grid.layout_table()
    if grid.rank == 0:
        print(f"{world.Get_size()} ranks = dp {grid.dp} x pp {grid.pp} x cp {grid.cp} x tp {grid.tp}\n{table}")
        for dim, groups in grid.groups().items():
            print(f"{dim}_comm groups: {groups}")
    grid.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())

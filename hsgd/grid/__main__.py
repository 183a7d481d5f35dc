"""`mpirun -n P python -m hsgd.grid [--dp N] [--pp N] [--cp N] [--tp N]`: build the process grid
(hsgd.grid.process_grid) and print which rank is where and the groups of every communicator."""
import sys

from mpi4py import MPI

from hsgd.cli import Parser
from hsgd.grid import launch
from hsgd.grid.process_grid import ProcessGrid


def build_parser():
    p = Parser(prog="mpirun -n P python -m hsgd.grid", speaks=launch.on_rank_zero,
               description="Build the dp x pp x cp x tp process grid and print which rank is where.")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: P / (pp * tp))")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (the sequence split over ranks)")
    return p


def main(argv=None):
    """The exit code on every rank: 0, or 2 with one line from rank 0 for a usage error (hsgd.grid.launch)."""
    world = MPI.COMM_WORLD

    def body():
        args = build_parser().parse_args(argv)
        dp = args.dp if args.dp is not None else max(world.Get_size() // max(args.pp * args.tp * args.cp, 1), 1)
        grid = ProcessGrid(world, dp=dp, pp=args.pp, tp=args.tp, cp=args.cp)
        table = grid.layout_table()
        if grid.rank == 0:
            print(f"{world.Get_size()} ranks = dp {grid.dp} x pp {grid.pp} x cp {grid.cp} x tp {grid.tp}\n{table}")
            for dim, groups in grid.groups().items():
                print(f"{dim}_comm groups: {groups}")
        grid.free()
        return 0

    return launch.run(body, world)


if __name__ == "__main__":
    sys.exit(main())

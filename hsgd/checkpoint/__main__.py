"""`python -m hsgd.checkpoint export DIR out.npz` and `... info DIR`: a checkpoint's full model under the serial
names, and what a checkpoint holds, its files verified (one process; hsgd.checkpoint.store does the work)."""
import sys

from hsgd import cli
from hsgd.checkpoint.store import export, open_checkpoint


def build_parser():
    p = cli.Parser(prog="python -m hsgd.checkpoint", description="Inspect or export an hsgd checkpoint.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{export,info}")
    e = sub.add_parser("export", help="write the full model under the serial parameter names to an .npz file")
    e.add_argument("dir", help="a checkpoint directory (step-NNNNNN) or a --save-dir (its newest checkpoint)")
    e.add_argument("out", help="the .npz file to write")
    i = sub.add_parser("info", help="print what a checkpoint holds, after verifying its files")
    i.add_argument("dir")
    return p


def main(argv=None):
    """The exit code of python -m hsgd.checkpoint argv: 0, or 2 with one line for a usage error (hsgd.cli)."""
    return cli.run(lambda: command(build_parser().parse_args(argv)))


def command(args):
    if args.cmd == "export":
        manifest, full = export(args.dir, args.out)
        n = sum(a.size for a in full.values())
        print(f"{manifest['path']}: step {manifest['step']}, {len(full)} parameters ({n:,} numbers) -> {args.out}")
    else:
        m = open_checkpoint(args.dir)
        lay = m["layout"]
        opt = m["optimizer"]
        print(f"{m['path']}: step {m['step']}, layout dp {lay['dp']} x pp {lay['pp']} x cp {lay.get('cp', 1)} x tp "
              f"{lay['tp']} "
              f"({lay['tp_scheme']}), layers per piece {lay['layers']}, {opt['name']} (t={opt['t']}), "
              f"{m['dtype']}\nmodel {m['model']}\nfiles (SHA-256 verified): {', '.join(sorted(m['files']))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

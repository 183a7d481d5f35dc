"""`python -m hsgd.checkpoint export DIR out.npz` and `... info DIR`: a checkpoint's full model under the serial
names, and what a checkpoint holds, its files verified (one process; hsgd.checkpoint.store does the work)."""
import sys

from hsgd.checkpoint.store import export, open_checkpoint
from hsgd.errors import UsageError


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(prog="python -m hsgd.checkpoint", description="Inspect or export an hsgd checkpoint.")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="write the full model under the serial parameter names to an .npz file")
    e.add_argument("dir", help="a checkpoint directory (step-NNNNNN) or a --save-dir (its newest checkpoint)")
    e.add_argument("out", help="the .npz file to write")
    i = sub.add_parser("info", help="print what a checkpoint holds, after verifying its files")
    i.add_argument("dir")
    args = p.parse_args(argv)
    try:
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
    except UsageError as err:
        print(f"hsgd: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

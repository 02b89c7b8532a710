"""The ``omniep`` command: ``info``, ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import logging
import sys

from . import __version__


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="omniep", description=__doc__)
    parser.add_argument("--version", action="version", version=f"omniep {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="version, vendor, devices, OMNIEP_* settings and every backend's availability")
    info.add_argument("--json", action="store_true", help="the same report as JSON")
    info.add_argument("--build", action="store_true", help="only what the native build built, and why not the rest")
    demo = sub.add_parser("demo", help="a toy MoE layer on 8 JAX CPU devices and 4 gloo ranks, checked")
    demo.add_argument("--frameworks", default="jax,torch", help="comma-separated: jax, torch")
    bench = sub.add_parser("bench", help="time dispatch/combine of the selected backend")
    bench.add_argument("--ranks", type=int, default=None, help="EP ranks (default: GPUs, or 2 on CPU)")
    bench.add_argument("--tokens", type=int, default=None, help="tokens per rank (default: DeepEP's, scaled)")
    bench.add_argument("--hidden", type=int, default=None)
    bench.add_argument("--iters", type=int, default=None)
    bench.add_argument("--out", default="bench_out", help="folder for the table and the PNG plot")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)  # keep "no TPU here" probes out of the output
    if args.command == "info":
        from .tools.info import main as run
        return run(as_json=args.json, build_only=args.build)
    if args.command == "demo":
        from .tools.demo import main as run
        return run(frameworks=args.frameworks.split(","))
    from .tools.bench import main as run
    return run(ranks=args.ranks, tokens=args.tokens, hidden=args.hidden, iters=args.iters, out=args.out)


if __name__ == "__main__":
    sys.exit(main())

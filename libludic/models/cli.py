"""``ludic model init DIR [--size tiny|small] [--seed N]``."""

from __future__ import annotations

import argparse

from libludic.models.tiny import SIZES, init_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ludic model")
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("init", help="write a tiny Qwen2 model + byte tokenizer to DIR")
    i.add_argument("dir")
    i.add_argument("--size", default="tiny", choices=sorted(SIZES))
    i.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = init_model(a.dir, size=a.size, seed=a.seed)
    print(f"wrote {a.size} model to {out}")
    return 0

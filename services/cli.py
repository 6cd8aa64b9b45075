"""``ludic`` console script: dispatches a subcommand to the module that owns it.

Each entry is ``"module:function"``; the function takes the remaining argv and returns
an exit code. Modules are imported lazily so ``ludic --help`` stays fast and a service's
heavy dependencies (vLLM, torch) load only when that service runs.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "model": (
        "libludic.models.cli:main",
        "the tiny offline model (init DIR) or a pretrained one (import SOURCE OUT)",
    ),
    "demo": ("services.demo:main", "rollouts of the tiny model in-process (no services)"),
    "sft": (
        "libludic.sft.cli:main",
        "supervised fine-tuning on a JSONL file or a task's data",
    ),
    "inference": ("services.inference.main:main", "vLLM inference service with weight updates"),
    "actor": ("services.actor.main:main", "stateless rollout worker"),
    "credit": ("services.credit.main:main", "credit-assignment worker: rollouts -> SAWItems"),
    "learner": ("services.learner.main:main", "FSDP2 learner: SAWItems -> training -> publish"),
    "feeder": ("services.feeder.main:main", "keeps the rollout request stream topped up"),
    "eval": ("services.eval.main:main", "held-out greedy pass rate every N learner steps"),
    "sandbox": (
        "libludic.envs.code_exec.docker:main",
        "build the DockerSandbox image: sandbox build",
    ),
    "status": ("services.status:main", "stream depths, pending entries, versions"),
    "plugins": ("services.plugins:main", "the registered kinds (envs, tools, rewards, ...)"),
    "check": (
        "services.launcher.check:main",
        "build every task, eval and algorithm of a run config once, in seconds",
    ),
    "up": ("services.launcher.main:main", "start the whole stack as local processes"),
}


def _usage() -> str:
    lines = ["usage: ludic <command> [args...]", "", "commands:"]
    for name, (_, help_) in COMMANDS.items():
        lines.append(f"  {name:<10} {help_}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"ludic: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    target, _ = COMMANDS[name]
    mod_name, fn_name = target.split(":")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name and (mod_name == e.name or mod_name.startswith(e.name + ".")):
            print(f"ludic: command {name!r} is not available in this build ({e})", file=sys.stderr)
            return 2
        raise
    return int(getattr(mod, fn_name)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

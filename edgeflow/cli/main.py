"""edgeflow: one command for every entry point (the console script pip installs; `python -m edgeflow.cli.main` is the same).

    edgeflow up && edgeflow release --profile configs/test-tiny.yaml --deploy none

Each subcommand runs an existing entry point, its own `python -m` command line, with the arguments that follow it:
nothing is implemented twice, and `edgeflow SUBCOMMAND --help` prints that entry point's options after an example.

Exit codes: 0 done; 1 a run failed (a release whose gate nobody passed, a failed rollout, a check that failed);
2 bad input (an unknown subcommand or option, a profile that does not load, a path that is not what it should be),
with one message naming the argument or field and the fix, never a traceback. Output is plain text.
"""
from __future__ import annotations

import difflib
import os
import runpy
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from edgeflow.paths import REPO_ROOT

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


@dataclass(frozen=True)
class Command:
    target: str  # a module (run as `python -m`) or a script path relative to the repository
    summary: str
    example: str
    fixed: tuple[str, ...] = ()  # arguments placed before the user's
    positional: str | None = None  # a first bare argument becomes this option (serve ENGINE_DIR -> --engine ENGINE_DIR)
    profile: bool = False  # takes --profile (default configs/demo-cpu.yaml): loaded first, a bad one is exit 2
    services: bool = False  # talks to the servers `edgeflow up` started (their environment unless one is set)


COMMANDS: dict[str, Command] = {
    "up": Command("scripts/services.py", "start the Prefect and MLflow servers, pools, workers and the monitoring stack",
                  "edgeflow up", ("up",)),
    "down": Command("scripts/services.py", "stop everything `up` and the edge deploys started", "edgeflow down", ("down",)),
    "init": Command("edgeflow.cli.init_profile", "write a commented profile for your own model (family, engines, group size, "
                    "student, placement)", "edgeflow init /models/qwen2.5-0.5b-instruct --hosts a100,orin,cpu --out configs/qwen.yaml"),
    "release": Command("edgeflow.pipeline.release", "run the chain on a profile: distill to a registered (and deployed) version",
                       "edgeflow release --profile configs/test-tiny.yaml --deploy none", profile=True, services=True),
    "nightly": Command("edgeflow.pipeline.nightly", "recalibrate from the last day's access logs and register a new staging version",
                       "edgeflow nightly --profile configs/demo-cpu.yaml --logs-dir data/access_logs", profile=True,
                       services=True),
    "promote": Command("edgeflow.pipeline.promote", "move a version to staging or production, checked",
                       "edgeflow promote --profile configs/demo-cpu.yaml --to production", profile=True, services=True),
    "rollback": Command("edgeflow.pipeline.promote", "point production back at `previous` and deploy it",
                        "edgeflow rollback --profile configs/demo-cpu.yaml", ("--rollback",), profile=True, services=True),
    "rollout": Command("edgeflow.pipeline.rollout", "roll a version over the fleet in watched waves",
                       "edgeflow rollout --profile configs/test-multihost.yaml --version 2", profile=True, services=True),
    "fleet": Command("edgeflow.cli.fleet", "the registered devices (list, targets, show, register, worker)", "edgeflow fleet list",
                     services=True),
    "follow": Command("edgeflow.pipeline.progress", "follow a flow run's stages and progress bars until it ends",
                      "edgeflow follow 463cb435-858f-4cec-ba4e-2cbd20398b5d", services=True),
    "serve": Command("edgeflow.serving.server", "serve an engine directory (OpenAI-compatible API, chat page, metrics)",
                     "edgeflow serve .edgeflow/device/versions/v2-51b54769b790/engine --port 8001", positional="--engine"),
    "plan": Command("edgeflow.pipeline.plan", "what a release of a profile would compute, reuse from the cache and fetch, and where, "
                    "without running anything", "edgeflow plan configs/demo-cpu.yaml", positional="--profile", profile=True,
                    services=True),
    "report": Command("edgeflow.cli.main", "print a release's report (reports/RELEASE.md)", "edgeflow report demo-cpu-20261205-044221-463cb435"),
    "doctor": Command("edgeflow.cli.doctor", "check this host for its role in a profile (versions, device, dtypes, engines "
                      "built and scored on a tiny model): doctor.json and doctor.md", "edgeflow doctor --role cpu --out doctor-out",
                      profile=True),
    "estimate": Command("edgeflow.cli.estimate", "how fast and how big a model can be on a device (decode, TTFT, memory), "
                        "before anything is built", "edgeflow estimate --model /models/qwen2.5-1.5b --bits 4 --device "
                        "orin-nano-8gb --runtime tensorrt_llm --prompt 512"),
    "envcheck": Command("edgeflow.ops.envcheck", "check this host against an image target (CUDA, TensorRT, Jetson)",
                        "edgeflow envcheck --target cpu"),
    "page-test": Command("edgeflow.ops.monitoring", "freeze a server twice and print the pages it raised, with their seconds",
                         "edgeflow page-test --profile configs/demo-cpu.yaml", ("page-test",), profile=True),
    "completion": Command("edgeflow.cli.main", "print a bash completion script: source <(edgeflow completion bash)",
                          "source <(edgeflow completion bash)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: edgeflow SUBCOMMAND [ARGS...]   (edgeflow SUBCOMMAND --help: its options)", "", "subcommands:"]
    lines += [f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items()]
    lines += ["", "examples:"] + [f"  {c.example}" for c in COMMANDS.values()]
    lines += ["", "exit codes: 0 done, 1 a run failed, 2 bad input"]
    return "\n".join(lines)


def completion_script() -> str:
    """bash completion: subcommands, then the files of the working directory."""
    names = " ".join(COMMANDS)
    return (
        "_edgeflow() {\n"
        "  local cur=${COMP_WORDS[COMP_CWORD]}\n"
        "  if [ \"$COMP_CWORD\" -eq 1 ]; then\n"
        f"    COMPREPLY=( $(compgen -W \"{names} --help\" -- \"$cur\") )\n"
        "  else\n"
        "    COMPREPLY=( $(compgen -f -- \"$cur\") )\n"
        "  fi\n"
        "}\n"
        "complete -o filenames -F _edgeflow edgeflow\n"
    )


def report(args: list[str]) -> int:
    if len(args) != 1 or args[0].startswith("-"):
        print("edgeflow report: give one release id, e.g. edgeflow report demo-cpu-20261205-044221-463cb435 "
              f"(the reports are in {REPO_ROOT / 'reports'})", file=sys.stderr)
        return EXIT_USAGE
    path = REPO_ROOT / "reports" / f"{args[0]}.md"
    if not path.exists():
        known = [p.stem for p in sorted((REPO_ROOT / "reports").glob("*.md"), key=lambda p: p.stat().st_mtime)][-3:]
        print(f"edgeflow report: no report {path}; the latest are {known or 'none'} (a release writes its report "
              "at its end, and logs it to its MLflow run)", file=sys.stderr)
        return EXIT_USAGE
    print(path.read_text(), end="")
    return EXIT_OK


def _profile_arg(args: list[str]) -> str:
    for i, a in enumerate(args):
        if a == "--profile" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--profile="):
            return a.split("=", 1)[1]
    return "configs/demo-cpu.yaml"  # the entry points' own default


def _services_env() -> None:
    """The environment `edgeflow up` gives its servers' clients (scripts/services.py env), where none is set yet."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("edgeflow_services", REPO_ROOT / "scripts" / "services.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for key, value in module.service_env().items():
        os.environ.setdefault(key, value)


def _run(cmd: Command, name: str, args: list[str]) -> int:
    argv = [f"edgeflow {name}", *cmd.fixed, *args]
    saved = sys.argv
    sys.argv = argv
    # runpy sets argv[0] to the module's file; the entry point's parser takes its name from here instead (and pops
    # it, so nothing the entry point starts inherits it)
    # (a fixed subcommand of the entry point, as in `edgeflow up`, names itself after "edgeflow")
    os.environ["EDGEFLOW_PROG"] = "edgeflow" if cmd.fixed and not cmd.fixed[0].startswith("-") else f"edgeflow {name}"
    try:
        with warnings.catch_warnings():  # runpy's note that the module was imported before (the preflight imports some)
            warnings.filterwarnings("ignore", category=RuntimeWarning, message=".*found in sys.modules")
            if cmd.target.endswith(".py"):
                runpy.run_path(str(REPO_ROOT / cmd.target), run_name="__main__")
            else:
                runpy.run_module(cmd.target, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # the entry point's own exit status (argparse: 2 on bad options)
        code = e.code
        if code is None or isinstance(code, int):
            return code or EXIT_OK
        print(code, file=sys.stderr)  # sys.exit("message"): a refusal with its reason
        return EXIT_FAILED
    finally:
        sys.argv = saved
        os.environ.pop("EDGEFLOW_PROG", None)
    return EXIT_OK


def _bad_input(e: BaseException) -> bool:
    from pydantic import ValidationError

    return isinstance(e, (ValidationError, FileNotFoundError, IsADirectoryError)) or type(e).__name__ in (
        "MonitoringConfigError", "PlacementError", "EngineIncompatibleError")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return EXIT_OK if argv else EXIT_USAGE
    name, args = argv[0], argv[1:]
    cmd = COMMANDS.get(name)
    if cmd is None:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        print(f"edgeflow: unknown subcommand {name!r}" + (f"; did you mean {close[0]!r}?" if close else "")
              + f" (subcommands: {', '.join(COMMANDS)}; edgeflow --help)", file=sys.stderr)
        return EXIT_USAGE
    if name == "completion":
        if args not in ([], ["bash"]):
            print(f"edgeflow completion: only bash is supported (got {' '.join(args)}); "
                  "source <(edgeflow completion bash)", file=sys.stderr)
            return EXIT_USAGE
        print(completion_script(), end="")
        return EXIT_OK
    if name == "report":
        return report(args)
    if cmd.positional and args and not args[0].startswith("-"):
        args = [cmd.positional, *args]  # serve ENGINE_DIR -> --engine ENGINE_DIR, plan PROFILE -> --profile PROFILE
    if "-h" in args or "--help" in args:
        print(f"example: {cmd.example}\n")
    try:
        if cmd.profile and not ("-h" in args or "--help" in args):
            from edgeflow.preflight import load_profile

            load_profile(_profile_arg(args))  # a profile that does not load never reaches a flow run
        if cmd.services:
            _services_env()
        return _run(cmd, name, args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - one line naming what failed, never a traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if _bad_input(e):
            from pydantic import ValidationError

            what = str(e).strip() if isinstance(e, ValidationError) else first  # every field it names, with its fix
            print(f"edgeflow {name}: {what}", file=sys.stderr)
            return EXIT_USAGE
        print(f"edgeflow {name}: failed: {type(e).__name__}: {first}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())

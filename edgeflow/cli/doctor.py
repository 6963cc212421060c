"""edgeflow doctor: check this host for the role it plays in a profile (edgeflow/ops/doctor), write doctor.json and
doctor.md, and exit 0 when every check passed, 1 when any failed (the report is written either way), 2 for bad input.

    edgeflow doctor --role cpu --out doctor-out
    edgeflow doctor --profile configs/production-a100-orin.yaml --role a100 --out /tmp/doctor
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def main(argv: list[str] | None = None) -> int:
    from edgeflow.ops.doctor import ROLES, default_role, run_doctor

    parser = argparse.ArgumentParser(prog="edgeflow doctor", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="configs/demo-cpu.yaml",
                        help="the profile whose engine backend and distillation settings the checks use")
    parser.add_argument("--role", choices=ROLES, default=None,
                        help="the role to check this host for (default: orin on a Jetson, a100 with a CUDA GPU, else cpu)")
    parser.add_argument("--out", type=Path, default=Path("doctor-out"),
                        help="where doctor.json, doctor.md and the checks' scratch files go (default ./doctor-out)")
    args = parser.parse_args(argv)

    from pydantic import ValidationError

    from edgeflow.preflight import load_profile

    try:
        profile = load_profile(args.profile)
    except (ValidationError, FileNotFoundError, ValueError) as e:
        print(f"edgeflow doctor: --profile {args.profile} does not load: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.out.exists() and not args.out.is_dir():
        print(f"edgeflow doctor: --out {args.out} is a file; give a directory (it is created if missing)", file=sys.stderr)
        return EXIT_USAGE
    role = args.role or default_role()
    print(f"edgeflow doctor: role {role}, profile {args.profile}, report in {args.out}/doctor.md")
    report = run_doctor(profile, args.profile, role, args.out)
    failed = report.failed()
    print(f"{len(report.checks) - len(failed)} of {len(report.checks)} checks did not fail "
          f"({sum(c.status == 'skip' for c in report.checks)} skipped) in {report.seconds:.0f} s; "
          f"report: {args.out / 'doctor.md'}, {args.out / 'doctor.json'}")
    for c in failed:
        print(f"FAILED {c.name}: {c.reason}", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

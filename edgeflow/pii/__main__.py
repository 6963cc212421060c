"""`python -m edgeflow.pii TEXT...`: each text scrubbed to stdout, the counts of what was replaced to stderr."""
import sys

from edgeflow.pii import scrub

for arg in sys.argv[1:] or [sys.stdin.read()]:
    out, found = scrub(arg)
    print(out)
    print(found, file=sys.stderr)

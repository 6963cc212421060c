"""edgeflow/estimate/probe.py: the host's read bandwidth and FMA peak, measured by the compiled probe."""
from __future__ import annotations

import pytest

from edgeflow.estimate.probe import probe


def test_the_probe_measures_a_read_stream_and_fmas_on_the_threads_it_is_given():
    one = probe(threads=1, mib=64, repeats=1)
    assert one.threads == 1 and one.buffer_mib == 64
    assert one.read_gb_s > 0.5 and one.fma_gflops > 1  # a stream and FMAs ran: no x86 host reads slower
    assert "avx2" in one.isa and one.cpu


@pytest.mark.parametrize("kwargs, says", [({"threads": 0}, "threads: 0 is outside 1-256"),
                                          ({"threads": 1, "mib": 0}, "mib: 0 must be at least 1")])
def test_bad_probe_arguments_are_named(kwargs, says):
    with pytest.raises(ValueError, match=says):
        probe(**kwargs)

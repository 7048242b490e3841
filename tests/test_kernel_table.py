"""``benchmarks/target_step.py``'s kernel table: kernels that overlap (PDL starts a kernel before its predecessor
ends, and its span includes that wait) count each microsecond of the step once."""

from .helpers import load_benchmark


def test_overlapping_kernels_share_the_step_once_and_gaps_stay_out():
    ts = load_benchmark("target_step")
    # gemv, then norm launched early (PDL) waiting 5-10, then gemv; a gap; copy; and a kernel on a parallel branch
    # inside the first gemv's span (concurrent time goes to the kernel that ends first)
    trace = [("gemv", 0.0, 10.0), ("norm", 5.0, 20.0), ("gemv", 20.0, 22.0), ("copy", 30.0, 31.0),
             ("branch", 2.0, 8.0)]
    rows = ts.exclusive_us(trace)
    assert [(n, o) for n, o, _ in rows] == [("branch", 6.0), ("gemv", 2.0), ("norm", 10.0), ("gemv", 2.0),
                                            ("copy", 1.0)]
    assert sum(o for _, o, _ in rows) == 21.0  # the union of the spans: 0-22 and 30-31; the gap 22-30 is nobody's
    table = ts.kernel_table(dict(layers=1, label="x", replay_ms=0.04, trace=trace))
    assert "own time 0.021 ms of a 0.040 ms replay (52%" in table
    assert table.splitlines()[2].split()[:3] == ["1", "10.0", "15.0"]  # norm first: the most own time

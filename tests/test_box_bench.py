"""``parambox bench box`` end to end on tiny sizes: every figure present, ratios computed."""

from __future__ import annotations

import pytest

from parambox.bench.box import run_bench_box
from parambox.runtime.spawn import find_mpiexec


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_box_reports_every_figure() -> None:
    result = run_bench_box(json_out=True, sizes_mb=(1, 2), repeats=2)
    ops = result["ops"]
    expected = ["numpy_add", "numpy_copy", "shm_push", "shm_pull", "gloo_allreduce"]
    if find_mpiexec():
        expected += ["rma_push", "rma_pull", "mpi_allreduce", "rma_tcp_push", "rma_tcp_pull"]
        expected += ["rma_pull_get", "rma_push_sharded", "rma_tcp_pull_get", "mpi_allreduce_tcp"]
        assert result["rma_push_vs_gloo"] > 0
        assert result["rma_pull_noop_vs_get"] > 0 and result["rma_push_memory_vs_sharded"] > 0
    assert "errors" not in result, result.get("errors")
    for op in expected:
        assert set(ops[op]) == {"1", "2"}, op
        assert all(f["ms"] > 0 and f["gbps"] > 0 for f in ops[op].values()), op
    assert result["shm_push_vs_add"] > 0 and result["shm_push_vs_gloo"] > 0

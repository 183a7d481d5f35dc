"""hsgd.verify's main on 8 ranks, in one process per rank for all its layouts (one mpiexec instead of one each):
float64 layouts of every kind pass against serial SGD, and the tolerance oracle passes on three bfloat16 layouts."""
import pytest

from hsgd import verify

from .conftest import check

pytestmark = pytest.mark.mpi(min_size=8)


@pytest.mark.parametrize("flags", [["--tp", "4", "--tp-scheme", "gather", "--micro-batches", "2"],
                                   ["--tp", "4", "--tp-scheme", "sequence"], ["--tp", "1", "--dtype", "float32"],
                                   ["--pp", "2", "--tp", "2", "--micro-batches", "2", "--schedule", "gpipe"],
                                   ["--pp", "2", "--tp", "2", "--micro-batches", "2", "--zero", "3", "--recompute",
                                    "full", "--tp-scheme", "sequence"],
                                   ["--tp", "2", "--zero", "1", "--recompute", "selective"],
                                   ["--zero", "3", "--hierarchical", "--ranks-per-node", "2"],
                                   ["--cp", "2", "--tp", "2"], ["--cp", "4", "--pp", "2", "--cp-scheme", "allgather",
                                                                "--micro-batches", "2"],
                                   ["--dtype", "bfloat16", "--layouts", "1x1x1,2x1x4,1x2x4", "--seeds", "1"]],
                         ids=lambda flags: " ".join(flags))
def test_verify_passes(flags):
    check(verify.main(flags) == 0, f"hsgd.verify {' '.join(flags)}")

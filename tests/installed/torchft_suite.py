"""torchft 0.2.0's own process-group tests (torchft/process_group_test.py, in
its wheel) on collx, as a torchft user would run them: torchft's
ProcessGroupGloo test bodies, with torchcollx.torchft.ProcessGroupCollx in
its place. Every collective, run by 3 ranks as threads of one process, and
again after the last rank shuts its group down; and torchft's API test.

    python -m pytest torchft_suite.py      (in a venv with torchft and the torchcollx wheel)
"""
from datetime import timedelta
from unittest import TestCase

import torch
from parameterized import parameterized
from torch.distributed import TCPStore
from torchft import process_group_test as torchft_tests

from torchcollx.torchft import ProcessGroupCollx


class CollxMultiPgTest(torchft_tests.MultiPgBaseTest):
    BACKEND = "collx"
    WORLD_SIZE = 3

    @classmethod
    def _create_pg(cls, backend):
        return ProcessGroupCollx(timeout=timedelta(seconds=10))

    @parameterized.expand(torchft_tests._ALL_COLLECTIVES)
    def test_collective(self, collective):
        self._run_parallel(collective, device="cpu")

    @parameterized.expand(torchft_tests._ALL_COLLECTIVES)
    def test_collective_with_resiliency(self, collective):
        self._run_with_resiliency(collective, device="cpu")


class CollxApiTest(TestCase):
    def test_collx_apis(self):  # torchft's test_gloo_apis, on collx
        store = TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
        pg = ProcessGroupCollx()
        pg.configure(f"localhost:{store.port}/prefix", "0", 0, 1)
        self.assertEqual(pg.size(), 1)
        torchft_tests._test_pg(pg, torch.tensor([2]))
        m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 4), process_group=pg)
        m(torch.rand(2, 3))
        pg.shutdown()
